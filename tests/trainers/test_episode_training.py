"""Training on multi-turn trajectories: the model's own tokens are trained, the
environment's observation tokens are not, and an episode's reward is its environment's.

- the trainer's batch: observation tokens are out of the response mask, the scores are the
  episodes' total rewards, a failed episode scores 0 and is counted;
- autograd: the PPO loss over engine-generated trajectories has exactly zero gradient at every
  logit that predicts an observation token, and a non-zero one at the model's own tokens;
- GAE over a trajectory carries the recursion over the observations: it equals GAE over the model's
  tokens alone;
- end to end (Ray, the built-in task, ``env.name=retry``): episodes of several turns are played by
  the engine and trained on, colocated and on the split placement.
"""

from __future__ import annotations

import pytest
import torch

import aligner.algorithms as alg
from aligner.cli import load_config
from aligner.config import SamplingConfig
from aligner.envs import Episode, Turn
from aligner.nn.vocab import vocab_parallel_log_probs
from aligner.ppo import main as ppo_main
from aligner.protocol import build_sequences, to_response
from aligner.rollout.base import Generation, own_tokens_mask
from aligner.rollout.torch_engine.engine import TorchEngine
from aligner.tracking import read_metrics
from aligner.trainers.ppo import PPOTrainer
from tests.toolkit.engine import engine_model
from tests.toolkit.overrides import PPO_RULE

EPISODES = ["env.name=retry", "env.max_turns=3", "reward.type=rule", "reward.rule=task_accuracy"]
RULE = ["actor.init=", "critic.init=", "reward.init=", "ref.init=", "algorithm.advantage=grpo", "trainer.n_samples_per_prompt=2", *EPISODES]


PROMPTS = [{"prompt_ids": [1, 2], "prompt": "1+1=", "metadata": {}}] * 4


class Tok:
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def episode(reward: float, *, failed: bool = False, turn_rewards=(0.0,)) -> Episode:
    turns = [Turn("user", "1+1=", own=False)] + [Turn("assistant", "2", own=True, reward=r) for r in turn_rewards]
    return Episode("1+1=", {}, turns, final_reward=reward, done=not failed, failed=failed, failure="x: step 1 timed out" if failed else "")


def test_the_batch_masks_observations_and_scores_the_episodes():
    t = PPOTrainer(load_config("ppo", RULE), Tok(), PROMPTS, PROMPTS)
    rows = [{"prompt_ids": [1, 2], "prompt": "1+1=", "metadata": {}}] * 2
    gens = [
        Generation([5, 2, 7, 8, 6, 2], [-1.0, -0.5, 0.0, 0.0, -0.2, -0.1], "stop", 0, own_mask=[True, True, False, False, True, True]),
        Generation([5, 2], [-1.0, -0.5], "stop", 0, own_mask=[True, True]),
    ]
    gens[0].extra["episode"] = episode(1.0, turn_rewards=(0.0, 0.25))
    gens[1].extra["episode"] = episode(0.0, failed=True)
    batch = t.assemble(rows, gens, 2)
    assert batch.response_mask.tolist() == [[1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0]]
    assert batch.input_ids[0].tolist() == [1, 2, 5, 2, 7, 8, 6, 2]  # the observation stays in the context
    assert t.rule_scores(batch).tolist() == [1.25, 0.0]  # per-turn plus final reward; a failed episode 0
    assert own_tokens_mask(gens, 7)[0].tolist() == [1, 1, 0, 0, 1, 1, 1]


@pytest.fixture(scope="module")
def trajectories():
    """Engine-generated episodes on the engine tests' model: every token is a stop token, so each model
    turn is one token, answered by 2 observation tokens while the budget has room."""
    model = engine_model()
    s = SamplingConfig(temperature=1.0, max_new_tokens=16, stop_token_ids=list(range(96)))
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]

    def turn_end(request, turn, room):
        return [10 + request, 20] if room > 3 else None

    gens = TorchEngine(model).generate(prompts, s, seeds=[1, 2, 3], turn_end=turn_end)
    assert all(not all(g.own_mask) for g in gens)  # the premise: every episode has observations
    return model, prompts, gens


def test_no_gradient_reaches_an_observation_token(trajectories):
    model, prompts, gens = trajectories
    seq = build_sequences(prompts, [g.token_ids for g in gens], 0)
    mask = seq["response_mask"] * own_tokens_mask(gens, seq["response_mask"].shape[1])
    logits = model(seq["input_ids"]).float()
    logits.retain_grad()
    lp = to_response(vocab_parallel_log_probs(logits[:, :-1], seq["input_ids"][:, 1:]), seq["prompt_lens"], mask)
    adv = alg.compute_grpo_advantages(torch.tensor([1.0, 0.0, 0.2]), mask, group_ids=torch.tensor([0, 0, 0]))
    loss, _ = alg.policy_loss(lp * mask, lp.detach(), adv, mask, 0.2)
    loss.backward()
    for i, (p, g) in enumerate(zip(prompts, gens)):
        for j, own in enumerate(g.own_mask):
            grad = logits.grad[i, len(p) - 1 + j]  # the logits that predict response token j
            if own:
                assert grad.abs().sum() > 0, (i, j)
            else:
                assert (grad == 0).all(), (i, j)


def test_gae_over_a_trajectory_equals_gae_over_the_model_tokens_alone(trajectories):
    _, _, gens = trajectories
    g = torch.Generator().manual_seed(0)
    for gen in gens:
        own = torch.tensor(gen.own_mask, dtype=torch.float32)[None]
        r = own.shape[1]
        rewards, values = torch.randn(1, r, generator=g), torch.randn(1, r, generator=g)
        adv, ret = alg.compute_gae(rewards, values, own, gamma=0.9, gae_lambda=0.8)
        keep = own[0].bool()
        adv_own, ret_own = alg.compute_gae(rewards[:, keep], values[:, keep], torch.ones(1, int(keep.sum())), gamma=0.9, gae_lambda=0.8)
        torch.testing.assert_close(adv[:, keep], adv_own)
        torch.testing.assert_close(ret[:, keep], ret_own)
        assert (adv[:, ~keep] == 0).all()


E2E = (
    PPO_RULE
    + [  # digit_fraction: a random policy's scores vary (task_accuracy would be all 0: no gradient)
        "env.name=retry",
        "env.max_turns=3",
        "algorithm.advantage=grpo",
        "trainer.n_samples_per_prompt=2",
        "trainer.rollout_batch_size=8",
        "trainer.mini_batch_size=16",
        "trainer.micro_batch_size=8",
        "trainer.eval_every=0",
        "trainer.progress=false",
        "trainer.max_steps=2",
        "rollout.sampling.max_new_tokens=100",
        "model.max_seq_len=128",
        "rollout.sampling.stop_token_ids=[21,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39,40]",  # letters: a random policy's turns end in a few tokens
        "task.num_eval=8",
        "task.num_rl=64",
    ]
)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_ppo_plays_and_trains_on_retry_episodes(tmp_path, placement):
    """A random policy on the built-in task is almost always wrong, so the retry environment answers
    with feedback and the engine plays further turns (20 of the 64 token ids, letters, end a turn, so its turns
    are short): every step's episodes average more than one
    model turn, the observations are counted (and outnumber the model's own tokens, which are what
    response_len counts), nothing failed, and the update ran on a finite loss with a gradient."""
    out = tmp_path / placement
    assert ppo_main([*E2E, f"output_dir={out}", f"rollout.placement={placement}"]) == 0
    steps = [m for m in read_metrics(out / "metrics.jsonl") if m["step"] > 0 and "env/turns" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["env/turns"] > 1.0 and m["env/retries"] > 0 and m["env/failed"] == 0.0
        assert m["env/observation_tokens"] > 0 and m["response_len"] < m["env/observation_tokens"]
        assert 0 < m["response_len"] <= m["response_len_max"]  # the mean and the step's longest (the planner's tail)
        assert m["actor/grad_norm"] > 0 and torch.isfinite(torch.tensor(m["policy_loss"]))
