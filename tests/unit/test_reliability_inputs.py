"""Inputs that used to surprise silently or fail with a traceback (issue 21, items 5 and 7).

- preference pairs whose chosen equals rejected are skipped and counted;
- a dataset repository laid out as on the HF hub (parquet files under data/) loads, and a
  directory that is no dataset is one clear error;
- a dataset too small to hold out rows says that there is no held-out split;
- exported weights follow the umask (safetensors alone writes 0600).
"""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest

from aligner.config import DataConfig, ModelConfig, TaskConfig
from aligner.data import load_data, load_records
from aligner.data.task import build_task_tokenizer
from aligner.model.hf import save_hf
from aligner.model.llama import build_model
from aligner.model.tokenizer import load_tokenizer


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_pairs_with_chosen_equal_to_rejected_are_skipped_and_counted(tmp_path, caplog):
    rows = [{"prompt": "1+2=", "chosen": "3", "rejected": "4"}, {"prompt": "1+1=", "chosen": "2", "rejected": "2"},
            {"prompt": "2+2=", "chosen": "4", "rejected": "5"}]
    path = _jsonl(tmp_path / "pairs.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="aligner.data"):
        res = load_records(path, "auto", "pairs")
    assert [r["chosen"] for r in res.records] == ["3", "4"]
    assert res.num_tied == 1 and res.num_skipped == 0
    assert f"{path}:2" in caplog.text and "chosen equals rejected" in caplog.text
    # the same file still gives all three prompts to a stage that reads prompts
    assert len(load_records(path, "auto", "prompt").records) == 3


def test_hub_repository_layout_loads_its_train_parquet_files(tmp_path):
    import datasets

    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    (repo / "README.md").write_text("# a dataset card")
    datasets.Dataset.from_list([{"prompt": f"{i}+1=", "response": str(i + 1)} for i in range(3)]).to_parquet(
        str(repo / "data" / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_list([{"prompt": "9+9=", "response": "18"}]).to_parquet(
        str(repo / "data" / "test-00000-of-00001.parquet"))
    res = load_records(str(repo), "auto", "sft")
    assert [r["prompt"] for r in res.records] == ["0+1=", "1+1=", "2+1="]
    assert res.records[0]["source"].endswith("train-00000-of-00001.parquet:1")


def test_a_directory_that_is_no_dataset_is_one_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"neither a saved HF dataset .* nor a dataset repository"):
        load_records(str(tmp_path), "auto", "sft")


def test_a_dataset_too_small_to_hold_out_says_there_is_no_held_out_split(tmp_path, caplog):
    tok = load_tokenizer(build_task_tokenizer(TaskConfig(tokenizer_vocab_size=128), str(tmp_path / "tok")))
    path = _jsonl(tmp_path / "one.jsonl", [{"prompt": "1+2=", "response": "3"}])
    with caplog.at_level(logging.WARNING, logger="aligner.data"):
        splits = load_data("sft", DataConfig(train_path=path, max_prompt_len=8, max_seq_len=16), TaskConfig(), tok,
                           str(tmp_path))
    assert len(splits.train) == 1 and splits.eval == []
    assert "no held-out split" in caplog.text


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_exported_weights_follow_the_umask(tmp_path, umask):
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                      max_seq_len=16)
    old = os.umask(umask)
    try:
        out = save_hf(build_model(cfg, seed=0).state_dict(), cfg, tmp_path / "hf")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o777 & ~umask
    for name in ("config.json", "model.safetensors"):
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o666 & ~umask, name
