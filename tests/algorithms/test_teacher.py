"""The teacher role of on-policy distillation in the PPO stage: its signal in the advantage estimator's input, and
what is refused before any worker starts (a teacher without a coefficient, a coefficient without a teacher, a
teacher whose vocabulary or tokenizer differs from the student's, both named)."""

from __future__ import annotations

import json

import pytest
import torch

from aligner import algorithms as alg
from aligner.errors import ConfigError


def _batch(teacher: bool):
    from aligner.protocol import RolloutBatch

    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    b = RolloutBatch(
        input_ids=torch.zeros(2, 6, dtype=torch.long),
        attention_mask=torch.ones(2, 6, dtype=torch.long),
        prompt_lens=torch.tensor([2, 2]),
        response_lens=torch.tensor([3, 2]),
        response_mask=mask,
        group_ids=torch.tensor([0, 0]),
    )
    b.kl = torch.rand(2, 4, generator=g) * mask
    b.teacher_log_probs = (-torch.rand(2, 4, generator=g) * 3) * mask if teacher else None
    return b, (-torch.rand(2, 4, generator=g) * 3) * mask


def test_distilled_kl_adds_the_reverse_kl_estimate():
    from aligner.trainers.distill import distilled_kl

    b, lp = _batch(teacher=True)
    metrics: dict = {}
    kl, coef = distilled_kl(b, lp, 0.2, 0.5, metrics)
    assert coef == 1.0
    teacher_kl = (lp - b.teacher_log_probs) * b.response_mask
    torch.testing.assert_close(kl, 0.2 * b.kl + 0.5 * teacher_kl)
    assert metrics["teacher_kl"] == pytest.approx(float(teacher_kl.sum(-1).mean()))
    assert metrics["teacher_kl_token"] == pytest.approx(float(teacher_kl.sum() / b.response_mask.sum()))
    # GRPO's scores: each sequence loses distill_coef * its summed reverse KL (and the reference KL's share)
    scores = torch.tensor([1.0, 0.0])
    shaped = alg.kl_shaped_scores(scores, kl, b.response_mask, coef)
    torch.testing.assert_close(shaped, scores - (0.2 * b.kl + 0.5 * teacher_kl).sum(-1))
    b, lp = _batch(teacher=False)
    kl, coef = distilled_kl(b, lp, 0.2, 0.5, {})
    assert kl is b.kl and coef == 0.2


def _hf_dir(path, vocab_size: int, vocab: dict):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"vocab_size": vocab_size}))
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    return str(path)


@pytest.mark.parametrize(
    "overrides,start,fix",
    [
        (["algorithm.distill_coef=1.0"], "algorithm.distill_coef=1.0 is invalid", "set teacher.init="),
        (["teacher.init=/nonexistent/teacher"], "teacher.init='/nonexistent/teacher' is invalid", "set algorithm.distill_coef > 0"),
        (["algorithm.distill_coef=-1"], "algorithm.distill_coef=-1.0 is invalid", "must be >= 0"),
    ],
)
def test_teacher_settings_are_refused_in_one_line(overrides, start, fix, tmp_path, monkeypatch):
    from aligner.cli import load_config

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_config("ppo", ["conf=tiny", *overrides])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(start) and fix in msg, msg


def test_a_teacher_with_another_vocabulary_is_refused_with_both_named(tmp_path, monkeypatch):
    from aligner.cli import load_config
    from aligner.config.validation import validate_teacher

    monkeypatch.chdir(tmp_path)
    cfg = load_config("ppo", ["conf=tiny"])
    student = _hf_dir(tmp_path / "student", 64, {"a": 0, "b": 1})
    cfg.actor.init, cfg.algorithm.distill_coef = student, 1.0
    cfg.teacher.init = _hf_dir(tmp_path / "teacher_big", 128, {"a": 0, "b": 1})
    with pytest.raises(ConfigError) as e:
        validate_teacher(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "vocab_size=128" in msg and f"({student}: vocab_size=64)" in msg and "teacher.init=" in msg, msg
    cfg.teacher.init = _hf_dir(tmp_path / "teacher_tok", 64, {"a": 1, "b": 0})
    with pytest.raises(ConfigError) as e:
        validate_teacher(cfg)
    assert "tokenizer.json vocabulary differs from the student's" in str(e.value) and student in str(e.value)
    cfg.teacher.init = _hf_dir(tmp_path / "teacher_ok", 64, {"a": 0, "b": 1})
    validate_teacher(cfg)  # the same vocabulary: accepted
    assert "teacher" in cfg.roles_used()
