"""Bad input to GSPO / CISPO, KTO and on-policy distillation, through the entry points: one line on stderr naming the
field or file:line, the bad value and the fix, exit code 2, before any worker starts (the stage's main is never
called, or the trainer never reaches Ray)."""

from __future__ import annotations

import json

import pytest

from tests.toolkit.models import tiny_model_config


def _refused(capsys, stage: str, overrides: list[str]) -> str:
    """Run `stage`'s entry point with a main that must not be reached; returns its one stderr line."""
    from aligner.cli import run

    def main(cfg):
        raise AssertionError("the run must be refused before it starts")

    assert run(stage, main, overrides) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _hf(path, **overrides) -> str:
    from aligner.model.hf import save_hf
    from aligner.model.llama import build_model

    cfg = tiny_model_config(**overrides)
    return str(save_hf(build_model(cfg, "lm", seed=0).state_dict(), cfg, path, max_shard_bytes=2**30))


def test_a_teacher_of_another_vocabulary_is_refused_at_the_entry_point(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    student = _hf(tmp_path / "student")
    teacher = _hf(tmp_path / "teacher", vocab_size=128)
    err = _refused(
        capsys, "ppo", ["conf=tiny", f"actor.init={student}", f"teacher.init={teacher}", "algorithm.distill_coef=1.0", "reward.type=none"]
    )
    assert f"teacher.init={teacher!r} is invalid" in err and "vocab_size=128" in err and f"({student}: vocab_size=64)" in err, err
    assert "give a teacher with the student's tokenizer" in err, err


@pytest.mark.parametrize(
    "overrides,start,fix",
    [
        (["reward.type=none"], "reward.type='none' is invalid", "set algorithm.distill_coef > 0 with teacher.init"),
        (["reward.type=nope"], "reward.type='nope' is invalid", "none"),
    ],
)
def test_no_reward_without_distillation_is_refused(capsys, tmp_path, monkeypatch, overrides, start, fix):
    monkeypatch.chdir(tmp_path)
    err = _refused(capsys, "ppo", ["conf=tiny", *overrides])
    assert start in err and fix in err, err


def test_no_reward_is_refused_where_it_cannot_work(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    teacher = _hf(tmp_path / "teacher", hidden_size=128, intermediate_size=352, num_layers=4, max_seq_len=64)
    base = ["conf=tiny", "actor.init=", "reward.type=none", f"teacher.init={teacher}", "algorithm.distill_coef=1.0"]
    err = _refused(capsys, "ppo", [*base, "algorithm.advantage=grpo", "trainer.n_samples_per_prompt=4", "algorithm.dynamic_sampling=true"])
    assert "algorithm.dynamic_sampling=True is invalid" in err and "set dynamic_sampling=false" in err, err
    err = _refused(capsys, "rs", ["conf=tiny", "reward.type=none"])
    assert "reward.type='none' is invalid" in err and "rejection sampling" in err, err


def test_distillation_alone_is_a_valid_configuration(tmp_path, monkeypatch):
    from aligner.cli import load_config

    monkeypatch.chdir(tmp_path)
    teacher = _hf(tmp_path / "teacher", hidden_size=128, intermediate_size=352, num_layers=4, max_seq_len=64)
    cfg = load_config("ppo", ["conf=tiny", "actor.init=", "reward.type=none", f"teacher.init={teacher}", "algorithm.distill_coef=1.0"])
    assert "reward" not in cfg.roles_used() and "teacher" in cfg.roles_used()


def test_gspo_with_a_token_level_aggregation_is_refused_at_the_entry_point(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = _refused(capsys, "ppo", ["conf=tiny", "algorithm.policy_loss=gspo", "algorithm.loss_agg=token-mean"])
    assert "algorithm.loss_agg='token-mean' is invalid" in err and "set algorithm.loss_agg=seq-mean-token-mean" in err, err


@pytest.mark.parametrize(
    "rows,fmt,want",
    [
        (
            [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": "4"}],
            "auto",
            "has format 'prompt_completion', which has no labels",
        ),
        ([{"prompt": "1+1=", "completion": "2", "label": True}, {"prompt": "2+2=", "completion": "5"}], "unpaired", ":2: "),
    ],
)
def test_kto_data_without_labels_exits_2_before_ray(capsys, tmp_path, monkeypatch, rows, fmt, want):
    """The trainer's load_inputs refuses the data before init_ray: the KTO entry point returns 2 with one line."""
    from aligner.kto import main
    from aligner.trainers.kto import KTOTrainer

    monkeypatch.chdir(tmp_path)

    def no_ray(self):
        raise AssertionError("Ray must not start for data that is refused")

    monkeypatch.setattr(KTOTrainer, "init_ray", no_ray)
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert (
        main(["conf=tiny", f"data.train_path={path}", f"data.format={fmt}", "data.eval_fraction=0", f"output_dir={tmp_path / 'out'}"]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "label" in err[-1] and want in err[-1], err
    if fmt == "unpaired":
        assert f"{path}:2" in err[-1], err
    else:
        assert f"data.train_path={str(path)!r}" in err[-1] and "data.format=unpaired" in err[-1], err
