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


def test_the_distillation_advantage_is_the_per_token_reverse_kl_estimate_centered():
    from aligner.algorithms import distillation_advantages
    from aligner.trainers.distill import teacher_kl_estimate

    b, lp = _batch(teacher=True)
    metrics: dict = {}
    d = teacher_kl_estimate(b, lp, metrics)
    want = (lp - b.teacher_log_probs) * b.response_mask
    torch.testing.assert_close(d, want)
    assert metrics["teacher_kl"] == pytest.approx(float(want.sum(-1).mean()))
    assert metrics["teacher_kl_token"] == pytest.approx(float(want.sum() / b.response_mask.sum()))
    adv = distillation_advantages(d, b.response_mask, 0.5)
    mean = float(want.sum() / b.response_mask.sum())
    torch.testing.assert_close(adv, 0.5 * (mean - want) * b.response_mask)  # per token, not a sequence sum
    assert float(adv.sum()) == pytest.approx(0.0, abs=1e-6)  # centered over the batch's response tokens
    assert teacher_kl_estimate(_batch(teacher=False)[0], lp, {}) is None
    with pytest.raises(ValueError, match="distill_coef=-1 is invalid"):
        distillation_advantages(d, b.response_mask, -1)


def test_the_per_token_advantage_gives_the_reverse_kl_gradient_in_expectation():
    """Enumerating y_t over a small vocabulary: the policy gradient sum_v pi(v) * grad log pi(v) * A(v) with the
    distillation advantage A(v) = -(d(v) - b), d(v) = log pi(v) - log pi_teacher(v), any constant b, equals
    -grad KL(pi || pi_teacher) (:func:`aligner.algorithms.reverse_kl_per_token`) in float64."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(7, generator=g, dtype=torch.float64) * 3
    exact = alg.reverse_kl_per_token(logits[None, None], teacher[None, None])[0, 0]
    (want,) = torch.autograd.grad(-exact, logits)
    d = (torch.log_softmax(logits, -1) - torch.log_softmax(teacher, -1)).detach()
    for b in (0.0, 2.5):
        logp = torch.log_softmax(logits, -1)
        surrogate = (logp.exp().detach() * logp * -(d - b)).sum()  # E_{v ~ pi}[log pi(v) * A(v)], pi held fixed
        (got,) = torch.autograd.grad(surrogate, logits)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


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
