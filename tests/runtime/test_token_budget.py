"""Token-budget micro-batches (``trainer.micro_batch_tokens``) against row-count micro-batches.

A ragged batch run as budget micro-batches (sorted first-fit, each cut to its longest row) must
give the same PPO loss, every parameter's gradient (fp32, within 1e-6) and the same per-token
log-probs as fixed micro-batches of one row; on dp=2 over gloo, where the two ranks' shards need
different micro-batch counts, the step must not hang (filler micro-batches) and equal dp=1, with
token budgets and with row-count micro-batches (DDP and FSDP2). The
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
from aligner.runtime.runner import budget_micro_batches, row_lengths
from tests.toolkit.models import tiny_model_config
from tests.toolkit.roles import rl_batch
from tests.toolkit.spawn import run_distributed

CFG = tiny_model_config(init_std=0.2)
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant", grad_clip=0.0)
PROMPTS, RESPONSES = (3, 6, 2, 4, 2, 5), (9, 1, 3, 12, 2, 6)  # rows of 12, 7, 5, 16, 4, 11 tokens


def _batch(seed: int = 4) -> dict[str, torch.Tensor]:
    """The six ragged rows: input_ids, prompt_lens, response_mask, advantages and offset [B, R]."""
    return {k: v for k, v in rl_batch(seed, prompt_lens=PROMPTS, response_lens=RESPONSES).items() if k != "returns"}


def _policy(budget: int, dims: ParallelDims = None, backend: str = "ddp") -> Policy:
    par = ParallelConfig(dp_size=dims.dp_size, pp_size=dims.pp_size, dp_backend=backend) if dims is not None else ParallelConfig()
    return Policy(CFG, par, OPTIM, dims or ParallelDims(device_type="cpu"), seed=0, micro_batch_tokens=budget)


def _update(
    budget: int,
    batch: dict,
    algo: AlgorithmConfig,
    dims: ParallelDims = None,
    backend: str = "ddp",
    micro_batch_size: int = 1,
    grads: bool = True,
):
    """(log_probs [B, R], ppo_update metrics, {param: grad}) of one policy (full gradients: FSDP2's
    sharded ones gathered; none when not `grads`)."""
    pol = _policy(budget, dims, backend)
    lp = pol.log_probs(batch, micro_batch_size=micro_batch_size)
    full = {**batch, "old_log_probs": (lp - batch["offset"]) * batch["response_mask"]}
    full.pop("offset")
    out = pol.ppo_update(full, algo, micro_batch_size=micro_batch_size)
    out_grads = {}
    for n, p in pol.runtime.module.named_parameters() if grads else ():
        g = p.grad.detach()
        out_grads[n] = g.full_tensor() if hasattr(g, "full_tensor") else g.clone()
    return lp, out, out_grads


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


def _uneven_battery(rank, world_size, backend, micro_batch_size, pp_size=1):
    dims = ParallelDims(dp_size=world_size // pp_size, pp_size=pp_size, world_size=world_size, rank=rank).build()
    rows = slice(0, 3) if dims.dp_rank == 0 else slice(3, 5)  # 3 rows and 2 rows: the shards of 5 over dp = 2
    shard = {k: v[rows] for k, v in _batch().items()}
    algo = AlgorithmConfig(advantage="grpo", kl_coef=0.0, kl_loss_coef=0.0, entropy_coef=0.05, loss_agg="token-mean")
    # the pipeline case compares log-probs and loss only (each stage holds its own layers' gradients)
    lp, out, grads = _update(0, shard, algo, dims, backend, micro_batch_size, grads=pp_size == 1)
    return {"lp": lp, "out": out, "grads": grads, "dp": dims.dp_rank, "pp": dims.pp_rank}


@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
@pytest.mark.parametrize("micro_batch_size", [1, 2])
def test_dp2_shards_of_different_row_counts_do_not_hang_and_equal_dp1(backend, micro_batch_size):
    """Row-count micro-batches: 5 rows over dp = 2 are shards of 3 and 2, which need 3 and 2 (or 2 and 1)
    micro-batches. Before the evening-out DDP's backward all-reduces and FSDP2's
    forward all-gathers did not pair up and the step hung; now the shorter rank runs a filler
    micro-batch first, and log-probs, loss and every gradient equal one process on the 5 rows."""
    res = run_distributed(_uneven_battery, world_size=2, args=(backend, micro_batch_size), timeout_s=120)
    algo = AlgorithmConfig(advantage="grpo", kl_coef=0.0, kl_loss_coef=0.0, entropy_coef=0.05, loss_agg="token-mean")
    five = {k: v[:5] for k, v in _batch().items()}
    lp, out, grads = _update(0, five, algo, micro_batch_size=micro_batch_size)
    r = lp.shape[1]
    got = torch.cat([res[0]["lp"][:, :r], res[1]["lp"][:, :r]])
    torch.testing.assert_close(got, lp, atol=1e-6, rtol=0)
    for k in ("policy_loss", "entropy"):
        assert res[0]["out"][k] == pytest.approx(out[k], abs=1e-6)
    for n, g in grads.items():
        torch.testing.assert_close(res[0]["grads"][n], g, atol=1e-6, rtol=1e-5, msg=n)


@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
def test_pp2_dp2_shards_of_different_row_counts_equal_dp1(backend):
    """The same uneven shards through the 1F1B pipeline (pp = 2 x dp = 2, micro-batches of one row): the
    filler runs through both stages, is dropped from the log-probs, and the step equals one process."""
    res = run_distributed(_uneven_battery, world_size=4, args=(backend, 1, 2), timeout_s=180)
    algo = AlgorithmConfig(advantage="grpo", kl_coef=0.0, kl_loss_coef=0.0, entropy_coef=0.05, loss_agg="token-mean")
    lp, out, grads = _update(0, {k: v[:5] for k, v in _batch().items()}, algo)
    r = lp.shape[1]
    by_dp = {r["dp"]: r for r in res if r["pp"] == 0}  # log-probs are broadcast to every stage
    assert sorted(by_dp) == [0, 1] and by_dp[0]["lp"].shape[0] == 3 and by_dp[1]["lp"].shape[0] == 2
    torch.testing.assert_close(torch.cat([by_dp[0]["lp"][:, :r], by_dp[1]["lp"][:, :r]]), lp, atol=1e-6, rtol=0)
    assert by_dp[0]["out"]["policy_loss"] == pytest.approx(out["policy_loss"], abs=1e-6)


# ---- token budgets with pipeline stages -------------------------------------------------------
CFG4 = tiny_model_config(init_std=0.2, num_layers=4)  # interleaving: pp 2 x 2 chunks of one layer


def _pp_battery(rank, world_size, budget, tp, pp, dp, vpp, backend, num_layers):
    """One PPO step of the policy on this rank's dp shard (dp = 2: rows 0-2 | 3-5) with a token budget;
    records every micro-batch list the runner formed ([(b, T, filler)] per pass) and the full gradients."""
    from aligner.runtime.runner import FILLER
    from tests.toolkit.roles import full_grads

    dims = ParallelDims(tp_size=tp, pp_size=pp, dp_size=dp, world_size=world_size, rank=rank).build()
    par = ParallelConfig(tp_size=tp, pp_size=pp, dp_size=dp, virtual_pp_size=vpp, dp_backend=backend, sequence_parallel=tp > 1)
    cfg = CFG4 if num_layers == 4 else CFG
    pol = Policy(cfg, par, OPTIM, dims, seed=0, micro_batch_tokens=budget)
    passes, prepare = [], pol.runner._prepare

    def recording(*args, **kwargs):
        mbs, order = prepare(*args, **kwargs)
        passes.append([(*mb["input_ids"].shape, bool(mb.get(FILLER))) for mb in mbs])
        return mbs, order

    pol.runner._prepare = recording
    batch = _batch()
    if dp == 2:
        batch = {k: v[3 * dims.dp_rank : 3 * dims.dp_rank + 3] for k, v in batch.items()}
    algo = AlgorithmConfig(advantage="grpo", kl_coef=0.0, kl_loss_coef=0.0, entropy_coef=0.05, loss_agg="token-mean")
    lp = pol.log_probs(batch, micro_batch_size=1)
    full = {**batch, "old_log_probs": (lp - batch["offset"]) * batch["response_mask"]}
    full.pop("offset")
    out = pol.ppo_update(full, algo, micro_batch_size=1)
    if tp == 1:  # this stage's parameters (HF names), FSDP2's shards gathered over dp
        grads = {}
        for n, p in pol.runtime.module.named_parameters():
            g = p.grad.detach()
            grads[n] = g.full_tensor() if hasattr(g, "full_tensor") else g.clone()
    else:  # TP shards and stages gathered (dp = 1 here)
        grads = full_grads(pol.runtime)
    return {"lp": lp, "out": out, "grads": grads, "passes": passes, "dp": dims.dp_rank, "pp": dims.pp_rank}


def _one_process(num_layers: int):
    """Log-probs, metrics and gradients of one process on the six rows, row-count micro-batches of one row."""
    algo = AlgorithmConfig(advantage="grpo", kl_coef=0.0, kl_loss_coef=0.0, entropy_coef=0.05, loss_agg="token-mean")
    pol = Policy(CFG4 if num_layers == 4 else CFG, ParallelConfig(), OPTIM, ParallelDims(device_type="cpu"), seed=0)
    batch = _batch()
    lp = pol.log_probs(batch, micro_batch_size=1)
    full = {**batch, "old_log_probs": (lp - batch["offset"]) * batch["response_mask"]}
    full.pop("offset")
    out = pol.ppo_update(full, algo, micro_batch_size=1)
    grads = {n: p.grad.detach().clone() for n, p in pol.runtime.module.named_parameters()}
    return lp, out, grads


@pytest.mark.parametrize(
    "budget, tp, pp, dp, vpp, backend, num_layers, counts",
    [
        # 6 rows (12, 7, 5, 16, 4, 11) in budget 24: [16], [12, 11] cut to 12, [7, 5, 4] cut to 7
        (24, 1, 2, 1, 1, "fsdp2", 2, [3]),
        # dp shards (12, 7, 5) | (16, 4, 11) in budget 20 need 2 | 3 micro-batches: dp rank 0 runs a filler first
        (20, 1, 2, 2, 1, "ddp", 2, [3, 3]),
        (20, 1, 2, 2, 1, "fsdp2", 2, [3, 3]),
        # interleaved (2 chunks a rank): the 3 micro-batches of a training pass padded to 4, a multiple of pp = 2
        (24, 1, 2, 1, 2, "fsdp2", 4, [4]),
        (20, 1, 2, 2, 2, "ddp", 4, [4, 4]),
        # sequence parallelism: each micro-batch's T rounded up to tp = 2 (the 7-token one runs 8), receive buffers T / 2
        (24, 2, 2, 1, 1, "fsdp2", 2, [3]),
    ],
)
def test_pipeline_stages_with_a_token_budget_equal_one_process(budget, tp, pp, dp, vpp, backend, num_layers, counts):
    """Token-budget micro-batches of different widths through 1F1B (and interleaved 1F1B): every pp rank of
    a dp replica forms the same micro-batches (fillers included), the training pass of the interleaved
    schedule runs a multiple of pp_size, and log-probs (forward-only path), loss and every parameter's
    gradient equal one process running row-count micro-batches of one row (fp32: 1e-6, gradients + 1e-5
    relative; tp > 1 sums in another order: 1e-5)."""
    res = run_distributed(_pp_battery, world_size=tp * pp * dp, args=(budget, tp, pp, dp, vpp, backend, num_layers), timeout_s=300)
    lp, out, grads = _one_process(num_layers)
    atol = 1e-6 if tp == 1 else 1e-5
    for d in range(dp):
        replica = [r for r in res if r["dp"] == d]
        assert all(r["passes"] == replica[0]["passes"] for r in replica), "pp/tp ranks of a replica split alike"
        train = replica[0]["passes"][-1]  # the ppo_update pass
        assert len(train) == counts[d] and len(train) % (pp if vpp > 1 else 1) == 0, train
        widths = {w for _, w, filler in train if not filler}
        assert len(widths) > 1 and all(w % tp == 0 for w in widths), train  # micro-batches of their own widths
        rows = slice(3 * d, 3 * d + 3) if dp == 2 else slice(None)
        r = lp.shape[1]
        # the 4-layer model's log-probs (magnitude up to ~10) differ from micro-batches of one row by up to 2e-6
        # (fp32 sums over other batch shapes; the same with pp = 1): relative 1e-6 on top of the absolute 1e-6
        rtol = 1e-6 if num_layers == 4 else 0
        torch.testing.assert_close(replica[0]["lp"][:, :r], lp[rows], atol=atol, rtol=rtol, msg=f"dp rank {d}")
        for k in ("policy_loss", "entropy", "clipfrac"):
            assert replica[0]["out"][k] == pytest.approx(out[k], abs=atol), k
    got = {n: g for r in res if r["dp"] == 0 for n, g in r["grads"].items()}  # every stage's parameters
    assert sorted(got) == sorted(grads)
    for n, g in grads.items():
        torch.testing.assert_close(got[n], g, atol=atol, rtol=1e-5, msg=n)
    if dp == 2:  # dp rank 0's shard needs fewer micro-batches: it ran a filler
        assert any(f for _, _, f in [r for r in res if r["dp"] == 0][0]["passes"][-1])


def test_config_accepts_a_budget_with_pipeline_stages_and_refuses_deepspeed():
    """pp_size > 1 (plain and interleaved) with a token budget passes the config; the interleaved multiple-of-pp check is the runner's fillers then, not micro_batch_size's;
    DeepSpeed is still refused in one line naming the field, the value and the fix."""
    from aligner.config.run import AlignerConfig
    from aligner.config.validation import validate_interleaved, validate_micro_batch_tokens

    cfg = AlignerConfig(stage="sft")
    cfg.trainer.micro_batch_tokens = cfg.data.max_seq_len
    cfg.trainer.global_batch_size, cfg.trainer.micro_batch_size = 6, 1  # 6 row-count micro-batches: not a multiple of 4
    cfg.actor.parallel.pp_size, cfg.actor.parallel.virtual_pp_size = 4, 2
    validate_micro_batch_tokens(cfg)
    validate_interleaved(cfg)
    cfg.trainer.micro_batch_tokens = 0
    with pytest.raises(ConfigError, match="trainer.micro_batch_size=1 is invalid"):
        validate_interleaved(cfg)  # row-count micro-batches keep the config-time check
    cfg.trainer.micro_batch_tokens = cfg.data.max_seq_len
    cfg.actor.parallel.pp_size, cfg.actor.parallel.virtual_pp_size, cfg.actor.parallel.dp_backend = 1, 1, "deepspeed"
    with pytest.raises(ConfigError) as e:
        validate_micro_batch_tokens(cfg)
    msg = str(e.value)
    assert msg.startswith(f"trainer.micro_batch_tokens={cfg.data.max_seq_len} is invalid") and "\n" not in msg, msg
    assert "actor.parallel has dp_backend=deepspeed" in msg and "set trainer.micro_batch_tokens=0" in msg, msg
