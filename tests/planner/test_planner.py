"""Planner: the memory model against what aligner allocates on CPU, and the search on real presets.

Reference parameter counts: Llama 2 paper / HF config.json (7B: 6,738,415,616; 13B:
13,015,864,320; 70B: 68,976,648,192 parameters).
"""

import dataclasses

import pytest
import torch

from aligner.cli import load_config
from aligner.config import (
    AlignerConfig,
    ClusterConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RefRoleConfig,
    RewardRoleConfig,
    RolloutConfig,
    SamplingConfig,
    TrainableRoleConfig,
    TrainerConfig,
)
from aligner.model.llama import build_model
from aligner.parallel.parallelize import apply_recompute
from aligner.planner import (
    GIB,
    Layout,
    LayoutEstimate,
    PlanError,
    Rejected,
    RoleWork,
    check_fits,
    estimate_layout,
    evaluate_layout,
    format_plan,
    kv_cache_bytes,
    layer_activation_bytes_per_token,
    make_plan,
    plan_role,
    print_plan,
    role_num_parameters,
    role_works,
    smallest_cluster,
    train_bytes_per_parameter,
)
from aligner.runtime.adamw import build_adamw
from tests.toolkit.models import tiny_model_config

LLAMA2 = {
    "7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32),
    "13b": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40, num_kv_heads=40),
    "70b": dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8),
}


def llama2_cfg(size: str, nodes: int, gpus: int = 8, mem: float = 80.0, stage: str = "plan", **kw) -> AlignerConfig:
    bf16 = lambda schema=TrainableRoleConfig: schema(parallel=ParallelConfig(mixed_precision="bf16"))  # noqa: E731
    return AlignerConfig(
        stage=stage,
        preset=f"llama2_{size}",
        model=ModelConfig(**LLAMA2[size], max_seq_len=4096, dtype="bfloat16"),
        data=DataConfig(max_prompt_len=1024, max_seq_len=2048),
        actor=bf16(),
        critic=bf16(),
        reward=bf16(RewardRoleConfig),
        ref=bf16(RefRoleConfig),
        rollout=RolloutConfig(parallel=ParallelConfig(mixed_precision="bf16"), sampling=SamplingConfig(max_new_tokens=1024)),
        trainer=TrainerConfig(rollout_batch_size=128, mini_batch_size=128, micro_batch_size=1, global_batch_size=128),
        cluster=ClusterConfig(num_nodes=nodes, gpus_per_node=gpus, gpu_mem_gb=mem),
        **kw,
    )


TINY = tiny_model_config(vocab_size=96, hidden_size=64, intermediate_size=176, num_layers=3, max_seq_len=64)


def tiny_work(seq: int, batch: int, kind: str = "lm") -> RoleWork:
    return RoleWork(role="actor", kind=kind, mode="train", parallel=ParallelConfig(), batch=batch, batch_field="b", seq_len=seq)


def storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("kind,state_dtype", [("lm", "float32"), ("score", "float32"), ("lm", "bfloat16"), ("score", "bfloat16")])
def test_parameter_grad_optimizer_bytes_exact(kind, state_dtype):
    """The planner's weights, grads and optimizer bytes equal the storages of the optimizer the
    runtime builds (torch's AdamW, or bf16 moments with optim.state_dtype=bfloat16)."""
    model = build_model(TINY, kind=kind)
    opt = build_adamw(list(model.parameters()), OptimConfig(state_dtype=state_dtype))
    ids = torch.randint(0, TINY.vocab_size, (2, 16))
    model(ids).float().pow(2).mean().backward()
    opt.step()
    params = list(model.parameters())
    work = dataclasses.replace(tiny_work(16, 2, kind), optim_state_dtype=state_dtype)
    est = estimate_layout(TINY, work, Layout(tp=1, pp=1, dp=1, micro_batch_size=2), ClusterConfig())
    assert role_num_parameters(TINY, kind) == sum(p.numel() for p in params)
    assert est.memory.weights == storage_bytes(params)
    assert est.memory.grads == storage_bytes(p.grad for p in params)
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    assert est.memory.optimizer == storage_bytes(state)


def test_bf16_moments_report_12_bytes_per_parameter_instead_of_16(capsys):
    """fp32 weights 4 + grads 4 + Adam moments 2 x 4 = 16 B per parameter; bf16 moments: 4 + 4 + 2 x 2 = 12.
    The trained role's plan prints it, and its optimizer memory halves (plus the 4 B step per tensor)."""
    assert train_bytes_per_parameter(ParallelConfig(), TINY) == (4.0, 4.0, 8.0)
    assert train_bytes_per_parameter(ParallelConfig(), TINY, "bfloat16") == (4.0, 4.0, 4.0)
    # bf16 mixed precision (FSDP2: the fp32 master is the sharded weight): moments 8 -> 4 B too
    assert train_bytes_per_parameter(ParallelConfig(mixed_precision="bf16"), TINY, "bfloat16")[2] == 4.0
    texts, works = {}, {}
    for dtype in ("float32", "bfloat16"):
        cfg = load_config("sft", [f"actor.optim.state_dtype={dtype}"])  # the tiny preset, as a user sets it
        assert print_plan(cfg) == 0
        texts[dtype] = capsys.readouterr().out
        (works[dtype],) = role_works(cfg)
    assert "4 B weights + 4 B grads + 8 B optimizer = 16 B (optim.state_dtype=float32" in texts["float32"]
    assert "4 B weights + 4 B grads + 4 B optimizer = 12 B (optim.state_dtype=bfloat16" in texts["bfloat16"]
    assert works["bfloat16"].optim_state_dtype == "bfloat16"
    lay = Layout(tp=1, pp=1, dp=1, micro_batch_size=1)
    a, b = (estimate_layout(cfg.model, works[d], lay, cfg.cluster).memory for d in ("float32", "bfloat16"))
    assert (a.weights, a.grads) == (b.weights, b.grads)
    assert a.optimizer - b.optimizer == 4 * role_num_parameters(cfg.model, "lm")  # 4 B per parameter


def measured_activation_bytes(recompute: str, batch: int, seq: int) -> int:
    """Bytes of the distinct non-parameter storages autograd saves for backward (fwd + loss)."""
    model = build_model(TINY)
    apply_recompute(model, recompute)
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in param_ptrs:
            seen[st.data_ptr()] = st.nbytes()
        return t

    ids = torch.randint(0, TINY.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
    return sum(seen.values())


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_estimate_within_20_percent_of_saved_tensors(recompute):
    batch, seq = 2, 48
    measured = measured_activation_bytes(recompute, batch, seq)
    est = estimate_layout(
        TINY, tiny_work(seq, batch), Layout(tp=1, pp=1, dp=1, micro_batch_size=batch, recompute=recompute), ClusterConfig()
    )
    assert abs(est.memory.activations - measured) <= 0.2 * measured, (est.memory.activations, measured)


def test_activation_formula_orders_and_splits():
    m, e, s = ModelConfig(**LLAMA2["70b"], max_seq_len=4096), 2, 2048
    f = lambda tp, sp, rc: layer_activation_bytes_per_token(m, "bf16", tp, sp, rc, s)  # noqa: E731
    assert f(1, False, "none") > f(1, False, "selective") > f(1, False, "full")
    # SP divides everything TP leaves replicated, so TP+SP is exactly the unsharded layer over t
    # for the selective mode (no replicated mask term): Korthikanti Table 2, rows 3 vs 1.
    assert f(8, True, "selective") == pytest.approx(f(1, False, "selective") / 8)
    assert f(8, False, "none") > f(8, True, "none")
    assert f(8, True, "full") == pytest.approx(e * m.hidden_size / 8)


@pytest.mark.parametrize("size,expected", [("7b", 6.74e9), ("13b", 13.0e9), ("70b", 68.98e9)])
def test_llama2_parameter_counts(size, expected):
    assert role_num_parameters(ModelConfig(**LLAMA2[size]), "lm") == pytest.approx(expected, rel=0.002)


def test_kv_cache_bytes_70b():
    m = ModelConfig(**LLAMA2["70b"])
    # 2 (k, v) * 80 layers * 8 kv heads * 128 * 2 B = 327,680 B per token; tp=8 keeps 1 head per device
    assert kv_cache_bytes(m, 2, 1, 1, 1, 1) == 327680
    assert kv_cache_bytes(m, 2, 8, 2, 4, 100) == 327680 / 8 / 2 * 4 * 100


def test_70b_on_one_node_is_rejected_with_smallest_cluster():
    cfg = llama2_cfg("70b", nodes=1)
    with pytest.raises(PlanError) as err:
        make_plan(cfg)
    nodes, gpus = smallest_cluster(cfg)
    assert nodes > 1 and gpus == 8
    assert f"{nodes} nodes x 8 GPUs" in str(err.value)
    assert "GiB/GPU > 80 GiB" in str(err.value)
    make_plan(dataclasses.replace(cfg, cluster=ClusterConfig(num_nodes=nodes, gpus_per_node=8, gpu_mem_gb=80)))
    assert print_plan(cfg) == 1


def test_tp_not_dividing_heads_is_rejected_with_reason():
    cfg = llama2_cfg("70b", nodes=16)
    work = RoleWork(role="ref", kind="lm", mode="forward", parallel=cfg.ref.parallel, batch=128, batch_field="samples", seq_len=2048)
    r = evaluate_layout(cfg.model, work, Layout(tp=3, pp=1, dp=1, micro_batch_size=1), cfg.cluster)
    assert isinstance(r, Rejected) and r.reason == "num_heads=64 not divisible by tp=3"
    r = evaluate_layout(cfg.model, work, Layout(tp=16, pp=1, dp=1, micro_batch_size=1), cfg.cluster)
    assert isinstance(r, Rejected) and r.reason.startswith("tp=16 exceeds gpus_per_node=8")
    r = evaluate_layout(cfg.model, work, Layout(tp=1, pp=1, dp=1, micro_batch_size=1), cfg.cluster)
    assert isinstance(r, Rejected) and r.reason.startswith("needs ") and r.reason.endswith("GiB/GPU > 80 GiB")
    assert r.estimate.memory.weights == pytest.approx(2 * 68.98e9, rel=1e-3)  # 68.98e9 params * 2 B


def test_ranking_prefers_less_recomputation_when_memory_allows():
    cfg = llama2_cfg("7b", nodes=2, stage="sft")
    work = RoleWork(role="actor", kind="lm", mode="train", parallel=cfg.actor.parallel, batch=128, batch_field="b", seq_len=2048)
    plan = plan_role(cfg.model, work, 16, cfg.cluster)
    assert plan.ranked and plan.best.layout.recompute == "none"
    times = [e.time.total_s for e in plan.ranked]
    assert times == sorted(times)
    base = dataclasses.replace(plan.best.layout, vpp=1)  # the best pipeline layout may come interleaved
    same = [e for e in plan.ranked if e.layout.vpp == 1 and dataclasses.replace(e.layout, recompute="none") == base]
    assert [e.layout.recompute for e in same] == ["none", "selective", "full"]
    # when memory does not allow it, the same layout is rejected without recomputation only
    lay = Layout(tp=8, pp=1, dp=2, micro_batch_size=4, sp=True)
    sel = dataclasses.replace(lay, recompute="selective")
    none_gb, sel_gb = (estimate_layout(cfg.model, work, x, cfg.cluster).memory.total / GIB for x in (lay, sel))
    assert sel_gb < none_gb
    tight = dataclasses.replace(cfg.cluster, gpu_mem_gb=(none_gb + sel_gb) / 2)
    assert isinstance(evaluate_layout(cfg.model, work, lay, tight), Rejected)
    assert isinstance(evaluate_layout(cfg.model, work, sel, tight), LayoutEstimate)


def test_70b_plan_on_16_nodes_splits_nodes_and_prints_every_role(capsys):
    cfg = llama2_cfg("70b", nodes=16)
    plan = make_plan(cfg)
    assert set(plan.roles) == {"actor", "rollout", "critic", "reward", "ref"}
    ns = plan.node_split
    assert ns.actor_nodes + ns.critic_nodes == 16 and ns.actor_nodes >= 1 and ns.critic_nodes >= 1
    feasible = [t for _, t in ns.tried if isinstance(t, float)]
    assert ns.step_time_s == min(feasible)
    for rp in plan.roles.values():
        for est in rp.ranked:
            assert est.layout.devices == rp.devices and est.memory.total <= 80 * GIB
    assert plan.roles["rollout"].best.memory.kv_cache > 0
    assert print_plan(cfg) == 0
    out = capsys.readouterr().out
    for word in (
        "node split",
        "actor (training",
        "rollout (rollout engine",
        "critic (training",
        "reward (inference",
        "ref (inference",
        "rejected",
    ):
        assert word in out
    assert out.strip() == format_plan(plan).strip()


def test_check_fits_names_the_role_and_what_it_lacks():
    cfg = llama2_cfg("13b", nodes=2, stage="sft")
    with pytest.raises(PlanError) as err:
        check_fits(cfg)  # tp = pp = dp = 1 with 13B under fp32-master Adam: about 210 GB
    assert "actor: tp=1 pp=1 dp=1" in str(err.value) and "GiB/GPU > 80 GiB" in str(err.value)
    assert "the planner suggests" in str(err.value)
    good = dataclasses.replace(
        cfg,
        actor=TrainableRoleConfig(
            parallel=ParallelConfig(tp_size=8, pp_size=2, sequence_parallel=True, recompute="selective", mixed_precision="bf16")
        ),
    )
    fits = check_fits(good)
    assert isinstance(fits["actor"], LayoutEstimate) and fits["actor"].memory.total < 80 * GIB


def test_default_cpu_config_plans_and_fits():
    cfg = AlignerConfig(stage="plan")
    plan = make_plan(cfg)
    assert plan.placement == "colocated" and plan.node_split is None
    assert set(check_fits(cfg)) == set(plan.roles)


def test_command_line_plan_for_70b_preset(capsys):
    from aligner.plan import main

    assert main(["conf=llama2_70b", "cluster.num_nodes=16", "cluster.gpus_per_node=8", "cluster.gpu_mem_gb=80"]) == 0
    out = capsys.readouterr().out
    assert "16 nodes x 8 GPUs x 80 GiB" in out and "node split: actor group" in out
    assert main(["conf=llama2_70b", "cluster.num_nodes=1", "cluster.gpus_per_node=8", "cluster.gpu_mem_gb=80"]) == 1
    err = capsys.readouterr().err
    assert "the smallest cluster that fits is" in err and "cluster.num_nodes=" in err


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "ppo"])
def test_plan_only_needs_no_files(stage, capsys, tmp_path, monkeypatch):
    """`python -m aligner.<stage> conf=llama2_7b plan_only=true` prints the plan and exits 0 where
    the preset's tokenizer, data and weights are absent (a login node planning a cluster run);
    SFT/RM/DPO checked their paths first and stopped on the tokenizer."""
    import importlib

    monkeypatch.chdir(tmp_path)
    main = importlib.import_module(f"aligner.{stage}").main
    assert main(["conf=llama2_7b", "plan_only=true", f"output_dir={tmp_path / 'out'}"]) == 0
    out = capsys.readouterr().out
    assert f"plan for stage {stage}" in out and "overrides for the best layouts" in out
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize("kind", ["lm", "score"])
def test_lora_weights_grads_optimizer_bytes_exact(kind):
    """With LoRA the planner's weights (frozen base + adapters), grads and optimizer bytes equal the
    storages of the LoRA runtime's tensors: grads and Adam state only for the adapters (and the
    scalar head of a score model)."""
    from aligner.nn.lora import apply_lora

    targets = ("q_proj", "v_proj", "o_proj", "down_proj")
    model = build_model(TINY, kind=kind)
    apply_lora(model, 4, 8.0, 0.0, targets, trainable=("score.weight",))
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = build_adamw(trained, OptimConfig())
    ids = torch.randint(0, TINY.vocab_size, (2, 16))
    model(ids).float().pow(2).mean().backward()
    opt.step()
    params = list(model.parameters())
    work = dataclasses.replace(tiny_work(16, 2, kind), lora_rank=4, lora_targets=targets)
    est = estimate_layout(TINY, work, Layout(tp=1, pp=1, dp=1, micro_batch_size=2), ClusterConfig())
    assert est.memory.weights == storage_bytes(params)
    assert est.memory.grads == storage_bytes(p.grad for p in params if p.grad is not None) == 4 * sum(p.numel() for p in trained)
    assert est.memory.optimizer == storage_bytes(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    full = estimate_layout(TINY, tiny_work(16, 2, kind), Layout(tp=1, pp=1, dp=1, micro_batch_size=2), ClusterConfig())
    assert est.memory.grads < full.memory.grads / 10


# ---- MoE -------------------------------------------------------------------------------------
def _mixtral_like(**kw):
    from aligner.config import ModelConfig

    base = dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        max_seq_len=4096,
        num_experts=8,
        num_experts_per_tok=2,
    )
    base.update(kw)
    return ModelConfig(**base)


def test_moe_total_and_active_parameters_and_expert_memory_per_ep():
    """Mixtral 8x7B's published sizes (46.7B total, 12.9B active per token, Jiang et al. 2024) from
    its dimensions; each ep rank holds E / ep of the experts."""
    from aligner.planner import expert_layer_parameters, pp_stage_num_parameters, role_active_parameters, role_num_parameters

    m = _mixtral_like()
    assert role_num_parameters(m, "lm") / 1e9 == pytest.approx(46.7, abs=0.1)
    assert role_active_parameters(m, "lm") / 1e9 == pytest.approx(12.9, abs=0.1)
    experts = m.num_layers * expert_layer_parameters(m)
    one = pp_stage_num_parameters(m, "lm", tp=1, pp=1, pp_stage=0, ep=1)
    for ep in (2, 4, 8):
        assert one - pp_stage_num_parameters(m, "lm", tp=1, pp=1, pp_stage=0, ep=ep) == experts - experts // ep


def test_moe_layouts_ranked_with_all_to_all_time():
    """An MoE actor: every ep dividing dp and num_experts is a candidate, ep > 1 layouts carry
    all-to-all time and less memory per device; ep not dividing num_experts is rejected."""
    from aligner.config import ClusterConfig
    from aligner.planner import Layout, a2a_elements_per_layer, candidate_layouts, evaluate_layout, plan_role, role_works

    m = _mixtral_like(num_layers=4)
    work = next(w for w in role_works(load_config("sft", ["conf=tiny"])) if w.role == "actor")
    cluster = ClusterConfig(num_nodes=1, gpus_per_node=8, gpu_mem_gb=80)
    eps = {lay.ep for lay in candidate_layouts(m, work, 8) if lay.dp == 8}
    assert eps == {1, 2, 4, 8}
    one = evaluate_layout(m, work, Layout(tp=1, pp=1, dp=8, micro_batch_size=1, ep=1), cluster)
    four = evaluate_layout(m, work, Layout(tp=1, pp=1, dp=8, micro_batch_size=1, ep=4), cluster)
    assert one.time.a2a_s == 0 and four.time.a2a_s > 0
    assert four.memory.weights < one.memory.weights
    bad = evaluate_layout(_mixtral_like(num_experts=6), work, Layout(tp=1, pp=1, dp=8, micro_batch_size=1, ep=4), cluster)
    assert "ep=4" in bad.reason
    assert a2a_elements_per_layer(m, 10) == 10 * 2 * 4096
    plan = plan_role(m, work, 8, cluster)
    assert plan.ranked and any(e.layout.ep > 1 for e in plan.ranked)


def test_dpo_plan_counts_the_reference_weights_and_both_sequences_of_a_pair():
    from aligner.planner import DTYPE_BYTES, pp_stage_num_parameters

    sft, dpo = llama2_cfg("7b", nodes=2, stage="sft"), llama2_cfg("7b", nodes=2, stage="dpo")
    (s,), (d,) = role_works(sft), role_works(dpo)
    assert (d.role, d.batch, d.forward_seqs, d.frozen_copies) == ("actor", 2 * s.batch, 2 * s.batch, 1)
    lay = Layout(tp=8, pp=1, dp=2, micro_batch_size=1, sp=True, recompute="selective")
    es, ed = (estimate_layout(sft.model, w, lay, sft.cluster) for w in (s, d))
    params = pp_stage_num_parameters(sft.model, "lm", 8, 1, 0)
    # FSDP2 (the default dp backend) shards the reference over dp as it shards the policy
    assert ed.memory.weights - es.memory.weights == pytest.approx(DTYPE_BYTES[sft.model.dtype] * params / 2, rel=1e-6)
    assert ed.memory.grads == es.memory.grads and ed.memory.optimizer == es.memory.optimizer
    # twice the sequences trained, plus the reference's forward over them (a third of a training pass each)
    assert ed.time.compute_s == pytest.approx(2 * es.time.compute_s * (1 + 1 / 3), rel=0.05)
    plan = make_plan(dpo)  # the planner finds a layout that holds the reference too
    assert plan.roles["actor"].ranked and plan.roles["actor"].best.memory.total <= 80 * GIB


# ---- the four memory errors ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rollout_engine_is_sized_at_rollout_dtype(dtype):
    """The engine holds its weights and KV cache in rollout.dtype (aligner.workers.actor casts the
    engine's model to it; the KV caches take the engine's parameter dtype), whatever model.dtype is:
    a float32 engine for the llama2_70b preset (model.dtype bfloat16) is twice its bf16 size."""
    from aligner.planner import DTYPE_BYTES, pp_stage_num_parameters
    from aligner.planner.report import configured_layout
    from aligner.rollout.torch_engine.kv_cache import SlotKVCache

    cfg = load_config("ppo", ["conf=llama2_70b", f"rollout.dtype={dtype}"])
    assert cfg.model.dtype == "bfloat16" and cfg.rollout.dtype == dtype
    work = next(w for w in role_works(cfg) if w.role == "rollout")
    lay = configured_layout(cfg, work)
    m = estimate_layout(cfg.model, work, lay, cfg.cluster).memory
    e = DTYPE_BYTES[dtype]
    assert m.weights == e * pp_stage_num_parameters(cfg.model, "lm", lay.tp, lay.pp, 0)
    seq = cfg.data.max_prompt_len + work.new_tokens
    assert m.kv_cache == kv_cache_bytes(cfg.model, e, lay.tp, lay.pp, lay.micro_batch_size, seq)
    # what the runtime allocates: the engine model cast to rollout.dtype, its slot pool in that dtype
    model = build_model(TINY).to(getattr(torch, dtype))
    tiny = dataclasses.replace(work, seq_len=8, new_tokens=8, batch=2, max_batch_size=2)
    t = estimate_layout(TINY, tiny, Layout(tp=1, pp=1, dp=1, micro_batch_size=2), ClusterConfig(gpus_per_node=0)).memory
    assert t.weights == storage_bytes(model.parameters())
    pool = SlotKVCache(
        list(range(TINY.num_layers)), 2, TINY.num_kv_heads, 16, TINY.resolved_head_dim, next(model.parameters()).dtype, "cpu"
    )
    assert t.kv_cache == storage_bytes([*pool.k.values(), *pool.v.values()])


# GPT-3 530B of Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU
# Clusters Using Megatron-LM", Table 1): 105 layers, hidden 20480, 128 heads, seq 2048, vocab 51200,
# global batch 2240 on 560 A100s (80 GB). As a Llama layer: MHA, SwiGLU width i with 3hi = 8h^2
# (GPT's 4h GeLU MLP), so a layer keeps GPT's 12h^2 parameters.
GPT_530B = ModelConfig(
    vocab_size=51200,
    hidden_size=20480,
    intermediate_size=54616,
    num_layers=105,
    num_heads=128,
    num_kv_heads=128,
    max_seq_len=2048,
    dtype="float32",
)


def _zero3_530b(pc: ParallelConfig):
    """ZeRO-3 without model parallelism on 70 nodes x 8 A100s: dp=560, 4 sequences per rank (the
    paper's micro-batch 4 for ZeRO-3), full recomputation (Megatron's setting in the paper)."""
    work = RoleWork(role="actor", kind="lm", mode="train", parallel=pc, batch=2240, batch_field="b", seq_len=2048)
    cluster = ClusterConfig(num_nodes=70, gpus_per_node=8, gpu_mem_gb=80)
    return work, cluster, Layout(tp=1, pp=1, dp=560, micro_batch_size=4, recompute="full")


def test_zero3_fsdp2_counts_gathered_layers_and_their_gradients_530b_does_not_fit():
    """FSDP2 (fully_shard per decoder layer, aligner.parallel.data_parallel.apply_fsdp2) all-gathers a
    layer in bf16 and prefetches the next, and in backward holds the layer's unsharded bf16 gradient
    and its fp32 reduce-scatter input (reduce_dtype=float32): GPT 530B dp-only on 560 80 GB A100s
    does not fit (out of memory in Narayanan et al. 2021; the planner called it 55 GB)."""
    from aligner.planner import layer_num_parameters

    pc = ParallelConfig(mixed_precision="bf16")
    work, cluster, lay = _zero3_530b(pc)
    layer = layer_num_parameters(GPT_530B)
    assert layer == pytest.approx(12 * 20480**2, rel=1e-4)
    r = evaluate_layout(GPT_530B, work, lay, cluster)
    assert isinstance(r, Rejected) and "GiB/GPU > 80 GiB" in r.reason, r
    m = r.estimate.memory
    p = GPT_530B.num_parameters()
    assert m.weights == pytest.approx(4 * p / 560 + 2 * 2 * layer, rel=1e-6)  # fp32 shard + two bf16 layers
    assert m.grads == pytest.approx(4 * p / 560 + (2 + 4) * layer, rel=1e-6)  # fp32 shard + bf16 grads + fp32 RS input


def test_zero3_deepspeed_counts_its_gathered_parameters_and_gradient_bucket():
    """DeepSpeed ZeRO-3 gathers each submodule's parameters as it runs and prefetches the next ones
    (stage3_prefetch_bucket_size 5e7 elements, at least one tensor) while fewer than
    stage3_max_live_parameters (1e9) are live; in backward a submodule's full bf16 gradient is copied
    into the reduce bucket (reduce_bucket_size 5e8 elements). DeepSpeed 0.19 defaults,
    deepspeed/runtime/zero/config.py and partitioned_param_coordinator.py."""
    pc = ParallelConfig(mixed_precision="bf16", dp_backend="deepspeed", zero_stage=3)
    work, cluster, lay = _zero3_530b(pc)
    m = estimate_layout(GPT_530B, work, lay, cluster).memory
    p = GPT_530B.num_parameters()
    w = 20480 * 54616  # the largest weight (gate/up/down): 1.12e9 elements > max_live, so no prefetch
    assert m.weights == pytest.approx((2 + 4) * p / 560 + 2 * w, rel=1e-6)
    assert m.grads == pytest.approx(2 * p / 560 + 2 * w + 2 * 5e8, rel=1e-6)
    # Llama 2 70B: its largest weight (embedding / lm_head, 2.6e8 elements) leaves room for a prefetch
    m70 = ModelConfig(**LLAMA2["70b"], max_seq_len=4096)
    w70 = 32000 * 8192
    d = estimate_layout(m70, dataclasses.replace(work, batch=64), Layout(tp=1, pp=1, dp=64, micro_batch_size=1, recompute="full"), cluster)
    assert d.memory.weights == pytest.approx((2 + 4) * m70.num_parameters() / 64 + 2 * 2 * w70, rel=1e-6)


def test_autocast_weight_casts_are_held_once_per_step_trainable_or_frozen():
    """What the dp=1 bf16 path (fp32 parameters under torch.autocast, one autocast context around a
    pipeline step) really keeps: autocast caches the bf16 cast of a trainable fp32 leaf weight, so
    micro-batches in flight share one copy; a frozen (LoRA base) weight autocast casts again at
    every call, each micro-batch saving its own copy, unless the step runs inside
    :func:`aligner.nn.layers.frozen_weight_casts` (TrainRuntime.forward_backward does), which makes
    each frozen cast once and shares it."""
    from aligner.nn.layers import frozen_weight_casts
    from aligner.nn.lora import apply_lora

    def saved_casts(lora: bool, micro_batches: int, shared: bool = True) -> int:
        model = build_model(TINY)
        if lora:
            apply_lora(model, 4, 8.0, 0.0, ("q_proj", "v_proj"))
        weights = {n: p for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2 and ".lora." not in n}
        shapes = {tuple(sorted(p.shape)) for p in weights.values()}  # autograd saves W or its transpose
        seen = {}

        def pack(t):
            if t.dtype == torch.bfloat16 and tuple(sorted(t.shape)) in shapes:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        outs = []
        with frozen_weight_casts(shared), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                for _ in range(micro_batches):
                    outs.append(model(torch.randint(0, TINY.vocab_size, (1, 8))))
        return sum(seen.values()), 2 * sum(p.numel() for p in weights.values())

    one, casts = saved_casts(False, 1)
    assert saved_casts(False, 3)[0] == one == casts  # trainable: one cached copy for all micro-batches
    # frozen: one shared copy of every base weight whose input needs a gradient (all but the first
    # layer's q, k, v: their input, the frozen embedding's normed output, needs none); autocast alone
    # saves one per micro-batch
    h, kv = TINY.hidden_size, TINY.num_kv_heads * TINY.resolved_head_dim
    frozen = casts - 2 * (h * h + 2 * kv * h)
    assert saved_casts(True, 3)[0] == saved_casts(True, 1)[0] == frozen
    assert saved_casts(True, 3, shared=False)[0] == 3 * frozen
    # the planner counts the same: a stage holds its layers' casts once, however many micro-batches
    # 1F1B keeps in flight, for full fine-tuning and LoRA alike; LoRA under full recomputation (the
    # runtime does not share the frozen casts there) only the recomputed layer's
    from aligner.planner import layer_num_parameters, train_activation_bytes

    m70 = ModelConfig(**LLAMA2["70b"], max_seq_len=4096)
    lay = Layout(tp=4, pp=16, dp=1, micro_batch_size=1, sp=True)
    full = train_activation_bytes(m70, "lm", lay, 2, 2048, 64, 0, "autocast")
    assert train_activation_bytes(m70, "lm", lay, 2, 2048, 64, 0, "autocast", frozen_base=True) == full
    layer_casts = 2 * (layer_num_parameters(m70) - 2 * m70.hidden_size) / 4  # bf16 linear weights / tp
    lay = dataclasses.replace(lay, recompute="full")
    full = train_activation_bytes(m70, "lm", lay, 2, 2048, 64, 0, "autocast")
    lora = train_activation_bytes(m70, "lm", lay, 2, 2048, 64, 0, "autocast", frozen_base=True)
    assert full - lora == pytest.approx(4 * layer_casts, rel=1e-6)  # 5 layers on stage 0, one recomputed at a time


def _llama2_70b_lora(recompute: str) -> AlignerConfig:
    """SFT of Llama 2 70B with LoRA r=16 on q, v (PEFT's default targets) on one 8 x 80 GB node:
    TP2 PP4, dp 1, bf16 mixed precision (fp32 parameters under torch.autocast)."""
    cfg = llama2_cfg("70b", nodes=1, stage="sft")
    pc = ParallelConfig(tp_size=2, pp_size=4, sequence_parallel=True, recompute=recompute, mixed_precision="bf16")
    actor = TrainableRoleConfig(parallel=pc)
    actor.lora.rank = 16
    return dataclasses.replace(cfg, actor=actor)


def test_llama2_70b_lora_tp2_pp4_fits_one_node_with_its_frozen_casts_shared():
    """Llama 2 70B LoRA TP2 PP4 on one 8-GPU node. Without recomputation stage 0 needs about 78.6 GiB:
    the frozen base stays fp32 (32.4 GiB) and the 4 micro-batches 1F1B keeps in flight share one bf16
    cast of the stage's base weights (16 GiB; TrainRuntime.forward_backward makes each frozen cast once
    per step), so it fits; one copy per micro-batch in flight, as autocast alone keeps, would need
    3 x 16 GiB more and would not. With full recomputation it fits, within 2.5x of Megatron's count for
    the same layout (bf16 base weights, 2 B per parameter, plus Korthikanti et al. 2022's 2sbh/t bytes
    per layer for full recomputation with SP, 4 micro-batches in flight): the factor is the fp32 base
    aligner keeps."""
    from aligner.planner import layer_num_parameters, pp_stage_num_parameters

    s, b, h, t, layers, in_flight = 2048, 1, 8192, 2, 20, 4
    none = check_fits(_llama2_70b_lora("none"))["actor"].memory
    stage_casts = layers * 2 * (layer_num_parameters(ModelConfig(**LLAMA2["70b"])) - 2 * h) / t
    assert none.total <= 80 * 2**30 < none.total + (in_flight - 1) * stage_casts, none.total / 2**30
    cfg = _llama2_70b_lora("full")
    est = check_fits(cfg)["actor"]
    m = est.memory
    assert m.total <= 80 * 2**30
    params = pp_stage_num_parameters(cfg.model, "lm", 2, 4, 0)
    megatron = 2 * params + in_flight * layers * 2 * s * b * h / t
    assert megatron < m.total < 2.5 * megatron, (m.total / 2**30, megatron / 2**30)


def test_gpu_mem_gb_is_gibibytes_as_gpus_are_sold():
    """An "80 GB" H100 has 80 GiB = 85.9e9 bytes (torch.cuda reports about 85.0e9 of it): a layout
    needing 82e9 bytes fits cluster.gpu_mem_gb=80, and the planner prints GiB."""
    from aligner.planner import MemoryBreakdown, StepTime, memory_problem

    def needing(nbytes: float) -> LayoutEstimate:
        mem = MemoryBreakdown(weights=nbytes, grads=0.0, optimizer=0.0, activations=0.0, kv_cache=0.0)
        return LayoutEstimate(Layout(tp=1, pp=1, dp=1, micro_batch_size=1), mem, StepTime(0.0, 0.0, 0.0, 0.0))

    cluster = ClusterConfig(gpus_per_node=8, gpu_mem_gb=80)
    assert memory_problem(needing(82e9), cluster) is None
    assert memory_problem(needing(86e9), cluster) == "needs 80.1 GiB/GPU > 80 GiB"


def test_split_rollout_group_gets_its_own_nodes_and_overlaps_the_update_with_staleness(capsys):
    """rollout.placement=split: the engines are planned on rollout.resources.num_nodes
    nodes of their own, as whole replicas (tp = pp = 1), and the other roles on the rest; the step is
    rollout + update when synchronous and max(rollout, update) with trainer.max_staleness >= 1."""
    over = ["rollout.placement=split", "rollout.parallel.tp_size=1", "rollout.resources.num_nodes=2"]
    base = ["conf=llama2_7b", "cluster.num_nodes=4", "cluster.placement=split"]
    plans = {k: make_plan(load_config("ppo", [*base, *over, f"trainer.max_staleness={k}"])) for k in (0, 1)}
    for plan in plans.values():
        rollout = plan.roles["rollout"]
        assert rollout.devices == 2 * 8 and rollout.best.layout.tp == rollout.best.layout.pp == 1
        assert all(est.layout.tp == est.layout.pp == 1 for est in rollout.ranked)
        assert plan.node_split.actor_nodes + plan.node_split.critic_nodes == 2  # the 4 nodes less the rollout group's
    r0 = plans[0].roles
    gen = r0["rollout"].best.time.total_s
    update = max(
        sum(p.best.time.total_s for p in r0.values() if p.work.group == g and p.work.mode != "generate") for g in ("actor", "critic")
    )
    assert plans[0].step_time_s == pytest.approx(gen + update)
    assert plans[1].step_time_s == pytest.approx(max(gen, update))
    text = format_plan(plans[1])
    assert "rollout group (rollout.placement=split): 16 devices" in text and "generation overlaps the update" in text
    with pytest.raises(PlanError, match="rollout.resources.num_nodes=4 leaves none of 4 nodes"):
        make_plan(load_config("ppo", [*base, *over[:2], "rollout.resources.num_nodes=4"]))


def _long_work(seq: int, recompute_mp: str = "bf16") -> RoleWork:
    return RoleWork(
        role="actor", kind="lm", mode="train", parallel=ParallelConfig(mixed_precision=recompute_mp), batch=16, batch_field="b", seq_len=seq
    )


def test_cp_splits_the_layer_activations_and_pays_the_kv_exchange():
    """A cp rank holds seq / cp tokens: with the attention core recomputed (which re-gathers K/V and
    saves only local tensors) a layer's activations are exactly 1/cp of one process's; without it
    the gathered whole-sequence K/V are saved (kv heads). The K/V all-gathers and the gradient sum
    over cp are charged as cp communication."""
    m = ModelConfig(**LLAMA2["70b"], max_seq_len=8192, dtype="bfloat16")
    work, cluster = _long_work(8192), ClusterConfig(num_nodes=8, gpus_per_node=8, gpu_mem_gb=80)

    def est(cp, rc):
        return estimate_layout(m, work, Layout(tp=8, pp=4, dp=2 // cp, micro_batch_size=1, sp=True, recompute=rc, cp=cp), cluster)

    from aligner.planner.cost_model import train_activation_bytes

    def act(cp, rc):  # stage 0 of 4, 4 micro-batches in flight
        lay = Layout(tp=8, pp=4, dp=2 // cp, micro_batch_size=1, sp=True, recompute=rc, cp=cp)
        return train_activation_bytes(m, "lm", lay, 2, 8192, 8, 0, "bf16")

    layers = m.num_layers // 4
    per_layer = layer_activation_bytes_per_token(m, "bf16", 8, True, "selective", 8192) * 8192
    assert act(1, "selective") - act(2, "selective") == pytest.approx(4 * layers * per_layer / 2, rel=0.01)
    kv = m.num_kv_heads * m.resolved_head_dim // 8  # the kv heads of a tp rank
    # without recomputation K and V of the whole sequence are saved where the recomputed core keeps the
    # rank's own half: the other half (bf16, per layer and micro-batch in flight) plus the log-sum-exp
    other_half = 4 * layers * 2 * 2 * 4096 * kv
    lse = 4 * layers * 4 * (m.num_heads // 8) * 4096
    assert act(2, "none") - act(2, "selective") == pytest.approx(other_half + lse, rel=0.01)
    one, two = est(1, "selective"), est(2, "selective")
    assert two.time.cp_comm_s > 0 and one.time.cp_comm_s == 0
    assert "cp=2" in two.layout.describe()


def test_planner_uses_cp_where_sequence_memory_requires_it():
    """Llama 2 70B training (FSDP2, 16 sequences a step) on 64 H100s. cp splits the sequence where the
    activations of a whole sequence per rank do not fit without recomputing them; it is not chosen where
    they fit, and not tried under 4096 tokens per cp rank.

    At 8k the best layout is cp = 1 (tp8 dp8 mbs2, no pipeline). Until the DP reduction was overlapped it was
    cp = 2 (NeMo's published Llama 3 70B 8k layout has CP2): FSDP2's gathers and reduce-scatters, charged
    whole, made dp = 1 pipelines best, and cp = 2 halved their bubble's activations. Overlapped with each
    micro-batch's compute, per micro-batch as the runtime gathers and reduce-scatters (its per-layer
    ``fully_shard``), tp8 dp8 runs one micro-batch a rank, keeps only what exceeds its compute and pays no
    bubble and no K/V exchange, and its 8k activations fit (about 66 GiB): cp = 2's best (tp8 cp2 pp4 dp1)
    pays a pipeline bubble. The MFU model is flat over these shapes (MFU_HALF_DIM = 0): it does not
    decide this. At 32k no cp = 1 layout fits without full recomputation, and tp8 cp2 dp4 without any beats
    them all. NeMo's published CP2 layout at 8k stays feasible (the validation table in docs/planner.md).
    cp runs with MoE where the runtime runs it (top-k softmax router, no capacity factor, ep = 1 or ep = dp
    at tp = pp = 1) and is
    refused where it does not (Sinkhorn routing)."""
    cluster = ClusterConfig(num_nodes=8, gpus_per_node=8, gpu_mem_gb=80)

    def plan(seq, **moe):
        m = ModelConfig(**{**LLAMA2["70b"], **moe}, max_seq_len=seq, dtype="bfloat16")
        return plan_role(m, _long_work(seq), 64, cluster)

    at8k = plan(8192)
    assert at8k.best.layout.cp == 1 and at8k.best.layout.recompute == "none" and at8k.best.layout.pp == 1
    assert any(r.layout.cp == 2 for r in at8k.ranked), "cp = 2 is tried at 8k (4096 tokens per rank) and fits"
    at32k = plan(32768)
    assert all(r.layout.recompute == "full" for r in at32k.ranked if r.layout.cp == 1)
    assert at32k.best.layout.cp == 2 and at32k.best.layout.recompute == "none"
    assert all(r.layout.cp == 1 for r in plan(4096).ranked), "not under 4096 tokens per cp rank"
    from aligner.planner import candidate_layouts

    def moe_layouts(**router):
        m = ModelConfig(**LLAMA2["70b"], num_experts=8, num_experts_per_tok=2, max_seq_len=8192, dtype="bfloat16", **router)
        return list(candidate_layouts(m, _long_work(8192), 64))

    topk = moe_layouts()
    assert any(x.cp == 2 for x in topk) and all(x.ep == 1 for x in topk if x.cp > 1), "at 64 GPUs dp = 32 > 8 experts: ep = 1"
    small = ModelConfig(**LLAMA2["70b"], num_experts=8, num_experts_per_tok=2, max_seq_len=8192, dtype="bfloat16")
    on16 = [x for x in candidate_layouts(small, _long_work(8192), 16) if x.cp > 1 and x.ep > 1]
    assert on16 and all(x.ep == x.dp and x.tp == 1 and x.pp == 1 for x in on16), "cp x ep only as the runtime runs it"
    assert any(x.ep > 1 for x in topk)
    assert all(x.cp == 1 for x in moe_layouts(moe_router="sinkhorn")), "the runtime refuses cp with Sinkhorn routing"
    assert all(x.cp == 1 for x in moe_layouts(moe_capacity_factor=1.25)), "and with a capacity factor"


def test_interleaved_schedule_halves_the_bubble_for_more_activations_and_messages():
    """v = 2 chunks per rank at pp = 4: the bubble term halves ((p - 1) / (v m)); stage 0 holds
    1 + (p - 1) / (p v) = 1.375 times plain 1F1B's activations (Narayanan et al. 2021); the extra
    point-to-point messages are charged (v times plain 1F1B's); the planner tries v only where the runtime runs it (ddp or one
    dp rank, m a multiple of pp)."""
    from aligner.planner.cost_model import interleaved_in_flight

    m = ModelConfig(**LLAMA2["7b"], max_seq_len=4096, dtype="bfloat16")
    work = RoleWork(role="actor", kind="lm", mode="train", parallel=ParallelConfig(mixed_precision="bf16", dp_backend="ddp"),
                    batch=16, batch_field="b", seq_len=4096)  # fmt: skip
    cluster = ClusterConfig(num_nodes=1, gpus_per_node=8, gpu_mem_gb=80)

    def est(v):
        return estimate_layout(m, work, Layout(tp=2, pp=4, dp=1, micro_batch_size=1, recompute="full", vpp=v), cluster)

    plain, inter = est(1), est(2)
    assert inter.time.bubble_s == pytest.approx(plain.time.bubble_s / 2)
    # every slot of the schedule ends in one blocking message each way: m + p - 1 slots plain, v m + p - 1
    # interleaved, each [1, 4096, H] bf16 over NVLink (the pipeline inside the node)
    msg = 4096 * m.hidden_size * 2 / (cluster.intra_node_gbps * 1e9)
    assert plain.time.pp_comm_s == pytest.approx(2 * (16 + 3) * msg)
    assert inter.time.pp_comm_s == pytest.approx(2 * (2 * 16 + 3) * msg)
    assert interleaved_in_flight(4, 1, 16, 0) == 4 and interleaved_in_flight(4, 2, 16, 0) == pytest.approx(4 * (1 + 3 / 8))
    assert interleaved_in_flight(4, 2, 16, 3) == pytest.approx(2.5)  # the last stage: (0 + 4 + 1) chunk forwards of half its layers
    assert "vpp=2" in inter.layout.describe()
    # the search offers interleaving as a refinement of its best pipeline layout, never of a layout without stages
    # 13B SFT on 16 GPUs with DDP (no sharded state: the best layout is a pipeline, tp 2 pp 4; 7B's was tp 1 pp 16
    # until the planner charged the LM head to the last stage); 7B on FSDP2, whose reduction the planner overlaps
    # with compute: the best has no stages and nothing interleaves
    cfg = llama2_cfg("7b", nodes=2, stage="sft")
    big = llama2_cfg("13b", nodes=2, stage="sft")
    par = dataclasses.replace(big.actor.parallel, dp_backend="ddp")
    work16 = RoleWork(role="actor", kind="lm", mode="train", parallel=par, batch=128, batch_field="b", seq_len=2048)
    ranked = plan_role(big.model, work16, 16, big.cluster).ranked
    assert ranked[0].layout.pp > 1
    inter = [r.layout for r in ranked if r.layout.vpp > 1]
    assert inter and all(dataclasses.replace(x, vpp=1) in [r.layout for r in ranked] for x in inter)
    assert all(x.pp > 1 for x in inter)
    fsdp = RoleWork(role="actor", kind="lm", mode="train", parallel=cfg.actor.parallel, batch=128, batch_field="b", seq_len=2048)
    best = plan_role(cfg.model, fsdp, 16, cfg.cluster).ranked
    assert best[0].layout.pp == 1 and not any(r.layout.vpp > 1 for r in best), "no stages: nothing to interleave"


def test_uneven_stages_and_idle_nodes_rather_than_no_plan():
    """Llama 2 70B PPO on 3 colocated nodes: the planner used to refuse it ("mini_batch_size=128 not
    divisible by dp=24"; the smallest cluster that fits: 2 nodes). Pipelines of unequal stages (80
    layers on pp = 3: 27, 27, 26, paced by the deepest) now use all 24 GPUs: tp4 pp6 dp1 (14, 14, 13, 13, 13,
    13 layers) since FSDP2's gathers and reduce-scatters are charged per micro-batch, as the runtime runs them
    (tp2 pp3 dp4 before: 32 micro-batches, each re-gathering 11.5e9 parameters over the network, is no longer
    the fastest); the assertion is on what this test is about, an uneven split of all 24. Where no layout uses every
    device at all (the tiny model on 7 CPU nodes: 7 is prime, above its 4 heads and 4 layers, and 64
    samples do not split 7 ways), the trained roles leave a node idle, the colocated engine (in the
    actor's processes) gets the actor's devices, and the overrides name the nodes to ask for."""
    from aligner.planner import recommended_overrides

    plan = make_plan(load_config("plan", ["conf=llama2_70b", "cluster.num_nodes=3", "cluster.placement=colocated"]))
    actor = plan.roles["actor"]
    assert actor.devices == 24 and actor.idle == 0 and 80 % actor.best.layout.pp != 0
    plan = make_plan(load_config("plan", ["conf=tiny", "cluster.num_nodes=7", "cluster.placement=colocated"]))
    actor = plan.roles["actor"]
    assert actor.best is not None and actor.devices == 6 and actor.idle == 1
    assert plan.roles["rollout"].devices == actor.devices and plan.roles["ref"].idle == 0
    assert any("actor.resources.num_nodes=6" in o for o in recommended_overrides(plan))
    assert "1 more of its group idle" in format_plan(plan)


def test_unequal_stages_are_paced_by_the_deepest():
    """pp = 3 over 80 layers (27, 27, 26) is paced by its busiest rank: the first (27 layers) or the last (26 and
    the LM head, which is not recomputed), against pp = 4's last (20 and the head); per token a layer costs
    (6 P + 12 h s) x 4/3 under full recomputation, the head 6 h V (PaLM's count)."""
    m = ModelConfig(**LLAMA2["70b"], max_seq_len=4096, dtype="bfloat16")
    work = RoleWork(
        role="actor", kind="lm", mode="train", parallel=ParallelConfig(mixed_precision="bf16"), batch=16, batch_field="b", seq_len=2048
    )
    cluster = ClusterConfig(num_nodes=3, gpus_per_node=8, gpu_mem_gb=80)
    three = estimate_layout(m, work, Layout(tp=8, pp=3, dp=1, micro_batch_size=1, recompute="full"), cluster)
    four = estimate_layout(m, work, Layout(tp=8, pp=4, dp=1, micro_batch_size=1, recompute="full"), cluster)
    from aligner.planner import layer_num_parameters

    layer = (6 * layer_num_parameters(m) + 12 * m.hidden_size * 2048) * 4 / 3
    head = 6 * m.hidden_size * m.vocab_size
    total = 80 * layer + head
    pace3, pace4 = max(27 * layer, 26 * layer + head) * 3 / total, max(20 * layer, 20 * layer + head) * 4 / total
    # compute per device: FLOPs / devices, times the busiest rank's share of them
    assert three.time.compute_s / four.time.compute_s == pytest.approx((4 / 3) * pace3 / pace4)
    assert pace3 == pytest.approx(27 * layer * 3 / total) and pace4 > 1  # pp 3: the 27 layers; pp 4: 20 and the head


def test_a_hang_timeout_shorter_than_a_planned_phase_is_refused_before_ray(capsys, tmp_path, monkeypatch):
    """trainer.hang_timeout_s below the planner's estimate of one phase (bad input): one line
    naming the field, the role, the estimate and the fix, exit 2, before Ray or any file; the default
    (1800 s) and 0 (off) pass the check and stop later, at the preset's missing paths."""
    from aligner.ppo import main

    monkeypatch.chdir(tmp_path)
    args = ["conf=llama2_70b", "cluster.num_nodes=16", "cluster.gpus_per_node=8", f"output_dir={tmp_path / 'out'}"]
    assert main([*args, "trainer.hang_timeout_s=1"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("aligner ppo: error: trainer.hang_timeout_s=1 is shorter than the planner's estimate of one ") and (
        "or 0 to turn the watchdog off" in line
    ), line
    secs = float(line.split("phase (")[1].split(" s ")[0])
    assert secs > 1
    for ok in ("1800", "0"):
        assert main([*args, f"trainer.hang_timeout_s={ok}"]) == 2  # the preset's checkpoint paths are absent here
        assert "hang_timeout_s" not in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_interleaving_is_searched_on_fsdp2_with_data_parallel_ranks():
    """The interleaved schedule runs on FSDP2 with dp > 1 (tests/parallel/test_fsdp_reduce_per_step.py runs it with
    fsdp_reduce=step), so the search offers it there too: 2 and 4 chunks where the layers and micro-batches divide;
    DeepSpeed with dp > 1 (the whole stage in one engine) and pp = 1 get only plain schedules."""
    from aligner.planner.search import _vpp_sizes

    cfg = llama2_cfg("7b", nodes=2, stage="sft")  # 32 layers
    work = RoleWork(role="actor", kind="lm", mode="train", parallel=cfg.actor.parallel, batch=128, batch_field="b", seq_len=2048)
    assert cfg.actor.parallel.dp_backend == "fsdp2"
    assert _vpp_sizes(cfg.model, work, pp=4, dp=2, mbs=1) == [1, 2, 4]  # 64 micro-batches a rank, a multiple of 4
    assert _vpp_sizes(cfg.model, work, pp=4, dp=2, mbs=32) == [1]  # 2 micro-batches: not a multiple of pp
    assert _vpp_sizes(cfg.model, work, pp=1, dp=16, mbs=1) == [1]
    ds = dataclasses.replace(work, parallel=dataclasses.replace(cfg.actor.parallel, dp_backend="deepspeed"))
    assert _vpp_sizes(cfg.model, ds, pp=4, dp=2, mbs=1) == [1]
    assert _vpp_sizes(cfg.model, ds, pp=4, dp=1, mbs=1) == [1, 2, 4]
