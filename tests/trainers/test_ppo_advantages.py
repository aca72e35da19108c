"""PPOTrainer.compute_advantages applies what the config asks, for every estimator.

No Ray: the trainer is built without starting its groups and fed a RolloutBatch whose
log-probs, values and scores are given.
"""

from __future__ import annotations

import pytest
import torch

from aligner import algorithms as alg
from aligner.cli import load_config
from aligner.protocol import RolloutBatch
from aligner.trainers.ppo import PPOTrainer

RULE = [
    "reward.type=rule",
    "reward.rule=digit_fraction",
    "actor.init=",
    "critic.init=",
    "reward.init=",
    "ref.init=",
    "trainer.n_samples_per_prompt=4",
    "trainer.rollout_batch_size=2",
    "trainer.mini_batch_size=8",
]
PROMPTS = [{"prompt_ids": [1, 2], "prompt": "p", "metadata": {}}]


def _batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    B, R = 8, 5
    lens = torch.tensor([5, 3, 4, 1, 5, 2, 5, 4])
    mask = (torch.arange(R)[None] < lens[:, None]).float()
    old = -torch.rand(B, R, generator=g) * mask
    return RolloutBatch(
        input_ids=torch.zeros(B, 7, dtype=torch.long),
        attention_mask=torch.ones(B, 7, dtype=torch.long),
        prompt_lens=torch.full((B,), 2),
        response_lens=lens,
        response_mask=mask,
        group_ids=torch.arange(2).repeat_interleave(4),
        old_log_probs=old,
        ref_log_probs=(old - torch.rand(B, R, generator=g)) * mask,
        values=torch.randn(B, R, generator=g) * mask,
        scores=torch.randn(B, generator=g),
    )


def _advantages(*overrides: str) -> torch.Tensor:
    trainer = PPOTrainer(load_config("ppo", RULE + list(overrides)), None, PROMPTS, PROMPTS)
    batch = _batch()
    trainer.compute_advantages(batch)
    return batch.advantages


@pytest.mark.parametrize("advantage", sorted(alg.ADVANTAGE_ESTIMATORS))
def test_the_reward_kl_coefficient_changes_the_advantages_of_every_estimator(advantage):
    on = ["algorithm.kl_in_reward=true"]
    without = _advantages(f"algorithm.advantage={advantage}", "algorithm.kl_coef=0", *on)
    with_kl = _advantages(f"algorithm.advantage={advantage}", "algorithm.kl_coef=0.5", *on)
    assert (with_kl - without).abs().max() > 1e-3


def test_grpo_keeps_the_kl_out_of_the_reward_by_default():
    plain = _advantages("algorithm.advantage=grpo", "algorithm.kl_coef=0")
    with_loss_kl = _advantages("algorithm.advantage=grpo", "algorithm.kl_coef=0", "algorithm.kl_loss_coef=0.5")
    torch.testing.assert_close(plain, with_loss_kl)  # the loss term acts in ppo_update, not here


def test_norm_by_std_reaches_the_grpo_estimator():
    normed = _advantages("algorithm.advantage=grpo", "algorithm.kl_coef=0")
    dr_grpo = _advantages("algorithm.advantage=grpo", "algorithm.kl_coef=0", "algorithm.norm_by_std=false")
    batch = _batch()
    want = alg.compute_grpo_advantages(batch.scores, batch.response_mask, group_size=4, norm_by_std=False)
    torch.testing.assert_close(dr_grpo, want)
    assert (normed - dr_grpo).abs().max() > 1e-3


@pytest.mark.parametrize("pack_len,whole", [(4096, True), (0, False)])
def test_minibatches_keep_a_prompts_samples_together_when_packing(pack_len, whole):
    """With shared-prompt packing on, the update's mini-batches are whole groups of
    n_samples_per_prompt consecutive rows (so the actor runs each prompt once); with it off, samples
    are shuffled one by one. Either way every row appears once per epoch."""
    n, size = 4, 32
    trainer = PPOTrainer(load_config("ppo", RULE + [f"trainer.shared_prompt_pack_len={pack_len}"]), None, PROMPTS, PROMPTS)
    order = trainer._minibatch_order(size, torch.Generator().manual_seed(3))
    assert sorted(order.tolist()) == list(range(size))
    groups = order.view(-1, n)
    kept = bool((groups // n == groups[:, :1] // n).all() and (groups % n == torch.arange(n)).all())
    assert kept == whole
    assert order[:n].tolist() != list(range(n)) or order[n : 2 * n].tolist() != list(range(n, 2 * n))  # shuffled


def test_the_overlong_penalty_reaches_the_rewards():
    """algorithm.overlong_buffer adds DAPO's length term to each sample's score before the estimator
    (tiny's budget is 8 new tokens: with a buffer of 4, responses of 5 tokens lose 1/4)."""
    trainer = PPOTrainer(
        load_config("ppo", RULE + ["algorithm.advantage=grpo", "algorithm.overlong_buffer=4", "algorithm.overlong_penalty=2.0"]),
        None,
        PROMPTS,
        PROMPTS,
    )
    batch = _batch()
    metrics = trainer.compute_advantages(batch)
    lens = batch.response_mask.sum(-1)
    want = batch.scores + alg.overlong_penalty(lens, 8, 4, 2.0)
    torch.testing.assert_close(batch.rewards, want)
    assert (batch.rewards < batch.scores).sum() == int((lens > 4).sum()) > 0
    assert metrics["overlong_penalty_mean"] == pytest.approx(float(alg.overlong_penalty(lens, 8, 4, 2.0).mean()))
    want_adv = alg.compute_grpo_advantages(want, batch.response_mask, group_size=4)
    torch.testing.assert_close(batch.advantages, want_adv * batch.response_mask)


def test_the_non_stop_score_replaces_the_score_of_responses_that_did_not_end():
    """algorithm.non_stop_score (Tülu 3's non-stop penalty): a response cut at the budget scores the
    value instead of its score, the others keep theirs, and GRPO's group baseline sees the replaced scores."""
    trainer = PPOTrainer(load_config("ppo", RULE + ["algorithm.advantage=grpo", "algorithm.non_stop_score=-10"]), None, PROMPTS, PROMPTS)
    batch = _batch()
    reasons = ["stop", "length", "stop", "stop", "length", "stop", "length", "stop"]
    batch.meta = [{"finish_reason": r} for r in reasons]
    metrics = trainer.compute_advantages(batch)
    ended = torch.tensor([r == "stop" for r in reasons])
    want = torch.where(ended, batch.scores, torch.tensor(-10.0))
    torch.testing.assert_close(batch.rewards, want)
    assert metrics["non_stop_frac"] == pytest.approx(3 / 8)
    want_adv = alg.compute_grpo_advantages(want, batch.response_mask, group_size=4)
    torch.testing.assert_close(batch.advantages, want_adv * batch.response_mask)
