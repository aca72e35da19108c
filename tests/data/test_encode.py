"""Data formats, validation errors with file:line, encoding and loss masks, truncation, collation, packing, sampler."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from aligner.config import DataConfig, TaskConfig, TokenizerConfig
from aligner.data import (
    DataIterator,
    collate_pairs,
    collate_prompts,
    collate_sft,
    encode_records,
    load_data,
    load_records,
    pack_sft,
    resolve_tokenizer,
)
from aligner.data.pipeline import as_user_turn
from aligner.data.task import build_task_tokenizer
from aligner.data.tokenizer import load_tokenizer
from aligner.model.llama import default_position_ids
from tests.toolkit.paths import shared_path


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return str(path)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    return load_tokenizer(build_task_tokenizer(TaskConfig(tokenizer_vocab_size=128), str(d)))


ROWS = {
    "prompt": [{"prompt": "1+2=", "answer": "3"}],
    "sft": [{"prompt": "1+2=", "response": "3"}],
    "chat": [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
    "pairs": [{"prompt": "1+2=", "chosen": "3", "rejected": "4"}],
    "hh": [{"chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "\n\nHuman: hi\n\nAssistant: go away"}],
    "gsm8k": [{"question": "1+1?", "answer": "one plus one <<1+1=2>>2\n#### 2"}],
}


@pytest.mark.parametrize("fmt", list(ROWS))
def test_auto_detect_each_format(tmp_path, fmt, caplog):
    path = write_jsonl(tmp_path / f"{fmt}.jsonl", ROWS[fmt])
    with caplog.at_level(logging.INFO, logger="aligner.data"):
        res = load_records(path)
    assert res.format == fmt
    assert f"format {fmt!r}" in caplog.text
    rec = res.records[0]
    assert rec["source"] == f"{path}:1"
    if fmt == "hh":
        assert rec["prompt"] == "\n\nHuman: hi\n\nAssistant:"
        assert (rec["chosen"], rec["rejected"]) == (" hello", " go away")
    if fmt == "gsm8k":
        assert rec["prompt"] == "1+1?" and rec["metadata"]["answer"] == "2"
    if fmt == "prompt":
        assert rec["metadata"] == {"answer": "3"}


def test_json_parquet_and_dataset_dir(tmp_path):
    import datasets

    rows = [{"prompt": f"{i}+1=", "response": str(i + 1)} for i in range(5)]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    (tmp_path / "b.json").write_text(json.dumps({"data": rows}))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "c.parquet"))
    ds.save_to_disk(str(tmp_path / "d"))
    for name in ("a.json", "b.json", "c.parquet", "d"):
        res = load_records(str(tmp_path / name))
        assert res.format == "sft" and [r["response"] for r in res.records] == ["1", "2", "3", "4", "5"], name
    assert res.records[2]["source"].endswith("d:3")


def test_unknown_and_ambiguous_fields(tmp_path):
    with pytest.raises(ValueError, match=r"u\.jsonl:1: fields \['body'\] matches no format.*sft: \{'prompt', 'response'\}"):
        load_records(write_jsonl(tmp_path / "u.jsonl", [{"body": "x"}]))
    amb = {"prompt": "p", "response": "r", "chosen": "c", "rejected": "x"}
    with pytest.raises(ValueError, match="ambiguous between sft, pairs"):
        load_records(write_jsonl(tmp_path / "a.jsonl", [amb]))
    assert load_records(str(tmp_path / "a.jsonl"), fmt="pairs").format == "pairs"
    with pytest.raises(ValueError, match="cannot supply pairs"):
        load_records(write_jsonl(tmp_path / "s.jsonl", ROWS["sft"]), kind="pairs")


BAD = [
    ("{not json", "invalid JSON"),
    (b"\xff\xfe", "not valid UTF-8"),
    ({"prompt": "1+2="}, "field 'response' is missing"),
    ({"prompt": 12, "response": "3"}, "field 'prompt' must be a string"),
    ({"prompt": "  ", "response": "3"}, "field 'prompt' is empty"),
    ([1, 2], "must be a JSON object"),
]


@pytest.mark.parametrize("bad,msg", BAD)
def test_bad_row_names_file_and_line(tmp_path, bad, msg):
    path = tmp_path / "d.jsonl"
    good = json.dumps({"prompt": "1+2=", "response": "3"}).encode()
    line = bad if isinstance(bad, bytes) else (bad if isinstance(bad, str) else json.dumps(bad)).encode()
    path.write_bytes(good + b"\n\n" + good + b"\n" + line + b"\n" + good + b"\n")
    with pytest.raises(ValueError, match=f"{path}:4: .*{msg}"):
        load_records(str(path), fmt="sft")


def test_bad_chat_and_hh_rows(tmp_path):
    p = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "robot", "content": "x"}]}])
    with pytest.raises(ValueError, match=r"c\.jsonl:1: field 'messages\[0\]\.role'"):
        load_records(p, fmt="chat")
    p = write_jsonl(tmp_path / "h.jsonl", [{"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: z\n\nAssistant: b"}])
    with pytest.raises(ValueError, match=r"h\.jsonl:1: .*do not share"):
        load_records(p, fmt="hh")


def test_skip_invalid_counts_and_reports(tmp_path, caplog):
    rows = [
        {"prompt": "1+2=", "response": "3"},
        "{bad",
        {"prompt": "x"},
        {"prompt": "2+2=", "response": "4"},
        {"prompt": 5, "response": "5"},
    ]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="aligner.data"):
        res = load_records(path, skip_invalid=True)
    assert res.num_skipped == 3 and len(res.records) == 2
    assert [r.split(": ")[0] for r in res.reasons] == [f"{path}:2", f"{path}:3", f"{path}:5"]
    assert "skipped 3 invalid rows" in caplog.text


def test_sft_response_only_loss_mask(tok):
    recs = [{"prompt": "12+39=", "response": "51", "source": "f:1", "metadata": {}}]
    ex = encode_records(recs, tok, DataConfig(), "sft").examples[0]
    expect = (
        [tok.bos_token_id]
        + tok.encode("12+39=", add_special_tokens=False)
        + tok.encode("51", add_special_tokens=False)
        + [tok.eos_token_id]
    )
    assert ex["input_ids"] == expect
    assert ex["loss_mask"] == [0] * 7 + [1, 1, 1]  # bos + 6 prompt tokens masked; "5", "1", eos trained


def test_chat_loss_on_assistant_turns_only(tok):
    msgs = [
        {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
    ]
    ex = encode_records([{"messages": msgs, "source": "c:1", "metadata": {}}], tok, DataConfig(max_seq_len=128), "sft").examples[0]
    trained = [t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m]
    assert trained == tok.encode("3<eos>4<eos>", add_special_tokens=False)
    assert tok.decode(ex["input_ids"]) == tok.apply_chat_template(msgs, tokenize=False)
    # RL prompt for a chat row: the trailing assistant turn is dropped, generation prompt added
    p = encode_records([{"messages": msgs, "source": "c:1", "metadata": {}}], tok, DataConfig(max_seq_len=128), "prompt").examples[0]
    assert tok.decode(p["prompt_ids"]).endswith("2+2=\n<|assistant|>\n")


def test_truncation_policies(tok):
    rec = {"prompt": "123456789+1=", "response": "123456790", "source": "t.jsonl:7", "metadata": {}}
    p_len = 1 + 12
    with pytest.raises(ValueError, match=r"t\.jsonl:7: prompt has 13 tokens > data\.max_prompt_len=8: .*data\.truncation"):
        encode_records([rec], tok, DataConfig(max_prompt_len=8, max_seq_len=64), "sft")
    res = encode_records([rec, {**rec, "prompt": "1+1="}], tok, DataConfig(max_prompt_len=8, max_seq_len=64, truncation="skip"), "sft")
    assert res.num_skipped == 1 and len(res.examples) == 1
    left = encode_records([rec], tok, DataConfig(max_prompt_len=8, max_seq_len=64, truncation="left"), "sft").examples[0]
    assert tok.decode(left["input_ids"][:8]) == "<bos>6789+1="  # bos kept, oldest prompt tokens dropped
    right = encode_records([rec], tok, DataConfig(max_prompt_len=8, max_seq_len=64, truncation="right"), "sft").examples[0]
    assert tok.decode(right["input_ids"][:8]) == "<bos>1234567"
    assert sum(left["loss_mask"]) == sum(right["loss_mask"]) == 10  # response + eos intact
    with pytest.raises(ValueError, match=r"t\.jsonl:7: prompt \+ response have 23 tokens > data\.max_seq_len=20"):
        encode_records([rec], tok, DataConfig(max_prompt_len=16, max_seq_len=20), "sft")
    cut = encode_records([rec], tok, DataConfig(max_prompt_len=16, max_seq_len=20, truncation="right"), "sft")
    assert len(cut.examples[0]["input_ids"]) == 20 and cut.num_truncated == 1
    assert p_len == 13


def test_collators(tok):
    recs = [
        {"prompt": "1+2=", "response": "3", "chosen": "3", "rejected": "4", "source": "a:1", "metadata": {"answer": "3"}},
        {"prompt": "10+20=", "response": "30", "chosen": "30", "rejected": "310", "source": "a:2", "metadata": {"answer": "30"}},
    ]
    sft = [e for e in encode_records(recs, tok, DataConfig(), "sft").examples]
    b = collate_sft(sft, tok.pad_token_id)
    assert b["input_ids"].shape == (2, 10) and b["input_ids"].dtype == torch.int64
    assert b["attention_mask"].sum(1).tolist() == [7, 10]
    assert (b["input_ids"][0, 7:] == tok.pad_token_id).all() and b["loss_mask"].dtype == torch.float32
    assert b["loss_mask"].sum(1).tolist() == [2, 3]
    pairs = collate_pairs(encode_records(recs, tok, DataConfig(), "pairs").examples, tok.pad_token_id)
    assert pairs["chosen_input_ids"].shape == pairs["rejected_input_ids"].shape == (2, 11)
    assert pairs["chosen_attention_mask"].sum(1).tolist() == [7, 10]
    assert pairs["rejected_attention_mask"].sum(1).tolist() == [7, 11]
    pr = collate_prompts(encode_records(recs, tok, DataConfig(), "prompt").examples)
    assert [len(p) for p in pr["prompt_ids"]] == [5, 7]
    assert pr["metadata"][1]["answer"] == "30" and pr["prompts"] == ["1+2=", "10+20="]


def test_packing_preserves_tokens_and_segments():
    lens = [5, 9, 3, 7, 2, 8, 6]
    exs = [
        {"input_ids": [100 * (i + 1) + j for j in range(n)], "loss_mask": [int(j >= n // 2) for j in range(n)]} for i, n in enumerate(lens)
    ]
    b = pack_sft(exs, max_seq_len=12, pad_id=0)
    ids, seg, pos, lm = b["input_ids"], b["segment_ids"], b["position_ids"], b["loss_mask"]
    assert ids.shape[1] <= 12 and ids.shape[0] < len(exs)
    got = sorted(t for t in ids[b["attention_mask"].bool()].tolist())
    assert got == sorted(t for e in exs for t in e["input_ids"])  # every token exactly once
    assert lm.sum().item() == sum(sum(e["loss_mask"]) for e in exs)
    assert ((seg == 0) == (b["attention_mask"] == 0)).all()
    for r in range(ids.shape[0]):  # each segment is one whole document with positions 0..n-1
        for s in seg[r].unique().tolist():
            if s == 0:
                continue
            sel = seg[r] == s
            doc = ids[r][sel].tolist()
            assert doc in [e["input_ids"] for e in exs]
            assert pos[r][sel].tolist() == list(range(len(doc)))
    # the model's own position derivation agrees on real tokens
    derived = default_position_ids(ids.shape[0], ids.shape[1], "cpu", seg)
    assert (derived[seg > 0] == pos[seg > 0]).all()
    with pytest.raises(ValueError, match="13 tokens > max_seq_len=12"):
        pack_sft([{"input_ids": [1] * 13, "loss_mask": [1] * 13, "source": "f:3"}], 12, 0)


def test_sampler_resumes_exactly():
    data = list(range(10))
    it = DataIterator(data, seed=3)
    first = it.next_batch(7) + it.next_batch(7)  # crosses into epoch 1
    assert sorted(first[:10]) == data and it.epoch == 1
    state = json.loads(json.dumps(it.state_dict()))
    rest = [it.next_batch(4) for _ in range(5)]
    again = DataIterator(data, seed=999)
    again.load_state_dict(state)
    assert [again.next_batch(4) for _ in range(5)] == rest
    assert DataIterator(data, seed=3).next_batch(10) == first[:10]  # deterministic from the seed
    assert DataIterator(data, seed=4).next_batch(10) != first[:10]
    assert DataIterator(data, shuffle=False).next_batch(12) == data + [0, 1]
    with pytest.raises(ValueError, match="taken over 10 examples, this dataset has 11"):
        DataIterator(list(range(11))).load_state_dict(state)


def test_pipeline_task_default(tmp_path):
    task = TaskConfig(num_sft=200, num_pairs=50, num_rl=40, num_eval=20, tokenizer_vocab_size=64)
    data = DataConfig(max_prompt_len=16, max_seq_len=32)
    tk = resolve_tokenizer(TokenizerConfig(), task, str(tmp_path))
    sft = load_data("sft", data, task, tk, str(tmp_path))
    assert (len(sft.train), len(sft.eval), sft.format) == (200, 20, "sft")
    rl = load_data("prompt", data, task, tk, str(tmp_path))
    assert rl.format == "prompt" and "answer" in rl.train[0]["metadata"]
    # a user file without eval_path: eval_fraction held out, deterministically
    path = write_jsonl(tmp_path / "u.jsonl", [{"prompt": f"{i}+0=", "response": str(i)} for i in range(40)])
    user = DataConfig(train_path=path, eval_fraction=0.25, max_prompt_len=16, max_seq_len=32)
    a, b = load_data("sft", user, task, tk, str(tmp_path)), load_data("sft", user, task, tk, str(tmp_path))
    assert (len(a.train), len(a.eval)) == (30, 10) and a.eval == b.eval


def test_shared_hh_file(tok):
    path = str(shared_path("data", "hh-rlhf", "harmless-base-test.jsonl"))
    res = load_records(path, kind="pairs", skip_invalid=True)
    assert res.format == "hh" and len(res.records) + res.num_skipped == 2312
    assert res.num_skipped < 50
    for r in res.records[:50]:
        assert r["prompt"].startswith("\n\nHuman:") and r["prompt"].endswith("\n\nAssistant:")
        assert "\n\nAssistant:" not in r["chosen"] and "\n\nHuman:" not in r["chosen"]


def test_shared_gsm8k_file():
    path = str(shared_path("data", "gsm8k", "train.jsonl"))
    res = load_records(path)
    assert res.format == "gsm8k" and len(res.records) == 7473 and res.num_skipped == 0
    r = res.records[0]
    assert r["prompt"].startswith("Natalia sold clips") and r["metadata"]["answer"] == "72"
    from aligner.reward.rules import score

    s = score(
        "gsm8k",
        [x["prompt"] for x in res.records[:100]],
        [x["response"] for x in res.records[:100]],
        [x["metadata"] for x in res.records[:100]],
    )
    assert s.sum().item() == 100  # the reference solutions score 1 against their own answers


def test_unknown_characters_are_counted(tok, caplog):
    recs = [
        {"prompt": "1+2=", "response": "3", "source": "u:1", "metadata": {}},
        {"prompt": "1+2=", "response": "€", "source": "u:2", "metadata": {}},
    ]
    with caplog.at_level(logging.WARNING, logger="aligner.data"):
        res = encode_records(recs, tok, DataConfig(), "sft")
    assert res.num_unk == 1 and "u:2: text maps to the unknown token" in caplog.text


def test_llama2_sft_boundary_and_mask():
    tk = load_tokenizer(str(shared_path("data", "tokenizers", "llama2", "tokenizer.model")))
    recs = [{"prompt": "Question: 12+39=", "response": "51", "source": "l:1", "metadata": {}}]
    res = encode_records(recs, tk, DataConfig(), "sft")
    ex = res.examples[0]
    assert res.num_boundary_mismatch == 0 and ex["input_ids"][0] == 1 and ex["input_ids"][-1] == 2
    trained = [t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m]
    assert tk.decode(trained, skip_special_tokens=True) == "51" and trained[-1] == tk.eos_token_id
    assert tk.decode(ex["input_ids"], skip_special_tokens=True) == "Question: 12+39=51"


def test_apply_chat_template_and_prompt_suffix_render_plain_rows_as_a_user_turn(tok, tmp_path):
    rows = [{"question": "1+1?", "answer": "two <<1+1=2>>2\n#### 2"}, {"question": "2+2?", "answer": "four\n#### 4"}]
    path = write_jsonl(tmp_path / "g.jsonl", rows)
    suffix = " Answer after ####."
    cfg = DataConfig(train_path=path, eval_fraction=0.0, max_seq_len=128, apply_chat_template=True, prompt_suffix=suffix)
    data = load_data("prompt", cfg, TaskConfig(), tok, str(tmp_path))
    user = [{"role": "user", "content": "1+1?" + suffix}]
    first = data.train[0]
    assert tok.decode(first["prompt_ids"]) == tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert first["prompt"] == "1+1?" + suffix and first["metadata"]["answer"] == "2"  # rule rewards see the text
    sft = load_data("sft", cfg, TaskConfig(), tok, str(tmp_path)).train[0]
    whole = user + [{"role": "assistant", "content": rows[0]["answer"]}]
    assert tok.decode(sft["input_ids"]) == tok.apply_chat_template(whole, tokenize=False)
    trained = [t for t, m in zip(sft["input_ids"], sft["loss_mask"]) if m]
    assert tok.decode(trained).startswith(rows[0]["answer"])  # the answer (and the template's end of turn) is trained
    # the suffix alone: [bos] + question + suffix, no template
    plain = load_data("prompt", DataConfig(train_path=path, eval_fraction=0.0, prompt_suffix=suffix), TaskConfig(), tok, str(tmp_path))
    assert plain.train[0]["prompt_ids"][1:] == tok.encode("1+1?" + suffix, add_special_tokens=False)
    assert as_user_turn({"prompt": "", "response": "x"}, suffix) == {"prompt": "", "response": "x"}  # text rows: no prompt


def test_pairs_as_chat_render_both_answers_as_assistant_turns(tok):
    rec = as_user_turn({"prompt": "1+2=", "chosen": "3", "rejected": "4", "source": "p:1", "metadata": {}}, "")
    ex = encode_records([rec], tok, DataConfig(max_seq_len=128), "pairs").examples[0]
    for name, ans in (("chosen_ids", "3"), ("rejected_ids", "4")):
        msgs = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": ans}]
        assert tok.decode(ex[name]) == tok.apply_chat_template(msgs, tokenize=False)
