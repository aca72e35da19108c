"""benchmarks/ifeval_diagnose.py: the de-looping cut and the ended/cut split, on rows worked out by hand."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.toolkit.paths import REPO

spec = importlib.util.spec_from_file_location("ifeval_diagnose", REPO / "benchmarks" / "ifeval_diagnose.py")
diag = importlib.util.module_from_spec(spec)
spec.loader.exec_module(diag)


def test_deloop_by_hand():
    assert diag.deloop("a\nb\na\nb\na") == "a\nb"  # the first repeated line
    assert diag.deloop("Title\n\nOne. Two.\n\nOne. Two.") == "Title\n\nOne. Two."  # blank lines are not repeats
    assert diag.deloop("I like it. I like it. I like it.") == "I like it."  # one line: the first repeated sentence
    assert diag.deloop("No repeat here. Really.") == "No repeat here. Really."


def test_diagnose_split(tmp_path):
    pytest.importorskip("if_verifiable", reason="IFEval's checkers (pip install 'aligner[ifeval]') are not installed")
    data = [
        {"key": 1, "prompt": "Say hi without commas.", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]},
        {"key": 2, "prompt": "Say hi in lowercase.", "instruction_id_list": ["change_case:english_lowercase"], "kwargs": [{}]},
        {"key": 3, "prompt": "Say hi without commas.", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]},
    ]
    responses = [
        {"key": 1, "prompt": data[0]["prompt"], "response": "hi there", "finish_reason": "stop", "response_tokens": 3, "strict": [True]},
        # cut, fails (capitals); de-looped at the first repeated line it still has capitals: fails
        {
            "key": 2,
            "prompt": data[1]["prompt"],
            "response": "Hi\nHi\nHi",
            "finish_reason": "length",
            "response_tokens": 512,
            "strict": [False],
        },
        # cut, fails (a comma in the repeats); de-looped to "hi" before its first repeat: passes
        {
            "key": 3,
            "prompt": data[2]["prompt"],
            "response": "hi\nhi\nhi, hi",
            "finish_reason": "length",
            "response_tokens": 512,
            "strict": [False],
        },
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in responses))
    res = diag.diagnose(diag.load(tmp_path / "r.jsonl", tmp_path / "d.jsonl"))
    assert (res["ended"]["n"], res["cut"]["n"]) == (1, 2)
    assert res["ended"]["prompt_strict"] == 1.0 and res["cut"]["prompt_strict"] == 0.0
    assert res["all"]["prompt_strict"] == pytest.approx(1 / 3)
    assert res["per_family"]["punctuation"] == {"ended": {"n": 1, "strict": 1.0}, "cut": {"n": 1, "strict": 0.0}}
    assert res["delooped"] == {"prompt_strict": pytest.approx(2 / 3), "cut_rows_shortened": 2}
    assert "| cut | 2 | 0.0% |" in diag.table(res)
