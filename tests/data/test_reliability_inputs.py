"""Inputs that used to surprise silently or fail with a traceback.

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

from aligner.config import DataConfig, TaskConfig
from aligner.data import load_data, load_records
from aligner.data.task import build_task_tokenizer
from aligner.data.tokenizer import load_tokenizer
from aligner.model.hf import save_hf
from aligner.model.llama import build_model
from tests.toolkit.models import tiny_model_config


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_pairs_with_chosen_equal_to_rejected_are_skipped_and_counted(tmp_path, caplog):
    rows = [
        {"prompt": "1+2=", "chosen": "3", "rejected": "4"},
        {"prompt": "1+1=", "chosen": "2", "rejected": "2"},
        {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
    ]
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
        str(repo / "data" / "train-00000-of-00001.parquet")
    )
    datasets.Dataset.from_list([{"prompt": "9+9=", "response": "18"}]).to_parquet(str(repo / "data" / "test-00000-of-00001.parquet"))
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
        splits = load_data("sft", DataConfig(train_path=path, max_prompt_len=8, max_seq_len=16), TaskConfig(), tok, str(tmp_path))
    assert len(splits.train) == 1 and splits.eval == []
    assert "no held-out split" in caplog.text


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_exported_weights_follow_the_umask(tmp_path, umask):
    cfg = tiny_model_config(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, max_seq_len=16)
    old = os.umask(umask)
    try:
        out = save_hf(build_model(cfg, seed=0).state_dict(), cfg, tmp_path / "hf")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o777 & ~umask
    for name in ("config.json", "model.safetensors"):
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o666 & ~umask, name


def test_a_full_disk_is_one_line_naming_the_path_for_the_driver_and_for_a_worker(capsys):
    import errno

    from aligner.cli import run
    from aligner.errors import WorkerError, disk_full_path

    def driver_write(cfg):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/run/metrics.jsonl")

    assert run("sft", driver_write, ["trainer.progress=false"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the disk is full: no space left on device writing /data/run/metrics.jsonl" in err[0], err

    try:  # a worker's save: the path travels inside the WorkerError (pickled through Ray)
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/data/run/checkpoints/.step_4/actor/__0_0.distcp")
        except OSError as inner:
            raise RuntimeError("dcp save failed") from inner
    except RuntimeError as e:
        path = disk_full_path(e)
    err_obj = WorkerError("actor", 1, "traceback...", "save", path)
    import pickle

    err_obj = pickle.loads(pickle.dumps(err_obj))

    def worker_write(cfg):
        raise err_obj

    assert run("sft", worker_write, ["trainer.progress=false"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "writing /data/run/checkpoints/.step_4/actor/__0_0.distcp (actor rank 1, save)" in err[0], err


def test_sft_on_a_machine_too_small_for_its_workers_stops_before_ray(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "aligner.sft", "conf=tiny", "actor.resources.cpus_per_worker=512", f"output_dir={out}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("aligner sft")]
    assert len(lines) == 1 and "this machine cannot hold the run (512 CPU" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not out.exists()
