"""Token-budget micro-batches (``trainer.micro_batch_tokens``) against row-count micro-batches.

A ragged batch run as budget micro-batches (sorted first-fit, each cut to its longest row) must
give the same PPO loss, every parameter's gradient (fp32, within 1e-6) and the same per-token
log-probs as fixed micro-batches of one row; on dp=2 over gloo, where the two ranks' shards need
different micro-batch counts, the step must not hang (filler micro-batches) and equal dp=1. The
padded-token metric is counted on a hand-made batch, and a budget below the longest row is
refused, naming the field, the value and the fix.
"""

from __future__ import annotations

import pytest
import torch

from aligner import algorithms as alg
from aligner.actor.policy import Policy
from aligner.config import AlgorithmConfig, ConfigError, OptimConfig, ParallelConfig
from aligner.parallel.dims import ParallelDims
from aligner.protocol import build_sequences
from aligner.runtime.runner import budget_micro_batches, row_lengths
from tests.toolkit.models import tiny_model_config
from tests.toolkit.spawn import run_distributed

CFG = tiny_model_config(init_std=0.2)
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant", grad_clip=0.0)
PROMPTS, RESPONSES = (3, 6, 2, 4, 2, 5), (9, 1, 3, 12, 2, 6)  # rows of 12, 7, 5, 16, 4, 11 tokens


def _batch(seed: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 64, (n,), generator=g).tolist() for n in PROMPTS]
    responses = [torch.randint(4, 64, (n,), generator=g).tolist() for n in RESPONSES]
    seq = build_sequences(prompts, responses, pad_id=0)
    mask = seq["response_mask"]
    return {
        "input_ids": seq["input_ids"],
        "prompt_lens": seq["prompt_lens"],
        "response_mask": mask,
        "advantages": torch.randn(mask.shape, generator=g) * mask,
        "offset": torch.randn(mask.shape, generator=g) * 0.3,
    }


def _policy(budget: int, dims: ParallelDims = None) -> Policy:
    par = ParallelConfig(dp_size=dims.dp_size, dp_backend="ddp") if dims is not None else ParallelConfig()
    return Policy(CFG, par, OPTIM, dims or ParallelDims(device_type="cpu"), seed=0, micro_batch_tokens=budget)


def _update(budget: int, batch: dict, algo: AlgorithmConfig, dims: ParallelDims = None):
    """(log_probs [B, R], ppo_update metrics, {param: grad}) of one policy."""
    pol = _policy(budget, dims)
    lp = pol.log_probs(batch, micro_batch_size=1)
    full = {**batch, "old_log_probs": (lp - batch["offset"]) * batch["response_mask"]}
    full.pop("offset")
    out = pol.ppo_update(full, algo, micro_batch_size=1)
    grads = {n: p.grad.detach().clone() for n, p in pol.runtime.module.named_parameters()}
    return lp, out, grads


def test_budget_first_fit_groups_and_row_lengths():
    assert budget_micro_batches([12, 7, 5, 16, 4, 11], 24) == [[3], [0, 5], [1, 2, 4]]
    assert budget_micro_batches([3, 9, 2, 2], 20, unit=2) == [[0, 1], [2, 3]]  # pairs never split
    with pytest.raises(ValueError, match="more than the budget"):
        budget_micro_batches([5, 30], 20)
    b = _batch()
    assert row_lengths(b).tolist() == [p + r for p, r in zip(PROMPTS, RESPONSES)]
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert row_lengths({"input_ids": torch.zeros(3, 5, dtype=torch.long), "attention_mask": mask}).tolist() == [3, 5, 1]


@pytest.mark.parametrize("loss_agg", alg.LOSS_AGG_MODES)
def test_budget_micro_batches_equal_fixed_ones(loss_agg):
    algo = AlgorithmConfig(
        advantage="grpo", kl_coef=0.0, kl_loss_coef=0.0, entropy_coef=0.05, clip_eps=0.1, clip_eps_high=0.3, loss_agg=loss_agg
    )
    batch = _batch()
    lp_fixed, out_fixed, g_fixed = _update(0, batch, algo)
    lp_budget, out_budget, g_budget = _update(24, batch, algo)
    torch.testing.assert_close(lp_budget, lp_fixed, atol=1e-6, rtol=0)
    for k in ("policy_loss", "entropy", "clipfrac", "approx_kl"):
        assert out_budget[k] == pytest.approx(out_fixed[k], abs=1e-6), k
    for n, g in g_fixed.items():
        torch.testing.assert_close(g_budget[n], g, atol=1e-6, rtol=1e-5, msg=n)
    # the padding the budget saves: fixed micro-batches of one row run the batch's T = 16 per row
    t = batch["input_ids"].shape[1]
    real = sum(PROMPTS) + sum(RESPONSES)
    assert out_fixed["pad_tokens"] == len(PROMPTS) * t - real
    # budget 24, sorted first-fit: [16], [12, 11] cut to 12, [7, 5, 4] cut to 7
    assert out_budget["pad_tokens"] == 16 + 2 * 12 + 3 * 7 - real
    assert out_budget["pad_fraction"] == pytest.approx((16 + 24 + 21 - real) / (16 + 24 + 21))


def test_budget_below_the_longest_row_is_refused():
    pol = _policy(10)
    with pytest.raises(ConfigError, match=r"trainer\.micro_batch_tokens=10 is invalid: .*16 tokens; set it to at least 16"):
        pol.log_probs(_batch(), micro_batch_size=1)


def test_config_refuses_a_budget_below_the_stage_bound():
    from aligner.config.run import AlignerConfig
    from aligner.config.validation import validate_micro_batch_tokens

    cfg = AlignerConfig(stage="sft")
    cfg.trainer.micro_batch_tokens = cfg.data.max_seq_len - 1

    with pytest.raises(ConfigError) as e:
        validate_micro_batch_tokens(cfg)
    msg = str(e.value)
    assert msg.startswith(f"trainer.micro_batch_tokens={cfg.data.max_seq_len - 1} is invalid")
    assert f"set it to at least {cfg.data.max_seq_len}" in msg and "\n" not in msg


def _dp_battery(rank, world_size, budget):
    dims = ParallelDims(dp_size=world_size, world_size=world_size, rank=rank).build()
    batch = _batch()
    algo = AlgorithmConfig(advantage="grpo", kl_coef=0.0, kl_loss_coef=0.0, entropy_coef=0.05, loss_agg="token-mean")
    shard = {k: v[rank * 3 : rank * 3 + 3] for k, v in batch.items()}  # rows 12, 7, 5 | 16, 4, 11
    lp, out, grads = _update(budget, shard, algo, dims)
    pol_counts = len(budget_micro_batches(row_lengths(shard).tolist(), budget))
    return {"lp": lp, "out": out, "grads": grads, "count": pol_counts}


def test_dp2_uneven_micro_batch_counts_equal_dp1():
    """Budget 20: rank 0's rows (12, 7, 5) need 2 micro-batches, rank 1's (16, 4, 11) need 3."""
    res = run_distributed(_dp_battery, world_size=2, args=(20,), timeout_s=120)
    assert [r["count"] for r in res] == [2, 3]
    algo = AlgorithmConfig(advantage="grpo", kl_coef=0.0, kl_loss_coef=0.0, entropy_coef=0.05, loss_agg="token-mean")
    lp, out, grads = _update(0, _batch(), algo)
    torch.testing.assert_close(torch.cat([res[0]["lp"], res[1]["lp"]]), lp, atol=1e-6, rtol=0)
    for k in ("policy_loss", "entropy"):
        assert res[0]["out"][k] == pytest.approx(out[k], abs=1e-6)
    for n, g in grads.items():
        torch.testing.assert_close(res[0]["grads"][n], g, atol=1e-6, rtol=1e-5, msg=n)
