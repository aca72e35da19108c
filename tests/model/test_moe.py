"""The sparse MoE layer (aligner.model.moe) against HF Mixtral, the Switch formula and itself under TP.

- HF parity: a random tiny ``MixtralForCausalLM`` loads into our model with logits within 1e-5
  (fp32), and our export loads back into transformers with the same logits.
- Auxiliary losses: the Switch load-balancing loss equals the paper's formula written as loops, and
  HF's ``load_balancing_loss_func`` (which counts over N tokens, not N*k assignments) divided by
  k; the gradient the block's hidden _AuxLoss adds equals autograd of lm_loss + coef * (aux + z).
- Routing: Sinkhorn top-1 balances a skewed router better than plain top-1; capacity drops exactly
  the assignments beyond ceil(c * N * k / E) per expert (checked against a loop reference).
- tp=2 and pp=2 (gloo) equal one process: logits, log-probs, loss, every gradient, params after 3 AdamW
  steps, with and without sequence parallelism, both routers, recomputation, micro-batches,
  the score model (tests.parallel.test_tensor_parallel.run_layout).
- The engine decodes MoE layers: greedy tokens equal a no-cache argmax loop.
- Engine / trainer routing: the engine's per-response-token experts (Generation.routed_experts) and the
  trainer's (Policy.log_probs_with_routing) equal a no-cache forward's last_experts, on one process
  (both schedulers), pp=2 and tp=2 with SP; routing_mismatch is 0.0 for equal weights and, after a
  small change of one router row in the engine, equals the count from the two models' last_experts.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.toolkit.assertions import assert_layout_matches
from tests.toolkit.generation import greedy_reference
from tests.toolkit.layouts import make_dims, run_layout
from tests.toolkit.models import tiny_model_config
from tests.toolkit.spawn import run_distributed

TOL = 1e-5


def moe_cfg(**kw):
    base = dict(intermediate_size=48, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01)
    return tiny_model_config(**{**base, **kw})


@pytest.fixture(scope="module")
def hf_mixtral(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2)  # large enough that routing differs token to token
    path = tmp_path_factory.mktemp("mixtral")
    hf.save_pretrained(path)
    return hf, path


def test_hf_mixtral_import_and_export_match_logits(hf_mixtral, tmp_path):
    import transformers

    from aligner.model.hf import load_hf_model, read_hf_config, save_hf

    hf, path = hf_mixtral
    model, cfg = load_hf_model(path)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_router) == (4, 2, "topk_softmax")
    model.eval()
    x = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(x).logits
        got = model(x)
    assert float((got - ref).abs().max()) < TOL
    # routing really varies: more than one expert pair chosen in layer 0
    assert len({tuple(r) for r in model.model.layers["0"].mlp.last_experts.sort(-1).values.tolist()}) > 1

    save_hf(model.state_dict(), cfg, tmp_path / "out")
    assert read_hf_config(tmp_path / "out")["architectures"] == ["MixtralForCausalLM"]
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert float((back(x).logits - got).abs().max()) < TOL


def _switch_reference(probs: torch.Tensor, experts: torch.Tensor, num_experts: int) -> float:
    """Fedus et al. 2021 eq. 4-6 as loops: E * sum_i f_i P_i, f_i over the N*k assignments."""
    n, k = experts.shape
    total = 0.0
    for i in range(num_experts):
        f = sum(1 for t in range(n) for j in range(k) if int(experts[t, j]) == i) / (n * k)
        p = sum(float(probs[t, i]) for t in range(n)) / n
        total += f * p
    return num_experts * total


def test_switch_loss_matches_paper_and_hf():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from aligner.model.moe import route, switch_load_balancing_loss

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(40, 8, generator=g) * 2
    for k in (1, 2):
        _, experts, probs = route(logits, k, "topk_softmax", training=True)
        ours = float(switch_load_balancing_loss(probs, experts, 8))
        assert abs(ours - _switch_reference(probs, experts, 8)) < 1e-6
        assert abs(ours * k - float(load_balancing_loss_func((logits,), 8, k))) < 1e-5
    # perfectly balanced routing gives 1.0
    probs = torch.full((8, 4), 0.25)
    assert abs(float(switch_load_balancing_loss(probs, torch.arange(8).remainder(4).unsqueeze(1), 4)) - 1.0) < 1e-7


def test_aux_loss_gradient_is_added_in_backward():
    """The block returns only the hidden states; backward adds coef * d(aux)/d(.), scaled by 1/micro-batches."""
    from aligner.model.llama import build_model
    from aligner.model.moe import moe_layers, route, router_z_loss, set_aux_loss_scale, switch_load_balancing_loss

    cfg = moe_cfg(router_aux_loss_coef=0.3, router_z_loss_coef=0.05)
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    model = build_model(cfg, seed=5)
    set_aux_loss_scale(model, 0.5)
    model(x).float().logsumexp(-1).mean().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = build_model(cfg, seed=5)
    for m in moe_layers(ref):  # recompute the auxiliary terms explicitly from the router inputs
        m.aux_coef = m.z_coef = 0.0
    inputs = []
    hooks = [m.gate.register_forward_hook(lambda mod, inp, out: inputs.append(out)) for m in moe_layers(ref)]
    lm = ref(x).float().logsumexp(-1).mean()
    aux = 0.0
    for logits in inputs:
        _, experts, probs = route(logits, cfg.num_experts_per_tok, "topk_softmax", training=True)
        aux = aux + 0.5 * (0.3 * switch_load_balancing_loss(probs, experts, cfg.num_experts) + 0.05 * router_z_loss(logits))
    (lm + aux).backward()
    for h in hooks:
        h.remove()
    err = max(float((got[n] - p.grad).abs().max()) for n, p in ref.named_parameters())
    assert err < 1e-6
    assert float(got["model.layers.0.mlp.gate.weight"].abs().max()) > 0


def test_sinkhorn_balances_and_eval_routes_by_activation():
    from aligner.model.moe import route, sinkhorn

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(256, 4, generator=g) + torch.tensor([3.0, 0.0, 0.0, -1.0])  # skewed towards expert 0
    balanced = sinkhorn(logits)
    assert torch.allclose(balanced.sum(0), torch.full((4,), 1 / 4), atol=1e-3)
    _, e_sk, _ = route(logits, 1, "sinkhorn", training=True)
    _, e_soft, _ = route(logits, 1, "topk_softmax", training=True)
    load = lambda e: torch.bincount(e.reshape(-1), minlength=4).max().item() / 256
    assert load(e_sk) < 0.35 < load(e_soft)
    w_eval, e_eval, _ = route(logits, 1, "sinkhorn", training=False)
    assert torch.equal(e_eval.squeeze(1), logits.argmax(-1))
    assert torch.allclose(w_eval.squeeze(1), torch.sigmoid(logits.max(-1).values))


def test_capacity_drops_assignments_beyond_capacity():
    from aligner.model.llama import build_model
    from aligner.model.moe import route

    cfg = moe_cfg(num_layers=1, moe_capacity_factor=0.5)
    moe = build_model(cfg, seed=1).model.layers["0"].mlp.train()  # capacity applies in training only
    x = torch.randn(1, 24, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = moe(x)
        weights, experts, _ = route(moe.gate(x.reshape(-1, 32)), 2, "topk_softmax", training=True)
        cap = math.ceil(0.5 * 24 * 2 / 4)
        ref = torch.zeros(24, 32)
        taken = [0] * 4
        dropped = 0
        for e in range(4):  # assignments in token order within each expert
            for t in range(24):
                for j in range(2):
                    if int(experts[t, j]) != e:
                        continue
                    if taken[e] >= cap:
                        dropped += 1
                        continue
                    taken[e] += 1
                    ref[t] += weights[t, j] * moe.experts.expert(e, x[0, t : t + 1])[0]
    assert dropped > 0 and int(moe.stats["dropped"]) == dropped
    assert float((out.reshape(24, 32) - ref).abs().max()) < 1e-6
    with torch.no_grad():  # eval (the engine) is dropless
        moe.eval()(x)
    assert int(moe.stats["dropped"]) == 0


def test_engine_greedy_equals_no_cache_reference():
    from aligner.config import SamplingConfig
    from aligner.model.llama import build_model
    from aligner.rollout.torch_engine.engine import TorchEngine

    model = build_model(moe_cfg(init_std=0.1), seed=3).eval()
    prompts = [[1, 5, 9, 2], [7, 3], [4, 4, 4, 8, 10, 11]]
    gens = TorchEngine(model).generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=8))
    for prompt, g in zip(prompts, gens):
        assert g.token_ids == greedy_reference(model, prompt, 8)


MOE_LAYOUTS = {
    # name: (model overrides, kind, run_layout keywords)
    "topk softmax, no SP": (dict(), "lm", dict()),
    "topk softmax, SP, z-loss, selective": (dict(router_z_loss_coef=0.01), "lm", dict(sp=True, recompute="selective")),
    "sinkhorn top-1, no SP, full recompute": (dict(moe_router="sinkhorn", num_experts_per_tok=1), "lm", dict(recompute="full")),
    # the auxiliary loss is per micro-batch (a mean of per-micro-batch losses, not the whole batch's): off here
    "SP, 2 micro-batches, no aux": (dict(router_aux_loss_coef=0.0), "lm", dict(sp=True, num_micro_batches=2)),
    "score model, SP, capacity 1.0": (dict(moe_capacity_factor=1.0), "score", dict(sp=True)),
    "pp=2, topk softmax, aux + z-loss": (dict(router_z_loss_coef=0.01), "lm", dict()),
    "pp=2, 2 micro-batches, no aux": (dict(router_aux_loss_coef=0.0), "lm", dict(num_micro_batches=2)),
}


def moe_tp_battery(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    out = {}
    for name, (over, kind, kw) in MOE_LAYOUTS.items():
        dims = make_dims(tp=1, pp=2) if name.startswith("pp=2") else make_dims(tp=2, pp=1)
        out[name] = run_layout(dims, moe_cfg(**over), kind, **kw)
    return out


@pytest.fixture(scope="module")
def moe_tp_results():
    return run_distributed(moe_tp_battery, world_size=2)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_tp2_matches_single_process(moe_tp_results, layout):
    assert_layout_matches([res[layout] for res in moe_tp_results], layout)


def test_moe_config_errors():
    from aligner.errors import ConfigError

    for kw, needle in (
        (dict(num_experts_per_tok=5), "model.num_experts_per_tok"),
        (dict(moe_router="expert_choice"), "model.moe_router"),
        (dict(moe_capacity_factor=0.0), "model.moe_capacity_factor"),
        (dict(backend="te"), "model.backend"),
    ):
        with pytest.raises(ConfigError, match=needle):
            moe_cfg(**kw).validate()
    cfg = moe_cfg()
    dense = moe_cfg(num_experts=0)
    per_mlp = 3 * 32 * 48
    assert cfg.num_parameters() - dense.num_parameters() == 2 * (3 * per_mlp + 4 * 32)
    assert cfg.num_parameters(active=True) - dense.num_parameters() == 2 * (per_mlp + 4 * 32)


def _full_sequence_routing(model, batch) -> torch.Tensor:
    """Independent reference: every MoE layer's last_experts of a no-cache forward of the full
    sequences, read at the response positions prompt_len + i - 1 -> [B, R, L, k] sorted, -1 masked."""
    from aligner.model.moe import moe_layers

    ids, plen, mask = batch["input_ids"], batch["prompt_lens"], batch["response_mask"]
    b, r = mask.shape
    with torch.no_grad():
        model(ids)
    out = torch.full((b, r, len(moe_layers(model)), model.cfg.num_experts_per_tok), -1, dtype=torch.long)
    for layer, m in enumerate(moe_layers(model)):
        e = m.last_experts.view(b, ids.shape[1], -1)
        for i in range(b):
            for j in range(int(mask[i].sum())):
                out[i, j, layer] = e[i, int(plen[i]) + j - 1].sort().values
    return out


def test_routing_mismatch_engine_vs_trainer():
    """Engine (continuous and static schedulers, refills of a 2-slot pool) and trainer
    (Policy.log_probs_with_routing, 2 micro-batches) report the same experts for every response
    token and MoE layer when their weights are equal (mismatch 0.0), and both equal a no-cache
    full-sequence forward's last_experts; after a small change of one router row in the engine
    (refit by name) the mismatch is > 0 and equals the count from the two models' last_experts
    on the full sequences."""
    from aligner.actor.policy import Policy
    from aligner.algorithms import routing_mismatch
    from aligner.config import OptimConfig, ParallelConfig, SamplingConfig
    from aligner.model.llama import build_model
    from aligner.parallel.dims import ParallelDims
    from aligner.protocol import build_sequences
    from aligner.rollout.base import routed_experts_to_padded
    from aligner.rollout.torch_engine.engine import TorchEngine

    cfg = moe_cfg(init_std=0.1)
    pol = Policy(cfg, ParallelConfig(), OptimConfig(), ParallelDims(device_type="cpu"), seed=0)
    sd = {k: v.detach().clone() for k, v in pol.runtime.module.state_dict().items()}
    prompts = [[1, 5, 9, 2], [7, 3], [4, 4, 4, 8, 10, 11], [2, 6, 1]]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=10)
    seeds = [11, 12, 13, 14]

    def engine(scheduler: str):
        model = build_model(cfg, seed=1)
        model.load_state_dict(sd)
        return TorchEngine(model, max_batch_size=2, scheduler=scheduler, cpu_layout="out_in")

    def compare(eng, gens):
        batch = build_sequences(prompts, [g.token_ids for g in gens], 0)
        got = pol.log_probs_with_routing(batch, micro_batch_size=2, temperature=1.0)
        rollout = routed_experts_to_padded(gens)
        assert rollout.shape == got["routed_experts"].shape == (4, batch["response_mask"].shape[1], 2, 2)
        lp_diff = max(abs(a - b) for g, row in zip(gens, got["log_probs"]) for a, b in zip(g.rollout_log_probs, row.tolist()))
        ref_engine = _full_sequence_routing(eng.model, batch)
        ref_trainer = _full_sequence_routing(pol.runtime.module, batch)
        return batch, rollout, got["routed_experts"], lp_diff, ref_engine, ref_trainer

    for scheduler in ("continuous", "static"):
        eng = engine(scheduler)
        gens = eng.generate(prompts, sampling, seeds=seeds)
        batch, rollout, old, lp_diff, ref_engine, ref_trainer = compare(eng, gens)
        assert lp_diff < 1e-5
        assert torch.equal(rollout.long(), ref_engine) and torch.equal(old.long(), ref_trainer)
        assert routing_mismatch(rollout, old, batch["response_mask"]) == 0.0

    # one router row of layer 0 moved a little in the engine only: near-ties flip
    eng = engine("continuous")
    w = sd["model.layers.0.mlp.gate.weight"].clone()
    w[0] += 0.05 * torch.randn(w.shape[1], generator=torch.Generator().manual_seed(0))
    eng.update_weights([("model.layers.0.mlp.gate.weight", w)])
    eng.finish_weight_update()
    gens = eng.generate(prompts, sampling, seeds=seeds)
    batch, rollout, old, lp_diff, ref_engine, ref_trainer = compare(eng, gens)
    assert torch.equal(rollout.long(), ref_engine) and torch.equal(old.long(), ref_trainer)
    mask = batch["response_mask"] > 0
    differ = (ref_engine != ref_trainer).any(-1)[mask]  # [response tokens, layers]
    got = routing_mismatch(rollout, old, batch["response_mask"])
    assert 0.0 < got < 1.0 and got == int(differ.sum()) / differ.numel()
    assert lp_diff > 1e-4  # the changed routing moves the log-probs too
    print(f"perturbed router: routing mismatch {got:.3f}, max |log-prob diff| {lp_diff:.4f}")


ROUTING_LAYOUTS = {"pp=2": (1, 2, False), "tp=2, SP": (2, 1, True)}  # name: (tp, pp, sequence parallel)
ROUTING_PROMPTS = [[1, 5, 9, 2], [7, 3], [4, 4, 4, 8, 10, 11], [2, 6, 1], [7, 3]]


def routing_battery(rank: int, world_size: int) -> dict:
    """Per layout: the engine (its own tp/pp layout; continuous with 2 micro-batches, and static) and
    the trainer's Policy (same layout, seed-1 weights like the engine's) -> routed experts as lists."""
    from aligner.actor.policy import Policy
    from aligner.config import OptimConfig, ParallelConfig, SamplingConfig
    from aligner.parallel.parallelize import build_parallel_model
    from aligner.protocol import build_sequences
    from aligner.rollout.base import routed_experts_to_padded
    from aligner.rollout.torch_engine.engine import TorchEngine
    from aligner.rollout.weight_sync.refit import rollout_dims

    cfg = moe_cfg(init_std=0.1)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
    out = {}
    for name, (tp, pp, sp) in ROUTING_LAYOUTS.items():
        pol = Policy(
            cfg, ParallelConfig(tp_size=tp, pp_size=pp, sequence_parallel=sp, dp_backend="ddp"), OptimConfig(), make_dims(tp, pp), seed=1
        )
        edims = rollout_dims(world_size, rank, tp, pp)
        model = build_parallel_model(cfg, "lm", edims, seed=1)
        for scheduler in ("continuous", "static"):
            eng = TorchEngine(
                model, tp_group=edims.tp_group, pp_group=edims.pp_group, max_batch_size=2, scheduler=scheduler, cpu_layout="out_in"
            )
            gens = eng.generate(ROUTING_PROMPTS, sampling, seeds=list(range(len(ROUTING_PROMPTS))))
            batch = build_sequences(ROUTING_PROMPTS, [g.token_ids for g in gens], 0)
            got = pol.log_probs_with_routing(batch, micro_batch_size=2)
            out[(name, scheduler)] = ([g.token_ids for g in gens], routed_experts_to_padded(gens).tolist(), got["routed_experts"].tolist())
    return out


@pytest.mark.distributed
def test_routing_on_pp2_and_tp2_sp_matches_single_process():
    """With pp = 2 (each stage routes its own layer; the stages' experts are gathered over the pp group)
    and with tp = 2 + sequence parallelism, engine (both schedulers) and trainer report, on every
    rank, the experts of a single-process no-cache forward of the generated sequences."""
    from aligner.model.llama import build_model
    from aligner.protocol import build_sequences

    ref_model = build_model(moe_cfg(init_std=0.1), seed=1).eval()
    results = run_distributed(routing_battery, world_size=2)
    for key in results[0]:
        tokens, engine, trainer = results[0][key]
        batch = build_sequences(ROUTING_PROMPTS, tokens, 0)
        want = _full_sequence_routing(ref_model, batch)
        for rank, res in enumerate(results):
            assert res[key][0] == tokens, (rank, key)
            assert torch.equal(torch.tensor(res[key][1]), want), (rank, key, "engine")
            assert torch.equal(torch.tensor(res[key][2]), want), (rank, key, "trainer")
