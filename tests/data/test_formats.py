"""TRL's dataset types, standard and conversational, through the public loading path.

Each type (language modeling, prompt-only, prompt-completion, preference with explicit and
implicit prompt, unpaired preference; TRL docs "Dataset formats and types") is written as a
small file, loaded by :func:`load_records` / :func:`load_data` with format "auto", and its
normalized record and token ids are checked against the tokenizer's chat template. Bad rows
give "file:line" errors and are counted under skip_invalid.
"""

from __future__ import annotations

import json

import pytest

from aligner.config import DataConfig, TaskConfig
from aligner.data import encode_records, load_data, load_records
from aligner.data.task import build_task_tokenizer
from aligner.data.tokenizer import load_tokenizer


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def bot(text: str) -> dict:
    return {"role": "assistant", "content": text}


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def write_rows(path, rows) -> str:
    """`rows` as a .jsonl/.json/.parquet file or (no suffix) a saved HF dataset dir."""
    import datasets

    path = str(path)
    if path.endswith(".jsonl"):
        return write_jsonl(path, rows)
    if path.endswith(".json"):
        with open(path, "w", encoding="utf-8") as f:
            json.dump(rows, f)
    elif path.endswith(".parquet"):
        datasets.Dataset.from_list(rows).to_parquet(path)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(path)
    return path


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> str:
    return build_task_tokenizer(TaskConfig(tokenizer_vocab_size=128), str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def tok(tok_path):
    return load_tokenizer(tok_path)  # the default chat template: "<|user|>\n...\n<|assistant|>\n...<eos>"


def chat_ids(tok, msgs: list[dict], generation_prompt: bool) -> list[int]:
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
    return tok.encode(text, add_special_tokens=False)


def text_ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# name -> (rows, detected format, expected fields of the first record)
ULTRA = {  # UltraFeedback-binarized layout: string prompt, full conversations as chosen/rejected
    "prompt": "1+2=",
    "prompt_id": "a1",
    "chosen": [user("1+2="), bot("3")],
    "rejected": [user("1+2="), bot("4")],
    "score_chosen": 9.0,
    "score_rejected": 2.0,
}
CASES = {
    "text": ([{"text": "1+2=3"}], "text", {"prompt": "", "response": "1+2=3"}),
    "prompt_conv": ([{"prompt": [user("1+2=")]}], "prompt", {"messages": [user("1+2=")]}),
    "prompt_completion": ([{"prompt": "1+2=", "completion": "3"}], "prompt_completion", {"prompt": "1+2=", "response": "3"}),
    "prompt_completion_conv": (
        [{"prompt": [user("1+2=")], "completion": [bot("3")]}],
        "prompt_completion",
        {"messages": [user("1+2=")], "response": [bot("3")]},
    ),
    "pairs_conv": (
        [{"prompt": [user("1+2=")], "chosen": [bot("3")], "rejected": [bot("4")]}],
        "pairs",
        {"messages": [user("1+2=")], "chosen": [bot("3")], "rejected": [bot("4")], "response": [bot("3")]},
    ),
    "pairs_ultrafeedback": ([ULTRA], "pairs", {"messages": [user("1+2=")], "chosen": [bot("3")], "rejected": [bot("4")]}),
    "pairs_prompt_str_answers_conv": (
        [{"prompt": "1+2=", "chosen": [bot("3")], "rejected": [bot("4")]}],
        "pairs",
        {"messages": [user("1+2=")], "chosen": [bot("3")], "rejected": [bot("4")]},
    ),
    "implicit": (
        [{"chosen": "The sky is blue.", "rejected": "The sky is green."}],
        "hh",
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green.", "response": " blue."},
    ),
    "implicit_conv": (
        [{"chosen": [user("1+2="), bot("3")], "rejected": [user("1+2="), bot("4")]}],
        "hh",
        {"messages": [user("1+2=")], "chosen": [bot("3")], "rejected": [bot("4")]},
    ),
    "unpaired": (
        [{"prompt": "1+2=", "completion": "3", "label": True}],
        "unpaired",
        {"prompt": "1+2=", "completion": "3", "label": True, "response": None},
    ),
    "unpaired_conv": (
        [{"prompt": [user("1+2=")], "completion": [bot("4")], "label": False}],
        "unpaired",
        {"messages": [user("1+2=")], "completion": [bot("4")], "label": False},
    ),
}


def assert_record(rec: dict, expect: dict) -> None:
    for key, value in expect.items():
        assert rec[key] == value, (key, rec)
    assert not ("prompt" in rec and "messages" in rec)


@pytest.mark.parametrize("name", list(CASES))
def test_auto_detect_and_normalize(tmp_path, name):
    rows, fmt, expect = CASES[name]
    path = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    res = load_records(path)
    assert res.format == fmt and res.records[0]["source"] == f"{path}:1"
    assert_record(res.records[0], expect)


FILE_CASES = [
    ("text", "a.json"),
    ("prompt_completion_conv", "b.json"),
    ("pairs_conv", "c.parquet"),
    ("pairs_ultrafeedback", "d.parquet"),
    ("implicit_conv", "e"),
    ("unpaired_conv", "f"),
    ("prompt_conv", "g.parquet"),
    ("unpaired", "h.json"),
]


@pytest.mark.parametrize("name,file", FILE_CASES)
def test_json_parquet_and_dataset_dir(tmp_path, name, file):
    rows, fmt, expect = CASES[name]
    path = write_rows(tmp_path / file, rows * 3)
    res = load_records(path)
    assert res.format == fmt and len(res.records) == 3 and res.records[2]["source"] == f"{path}:3"
    assert_record(res.records[2], expect)


def test_ultrafeedback_with_messages_column_is_pairs_for_pairs(tmp_path):
    path = write_jsonl(tmp_path / "u.jsonl", [{**ULTRA, "messages": ULTRA["chosen"]}])
    assert load_records(path, kind="pairs").format == "pairs"
    with pytest.raises(ValueError, match=r"u\.jsonl:1: .*ambiguous between chat, pairs: set data\.format"):
        load_records(path)


def test_text_sft_trains_every_token(tmp_path, tok):
    res = load_records(write_jsonl(tmp_path / "t.jsonl", [{"text": "12+39=51"}]), kind="sft")
    ex = encode_records(res.records, tok, DataConfig(), "sft").examples[0]
    body = text_ids(tok, "12+39=51")
    assert ex["input_ids"] == [tok.bos_token_id] + body + [tok.eos_token_id]
    assert ex["loss_mask"] == [0] + [1] * (len(body) + 1)


def test_conversational_prompt_ids_are_the_chat_template(tmp_path, tok):
    prompt = [{"role": "system", "content": "add"}, user("1+2=")]
    for name, row in (("p", {"prompt": prompt}), ("pc", {"prompt": prompt, "completion": [bot("3")]})):
        res = load_records(write_jsonl(tmp_path / f"{name}.jsonl", [row]), kind="prompt")
        ex = encode_records(res.records, tok, DataConfig(), "prompt").examples[0]
        assert ex["prompt_ids"] == chat_ids(tok, prompt, True), name
        assert ex["prompt"] == tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def test_conversational_completion_sft_trains_the_completion_only(tmp_path, tok):
    prompt = [user("1+2="), bot("3"), user("2+2=")]
    res = load_records(write_jsonl(tmp_path / "pc.jsonl", [{"prompt": prompt, "completion": [bot("4")]}]), kind="sft")
    ex = encode_records(res.records, tok, DataConfig(), "sft").examples[0]
    assert ex["input_ids"] == chat_ids(tok, prompt + [bot("4")], False)
    n_prompt = len(chat_ids(tok, prompt, True))
    assert ex["loss_mask"] == [0] * n_prompt + [1] * (len(ex["input_ids"]) - n_prompt)
    trained = [t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m]
    assert tok.decode(trained) == "4<eos>"  # the earlier assistant turn "3" belongs to the prompt


@pytest.mark.parametrize("name", ["pairs_conv", "pairs_ultrafeedback", "pairs_prompt_str_answers_conv", "implicit_conv"])
def test_conversational_pairs_encode(tmp_path, tok, name):
    path = write_jsonl(tmp_path / f"{name}.jsonl", CASES[name][0])
    data = load_data("pairs", DataConfig(train_path=path, eval_fraction=0.0), TaskConfig(), tok, str(tmp_path))
    ex = data.train[0]
    p = chat_ids(tok, [user("1+2=")], True)
    assert ex["prompt_len"] == len(p)
    assert ex["chosen_ids"] == chat_ids(tok, [user("1+2="), bot("3")], False)
    assert ex["rejected_ids"] == chat_ids(tok, [user("1+2="), bot("4")], False)
    assert ex["chosen_ids"][: len(p)] == ex["rejected_ids"][: len(p)] == p
    assert tok.decode(ex["chosen_ids"][len(p) :]) == "3<eos>"
    assert tok.decode(ex["rejected_ids"][len(p) :], skip_special_tokens=True) == "4"


def test_implicit_text_pair_encodes_like_explicit(tmp_path, tok):
    res = load_records(write_jsonl(tmp_path / "i.jsonl", CASES["implicit"][0]), kind="pairs")
    ex = encode_records(res.records, tok, DataConfig(), "pairs").examples[0]
    p = [tok.bos_token_id] + text_ids(tok, "The sky is")
    assert ex["prompt_len"] == len(p) and ex["chosen_ids"][: len(p)] == p
    assert tok.decode(ex["chosen_ids"][len(p) :], skip_special_tokens=True).strip() == "blue."


def test_unpaired_supplies_prompts_only(tmp_path, tok):
    path = write_jsonl(tmp_path / "u.jsonl", CASES["unpaired_conv"][0])
    ex = encode_records(load_records(path, kind="prompt").records, tok, DataConfig(), "prompt").examples[0]
    assert ex["prompt_ids"] == chat_ids(tok, [user("1+2=")], True)
    for kind in ("pairs", "sft"):
        with pytest.raises(ValueError, match=rf"u\.jsonl: format 'unpaired' cannot supply {kind} data: use a file in one of the formats"):
            load_records(path, kind=kind)
    with pytest.raises(ValueError, match=r"t\.jsonl: format 'text' cannot supply prompt data"):
        load_records(write_jsonl(tmp_path / "t.jsonl", [{"text": "x"}]), kind="prompt")


# (format, bad row, words of the error); each bad row is written on line 2 after a good one
BAD = [
    ("prompt_completion", {"prompt": [user("1+2=")], "completion": [user("3")]}, "field 'completion' must start with an assistant turn"),
    ("prompt_completion", {"prompt": [user("1+2="), bot("3")], "completion": [bot("4")]}, "field 'prompt' ends with an assistant turn"),
    ("prompt_completion", {"prompt": [user("1+2=")], "completion": "3"}, "field 'prompt' must be a string like 'completion'"),
    ("prompt_completion", {"prompt": [user("1+2=")]}, "field 'completion' is missing"),
    (
        "pairs",
        {"prompt": [user("1+2=")], "chosen": [bot("3")], "rejected": [{"role": "bot", "content": "4"}]},
        r"'rejected\[0\]\.role' must be one of",
    ),
    ("pairs", {"prompt": [user("1+2=")], "chosen": "3", "rejected": "4"}, "field 'chosen' must be a list of messages like 'prompt'"),
    ("pairs", {**ULTRA, "prompt": "1+5="}, "field 'prompt' is not the last user turn"),
    ("hh", {"chosen": [user("1+2="), bot("3")], "rejected": [user("1+3="), bot("4")]}, "do not start with the same prompt messages"),
    (
        "hh",
        {"chosen": [user("1+2="), bot("3"), user("x")], "rejected": [user("1+2="), bot("3"), user("z")]},
        "share their first 2 messages, which end",
    ),
    ("hh", {"chosen": [user("1+2="), bot("3")], "rejected": [user("1+2="), bot("3")]}, "share their first 2 messages"),  # equal
    ("hh", {"chosen": "Yes", "rejected": "No"}, "shares no leading words with 'rejected'"),
    ("unpaired", {"prompt": "1+2=", "completion": "3", "label": "yes"}, "field 'label' must be true or false, got str"),
    ("unpaired", {"prompt": "1+2=", "completion": "3", "label": 1}, "field 'label' must be true or false, got int"),
    ("text", {"text": ["x"]}, "field 'text' must be a string"),
]


@pytest.mark.parametrize("fmt,bad,msg", BAD)
def test_bad_row_names_file_and_line(tmp_path, fmt, bad, msg):
    good = {
        "prompt_completion": {"prompt": [user("1+2=")], "completion": [bot("3")]},
        "pairs": CASES["pairs_conv"][0][0],
        "hh": CASES["implicit_conv"][0][0],
        "unpaired": CASES["unpaired"][0][0],
        "text": CASES["text"][0][0],
    }[fmt]
    path = write_jsonl(tmp_path / "d.jsonl", [good, bad, good])
    with pytest.raises(ValueError, match=f"{path}:2: .*{msg}"):
        load_records(path, fmt=fmt)
    res = load_records(path, fmt=fmt, skip_invalid=True)
    assert res.num_skipped == 1 and [r["source"] for r in res.records] == [f"{path}:1", f"{path}:3"]


def test_template_that_cannot_split_the_answer(tmp_path, tok_path):
    """A template whose generation prompt is not a prefix of the answered conversation: file:line, or skipped."""
    odd = load_tokenizer(
        tok_path,
        chat_template=(
            "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant says: ' }}{% endif %}"
        ),
    )
    path = write_jsonl(tmp_path / "p.jsonl", [CASES["pairs_conv"][0][0], {"prompt": "1+2=", "chosen": "3", "rejected": "4"}])
    recs = load_records(path, kind="pairs").records
    with pytest.raises(ValueError, match=rf"{path}:1: the chat template does not render the prompt .*tokenizer\.chat_template"):
        encode_records(recs, odd, DataConfig(), "pairs")
    res = encode_records(recs, odd, DataConfig(skip_invalid=True), "pairs")
    assert res.num_invalid == 1 and len(res.examples) == 1 and res.reasons[0].startswith(f"{path}:1: ")
    data = load_data("pairs", DataConfig(train_path=path, eval_fraction=0.0, skip_invalid=True), TaskConfig(), odd, str(tmp_path))
    assert data.stats["skipped_invalid"] == 1 and len(data.train) == 1
