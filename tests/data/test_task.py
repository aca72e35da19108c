"""The built-in addition task: determinism, checker, carry-error rate, pairs, held-out split, tokenizer, rule rewards."""

from __future__ import annotations

import json

import pytest
import torch

from aligner.config import ConfigError, TaskConfig
from aligner.data.task import (
    build_task_tokenizer,
    check_answer,
    eval_problems,
    forget_carry,
    has_carry,
    mistake_breakdown,
    pair_records,
    parse_prompt,
    rl_records,
    sft_records,
    write_task_files,
)
from aligner.data.tokenizer import load_tokenizer
from aligner.reward.rules import extract_final_number, gsm8k_formatted, score


def small(**kw) -> TaskConfig:
    base = dict(num_sft=2000, num_pairs=500, num_rl=300, num_eval=100, tokenizer_vocab_size=64)
    base.update(kw)
    return TaskConfig(**base)


def test_carry_helpers():
    assert has_carry(15, 27) and has_carry(95, 5) and has_carry(9, 1)
    assert not has_carry(12, 34) and not has_carry(0, 0) and not has_carry(40, 9)
    assert forget_carry(15, 27) == "32"
    assert forget_carry(95, 17) == "2"  # (5+7)%10=2, (9+1)%10=0 -> "02" -> 2
    assert forget_carry(12, 34) == "46"  # no carry: forgetting it changes nothing


def test_checker():
    assert check_answer("12+39=", "51")
    assert check_answer("12+39=", " 51\n")
    assert not check_answer("12+39=", "41")
    assert not check_answer("12+39=", "51x")
    assert not check_answer("12+39=", "")
    assert parse_prompt("7+0=") == (7, 0)
    with pytest.raises(ValueError, match="not an addition-task prompt"):
        check_answer("12*39=", "468")


def test_deterministic_from_seed(tmp_path):
    a, b, c = small(seed=1), small(seed=1), small(seed=2)
    assert sft_records(a) == sft_records(b)
    assert pair_records(a) == pair_records(b)
    assert rl_records(a) == rl_records(b)
    assert sft_records(a) != sft_records(c)
    pa = write_task_files(a, str(tmp_path / "a"))
    pb = write_task_files(b, str(tmp_path / "b"))
    assert set(pa) == {"sft_train", "sft_eval", "pairs_train", "pairs_eval", "rl_train", "rl_eval"}
    for k in pa:
        assert open(pa[k]).read() == open(pb[k]).read()


@pytest.mark.parametrize("rate", [0.0, 0.6, 1.0])
def test_sft_carry_error_rate(rate):
    rows = sft_records(small(carry_error_rate=rate, num_sft=3000))
    carry = [r for r in rows if has_carry(*parse_prompt(r["prompt"]))]
    plain = [r for r in rows if not has_carry(*parse_prompt(r["prompt"]))]
    assert len(carry) > 500 and len(plain) > 500
    for r in rows:  # the "correct" flag agrees with the checker; wrong answers are the dropped carry
        assert r["correct"] == check_answer(r["prompt"], r["response"])
        if not r["correct"]:
            assert r["response"] == forget_carry(*parse_prompt(r["prompt"]))
    assert all(r["correct"] for r in plain)
    err = sum(not r["correct"] for r in carry) / len(carry)
    assert abs(err - rate) < 0.04, err
    if 0 < rate < 1:  # the correct answer still appears in the data for carry problems
        assert any(r["correct"] for r in carry)


def test_greedy_accuracy_target_band():
    # A model that learns the majority demonstration answers carry problems wrong when
    # carry_error_rate > 0.5: held-out greedy accuracy ~ fraction of carry-free problems.
    ev = eval_problems(TaskConfig())
    frac = sum(not has_carry(a, b) for a, b in ev) / len(ev)
    assert 0.40 <= frac <= 0.60, frac


def test_pairs_chosen_correct_rejected_wrong():
    rows = pair_records(small())
    kinds: dict[str, int] = {}
    for r in rows:
        assert check_answer(r["prompt"], r["chosen"])
        assert not check_answer(r["prompt"], r["rejected"])
        assert r["rejected"].isdigit()
        a, b = parse_prompt(r["prompt"])
        kind, wrong = r["rejected_kind"], int(r["rejected"])
        kinds[kind] = kinds.get(kind, 0) + 1
        # the carry mistake of the problem: dropped (or one carry too many) where due, phantom where not
        if not has_carry(a, b):
            assert kind == "phantom_carry" and (wrong - (a + b)) in (10, 100)
        elif kind == "over_carry":
            assert (wrong - (a + b)) in (10, 100)
        else:
            assert kind == "dropped_carry" and wrong < a + b and r["rejected"] == forget_carry(a, b)
    assert set(kinds) == {"dropped_carry", "over_carry", "phantom_carry"}
    carry = kinds["dropped_carry"] + kinds["over_carry"]
    assert 0.15 < kinds["over_carry"] / carry < 0.35  # OVER_CARRY_FRACTION = 0.25


def test_eval_held_out_from_train():
    cfg = small()
    held = {r["prompt"] for r in rl_records(cfg, "eval")}
    assert len(held) == cfg.num_eval
    for rows in (sft_records(cfg), pair_records(cfg), rl_records(cfg)):
        assert not held & {r["prompt"] for r in rows}
    assert all(r["correct"] for r in sft_records(cfg, "eval"))
    assert all(check_answer(r["prompt"], r["answer"]) for r in rl_records(cfg, "eval"))


def test_task_files_are_standard_formats(tmp_path):
    paths = write_task_files(small(), str(tmp_path))
    first = {k: json.loads(open(p).readline()) for k, p in paths.items()}
    assert {"prompt", "response"} <= set(first["sft_train"])
    assert {"prompt", "chosen", "rejected"} <= set(first["pairs_eval"])
    assert set(first["rl_train"]) == {"prompt", "answer"}


def test_task_tokenizer(tmp_path):
    cfg = small(tokenizer_vocab_size=64)
    path = build_task_tokenizer(cfg, str(tmp_path))
    tok = load_tokenizer(path)
    assert len(tok) <= 64
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    for d in "0123456789":
        assert tok.convert_ids_to_tokens(tok.encode(d, add_special_tokens=False)) == [d]
    ids = tok.encode("907+95=1002", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == list("907+95=1002")
    assert tok.decode(ids) == "907+95=1002"
    assert tok.unk_token_id not in tok.encode("ab cd 12", add_special_tokens=False)
    assert tok.decode(tok.encode("ab cd 12", add_special_tokens=False)) == "ab cd 12"
    with pytest.raises(ConfigError, match="tokenizer_vocab_size"):
        TaskConfig(tokenizer_vocab_size=10).validate()


def test_rule_rewards():
    s = score("task_accuracy", ["12+39=", "12+39=", "1+1="], ["51", "41", "2"], [{}, {}, {}])
    assert s.dtype == torch.float32 and s.tolist() == [1.0, 0.0, 1.0]
    g = score(
        "gsm8k",
        ["q"] * 4,
        ["so 3+4=7\n#### 7", "the total is 1,200 dollars", "#### 8", "no number"],
        [{"answer": "7"}, {"answer": "1200"}, {"answer": "7"}, {"answer": "7"}],
    )
    assert g.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert extract_final_number("a 3 then 4.5.") == "4.5"
    with pytest.raises(ValueError, match="valid rules are task_accuracy, gsm8k"):
        score("nope", ["a"], ["b"], [{}])
    with pytest.raises(ValueError, match="metadata"):
        score("gsm8k", ["a"], ["1"], [{}])
    f = score(
        "gsm8k_format",
        ["q"] * 6,
        ["so 3+4=7\n#### 7", "#### 1,200.\n", "3+4=7\n#### 8", "the answer is 7", "#### 7\nthen more text", "####7"],
        [{"answer": "7"}, {"answer": "1200"}, {"answer": "7"}, {"answer": "7"}, {"answer": "7"}, {"answer": "7"}],
    )
    assert f.tolist() == [1.0, 1.0, 0.5, 0.0, 0.0, 1.0]  # format 0.5 + right number 0.5; unformatted right answers get 0
    assert gsm8k_formatted("work\n#### -3\n\n") == "-3" and gsm8k_formatted("#### x") is None
    with pytest.raises(ValueError, match="gsm8k_format needs metadata"):
        score("gsm8k_format", ["a"], ["#### 1"], [{}])


def test_mistake_breakdown_counts_dropped_carries_per_group():
    prompts = ["15+27=", "15+27=", "95+17=", "12+31=", "12+31="]
    responses = ["42", "32", "2", "43", "143"]  # right, dropped, dropped, right, phantom carry
    res = mistake_breakdown(prompts, responses)
    assert res == {"accuracy_carry": 1 / 3, "accuracy_no_carry": 0.5, "dropped_carry": 2 / 3}
    assert mistake_breakdown(["12+31="], ["43"]) == {"accuracy_no_carry": 1.0}
    with pytest.raises(ValueError):
        mistake_breakdown(["hello"], ["1"])
