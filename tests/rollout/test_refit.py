"""Refit across trainer -> engine layouts on 2 gloo ranks, checked against a single-process reference.

One spawn runs every layout pair (tp 1->1, 2->1, 1->2, 2->2, pp 2->1 where the freed stage
becomes a second engine replica, pp 2->2 with a pipeline-parallel engine). For each, the
trainer holds "trained" weights (the seed-3 model plus a seeded perturbation, standing in for
an optimizer step), the engine starts from different weights (seed 99), then after
``refit`` the engine's greedy tokens must equal a no-cache greedy run of the unsharded
trained model and its sampled rollout log-probs must match that model's full-forward
log-probs within 1e-5, with the weight version stamped on every Generation.
"""

from __future__ import annotations

import pytest
import torch

from tests.toolkit.models import tiny_model_config
from tests.toolkit.spawn import run_distributed

pytestmark = pytest.mark.distributed

TOL = 1e-5
LAYOUTS = {  # name: (tp_train, pp_train, tp_infer, pp_infer)
    "tp1->1": (1, 1, 1, 1),
    "tp2->1": (2, 1, 1, 1),
    "tp1->2": (1, 1, 2, 1),
    "tp2->2": (2, 1, 2, 1),
    "pp2->1": (1, 2, 1, 1),
    "pp2->2": (1, 2, 1, 2),
}
PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11], [3, 3]]


def tiny_cfg():

    return tiny_model_config(init_std=0.1)


def trained_state_dict(cfg) -> dict:
    from aligner.model.llama import build_model

    model = build_model(cfg, seed=3)
    g = torch.Generator().manual_seed(17)
    return {n: (p.detach() + 0.05 * torch.randn(p.shape, generator=g)).clone() for n, p in model.state_dict().items()}


@torch.no_grad()
def reference(cfg, sd, sampling_gens):
    """Greedy tokens (no cache, full forward) and full-forward log-probs of given responses."""
    from aligner.model.llama import build_model
    from aligner.nn.vocab import vocab_parallel_log_probs

    model = build_model(cfg, seed=0)
    model.load_state_dict(sd)
    greedy = []
    for p in PROMPTS:
        ids = list(p)
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        greedy.append(ids[len(p) :])
    lps = []
    for p, (ids, temp) in zip(PROMPTS, sampling_gens):
        full = torch.tensor([p + ids])
        lps.append(vocab_parallel_log_probs(model(full)[:, len(p) - 1 : -1], full[:, len(p) :], temperature=temp)[0])
    return greedy, lps


def battery(rank: int, world_size: int) -> dict:
    from aligner.config import SamplingConfig
    from aligner.parallel.dims import ParallelDims
    from aligner.parallel.parallelize import build_parallel_model
    from aligner.parallel.sharding import load_full_state_dict
    from aligner.rollout.torch_engine.engine import TorchEngine
    from aligner.rollout.weight_sync.refit import refit, rollout_dims

    cfg = tiny_cfg()
    sd = trained_state_dict(cfg)
    out = {}
    for name, (tp_t, pp_t, tp_i, pp_i) in LAYOUTS.items():
        train = ParallelDims(tp_size=tp_t, pp_size=pp_t, dp_size=world_size // (tp_t * pp_t), world_size=world_size, rank=rank).build()
        trainer = build_parallel_model(cfg, "lm", train, seed=3)
        load_full_state_dict(trainer, {k: v for k, v in sd.items() if k in dict(trainer.named_parameters())})
        infer = rollout_dims(world_size, rank, tp_i, pp_i)
        engine = TorchEngine(build_parallel_model(cfg, "lm", infer, seed=99), tp_group=infer.tp_group, pp_group=infer.pp_group)
        stats = refit(trainer, engine, bucket_mb=0.005, tp_group=train.tp_group, pp_group=train.pp_group)
        greedy = engine.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=6))
        sampled = engine.generate(PROMPTS, SamplingConfig(temperature=0.8, top_k=10, max_new_tokens=6), seeds=[1, 2, 3, 4])
        ref_greedy, ref_lps = reference(cfg, sd, [(g.token_ids, 1.0) for g in greedy])
        _, ref_sampled = reference(cfg, sd, [(g.token_ids, 0.8) for g in sampled])
        out[name] = {
            "greedy_ok": [g.token_ids for g in greedy] == ref_greedy,
            "greedy_lp_err": max(float((torch.tensor(g.rollout_log_probs) - r).abs().max()) for g, r in zip(greedy, ref_lps)),
            "sampled_lp_err": max(float((torch.tensor(g.rollout_log_probs) - r).abs().max()) for g, r in zip(sampled, ref_sampled)),
            "sampled_tokens": [g.token_ids for g in sampled],
            "versions": {g.weight_version for g in greedy + sampled},
            "buckets": stats.buckets,
            "tensors": stats.tensors,
            "dp_infer": infer.dp_size,
        }
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_refit_layouts_match_single_process_reference():
    results = run_distributed(battery, world_size=2)
    n_params = len(trained_state_dict(tiny_cfg()))
    for name, (tp_t, pp_t, tp_i, pp_i) in LAYOUTS.items():
        for rank, res in enumerate(results):
            r = res[name]
            assert r["greedy_ok"], (name, rank)
            assert r["greedy_lp_err"] < TOL and r["sampled_lp_err"] < TOL, (name, rank, r)
            assert r["versions"] == {1} and r["buckets"] > 1 and r["tensors"] == n_params, (name, rank, r)
            # dp_infer = dp_train * pp_train / pp_infer * tp_train / tp_infer
            assert r["dp_infer"] == (2 // (tp_t * pp_t)) * pp_t // pp_i * tp_t // tp_i
        # every replica / rank saw the same tokens for the same seeds (layout-independent sampling)
        assert results[0][name]["sampled_tokens"] == results[1][name]["sampled_tokens"], name
    assert len({str(results[0][n]["sampled_tokens"]) for n in LAYOUTS}) == 1  # same tokens in every layout


def _fsdp_actor_refit_battery(rank, world_size, moe: bool = False, rollout_tp: int = 1):
    """An FSDP2 actor (dp=2, the default dp_backend) refits its engine from the full state dict in buckets.
    moe: a Mixtral-style actor with its experts split over ep=2 (DDP) instead, refitting an engine
    that holds every expert (tp-sharded when rollout_tp=2)."""
    from aligner.config import AlignerConfig, ModelConfig, ParallelConfig, RolloutConfig, SamplingConfig
    from aligner.model.llama import build_model
    from aligner.parallel.dims import ParallelDims
    from aligner.rollout.torch_engine.engine import TorchEngine
    from aligner.workers.actor import ActorWorker

    extra = dict(num_experts=4, num_experts_per_tok=2) if moe else {}
    model_cfg = ModelConfig(num_layers=2, vocab_size=64, **extra)
    cfg = AlignerConfig(model=model_cfg, rollout=RolloutConfig(refit_bucket_mb=1))  # ~1.7 MB of weights: several buckets
    cfg.rollout.parallel = ParallelConfig(tp_size=rollout_tp, dp_size=2 // rollout_tp)
    cfg.actor.parallel = ParallelConfig(dp_size=2, ep_size=2, dp_backend="ddp") if moe else ParallelConfig(dp_size=2)
    dims = ParallelDims.from_env(tp_size=1, pp_size=1, dp_size=2, ep_size=2 if moe else 1)
    worker = ActorWorker(cfg, "actor", total_steps=1, eos_token_id=None, dims=dims)
    assert worker.policy.runtime.fsdp or moe  # the sharded branch of refit
    worker.refit()  # builds the engine; its weights start as the policy's seeded init
    with torch.no_grad():  # so move the policy away from it (DTensor shards scale alike)
        for p in worker.policy.runtime.module.parameters():
            p.mul_(1.25)
    stats = worker.refit()
    full = worker.policy.full_state_dict()
    engine = dict(worker.engine.model.named_parameters())
    prompts, greedy = [[1, 2, 3], [4, 5]], SamplingConfig(temperature=0.0, max_new_tokens=4)
    share = worker.generate(prompts, greedy, [0, 1])
    ref = build_model(model_cfg, seed=1)
    ref.load_state_dict(full, strict=False)
    want = TorchEngine(ref.eval()).generate(prompts, greedy)
    return {
        "bytes": stats["bytes"],
        "full_bytes": sum(v.numel() * v.element_size() for v in full.values()),
        "version": stats["weight_version"],
        "max_diff": 0.0
        if rollout_tp > 1  # tp-sharded engine tensors: its greedy tokens are the check
        else max((engine[n].detach().reshape(-1) - full[n].reshape(-1)).abs().max().item() for n in engine if n in full),
        "compared": sum(n in full for n in engine) if rollout_tp == 1 else len(engine),
        "local_experts": [m.num_local_experts for m in worker.policy.runtime.module.modules() if hasattr(m, "num_local_experts")],
        "share": None if share is None else (share[0], [g.token_ids for g in share[1]]),
        "want": [g.token_ids for g in want],
    }


@pytest.mark.distributed
def test_fsdp2_actor_refits_its_engine_in_buckets_and_generates_like_the_full_model():
    res = run_distributed(_fsdp_actor_refit_battery, world_size=2)
    for r in res:
        assert r["version"] == 2 and r["bytes"] == r["full_bytes"] and r["compared"] > 0
        assert r["max_diff"] == 0.0  # the engine holds copies of the gathered tensors
    shares = sorted((r["share"] for r in res if r["share"] is not None), key=lambda x: x[0])
    assert [t for _, toks in shares for t in toks] == res[0]["want"]  # replicas together = one full-model engine


@pytest.mark.distributed
@pytest.mark.parametrize("rollout_tp", [1, 2])
def test_expert_parallel_actor_refits_an_engine_holding_every_expert(rollout_tp):
    """MoE actor with ep=2 (2 of 4 experts per rank) -> engine replicas with all 4 experts (tp=1: one
    per rank, tp=2: one replica, each expert tp-sharded): greedy tokens equal a full-model engine's."""
    res = run_distributed(_fsdp_actor_refit_battery, world_size=2, args=(True, rollout_tp))
    for r in res:
        assert r["version"] == 2 and r["bytes"] == r["full_bytes"] and r["compared"] > 0 and r["max_diff"] == 0.0
        assert r["local_experts"] == [2, 2]
    shares = sorted((r["share"] for r in res if r["share"] is not None), key=lambda x: x[0])
    assert [t for _, toks in shares for t in toks] == res[0]["want"]
