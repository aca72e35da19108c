"""DAPO's dynamic sampling in PPOTrainer (``algorithm.dynamic_sampling``): which groups are kept.

No Ray: the trainer is built without its groups; its generate() is replaced by a scripted one whose
responses the rule reward ``digit_fraction`` scores: the groups the test names by their place in the
order they are drawn get equal scores (every response "11"), the others varied ones ("1a", "11", ...).
"""

from __future__ import annotations

import pytest
import torch

from aligner.cli import load_config
from aligner.errors import ConfigError
from aligner.rollout.base import Generation
from aligner.trainers.ppo import PPOTrainer

N, TARGET = 4, 3
RULE = [
    "algorithm.advantage=grpo",
    "algorithm.dynamic_sampling=true",
    "reward.type=rule",
    "reward.rule=digit_fraction",
    "actor.init=",
    "critic.init=",
    "reward.init=",
    "ref.init=",
    f"trainer.n_samples_per_prompt={N}",
    f"trainer.rollout_batch_size={TARGET}",
    f"trainer.mini_batch_size={N * TARGET}",
]
PROMPTS = [{"prompt_ids": [1, 2], "prompt": f"p{k}", "metadata": {}} for k in range(30)]
TEXT = {1: "1", 2: "a"}


class Tok:
    """Decodes token 1 as "1" and 2 as "a"."""

    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(TEXT[i] for i in ids)


def trainer_with(equal, *overrides: str):
    """A trainer whose generate() answers the i-th prompt drawn in the step with an all-equal group when
    equal(i), else a varied one; ``calls`` records each call's (draw indices, first_index), ``drawn``
    the prompts' numbers in drawing order."""
    t = PPOTrainer(load_config("ppo", RULE + list(overrides)), Tok(), PROMPTS, PROMPTS)
    t.calls, t.drawn = [], []

    def generate(prompts, sampling, step, n, first_index=0):
        first = len(t.drawn)
        t.drawn += [int(p["prompt"][1:]) for p in prompts]
        t.calls.append((list(range(first, len(t.drawn))), first_index))
        rows, gens = [], []
        for k, p in enumerate(prompts, start=first):
            for j in range(n):
                ids = [1, 1] if equal(k) else [1, 1 if j % 2 else 2]
                rows.append(p)
                gens.append(Generation(ids, [-0.5] * len(ids), "length", 0))
        return rows, gens

    t.generate = generate
    return t


def test_all_equal_groups_are_dropped_and_more_rounds_fill_the_batch():
    t = trainer_with(lambda i: i % 3 == 0)  # draws 0 and 3 are all-equal: round 1 keeps 1, 2; round 2 keeps 4, then 5 is cut
    batch, m = t.dynamic_rollout()
    assert [fi for _, fi in t.calls] == [0, TARGET * N]  # two rounds, the second seeded after the first
    kept = [t.drawn[i] for i in (1, 2, 4)]
    assert [int(x["prompt"][1:]) for x in batch.meta[::N]] == kept  # in drawing order, cut at TARGET
    assert len(batch) == TARGET * N and batch.group_ids.tolist() == [g for g in range(TARGET) for _ in range(N)]
    groups = batch.scores.view(-1, N)
    assert (groups != groups[:, :1]).any(dim=1).all()  # never an all-equal group
    torch.testing.assert_close(batch.scores, t.rule_scores(batch).float())  # the kept scores are the samples' own
    assert m == {
        "dynamic_sampling/rounds": 2.0,
        "dynamic_sampling/dropped_groups": 2.0,
        "dynamic_sampling/kept_groups": float(TARGET),
    }
    # the advantages of the kept batch: no group is all zeros
    batch.ref_log_probs = batch.rollout_log_probs.clone()
    t.compute_advantages(batch)
    assert (batch.advantages.abs().sum(-1).view(-1, N).sum(-1) > 0).all()


def test_rounds_stop_at_the_limit_and_a_step_with_no_varied_group_trains_nothing():
    t = trainer_with(lambda i: True, "algorithm.dynamic_sampling_max_rounds=2")
    batch, m = t.dynamic_rollout()
    assert batch is None and len(t.calls) == 2
    assert m == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/dropped_groups": 2.0 * TARGET, "dynamic_sampling/kept_groups": 0.0}
    # fewer varied groups than the batch asks for when the rounds run out: trained on what was kept
    t = trainer_with(lambda i: i != 1, "algorithm.dynamic_sampling_max_rounds=1")
    batch, m = t.dynamic_rollout()
    assert m["dynamic_sampling/kept_groups"] == 1.0 and len(batch) == N and batch.meta[0]["prompt"] == f"p{t.drawn[1]}"


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["algorithm.advantage=gae", "algorithm.kl_loss_coef=0"], "algorithm.dynamic_sampling"),
        (["algorithm.dynamic_sampling_max_rounds=0"], "algorithm.dynamic_sampling_max_rounds"),
    ],
)
def test_bad_dynamic_sampling_settings_are_refused(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config("ppo", RULE + overrides)


def test_a_first_round_generated_ahead_is_round_one():
    """The split placement at trainer.max_staleness=1 hands the queued batch in as the first round (issue
    37 part 4): it is judged like a generated round, and the refills are drawn and seeded after it."""
    t = trainer_with(lambda i: i % 3 == 0)
    first_rows, first_gens = t.generate(PROMPTS[:TARGET], None, 0, N)  # draws 0-2 (0 all-equal), as if queued
    t.calls.clear()
    batch, m = t.dynamic_rollout(first=(first_rows, first_gens))
    assert [fi for _, fi in t.calls] == [TARGET * N]  # one refill round, seeded after the first
    assert m["dynamic_sampling/rounds"] == 2.0 and m["dynamic_sampling/dropped_groups"] == 2.0  # draws 0 and 3
    assert [int(x["prompt"][1:]) for x in batch.meta[::N]] == [t.drawn[i] for i in (1, 2, 4)]
    assert batch.token_versions is None  # no producer: a single version


def test_dynamic_sampling_runs_one_batch_ahead_at_most():
    load_config("ppo", RULE + ["rollout.placement=split", "trainer.max_staleness=1"])
    with pytest.raises(ConfigError, match=r"trainer\.max_staleness=2 is invalid: dynamic sampling refills"):
        load_config("ppo", RULE + ["rollout.placement=split", "trainer.max_staleness=2"])
