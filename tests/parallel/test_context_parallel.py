"""Context parallelism (aligner.parallel.context_parallel) against the single-process model.

Layout helpers are checked in-process; the CP runs spawn gloo ranks: cp=2, cp=4 and tp=2 x cp=2.
Each case runs the tiny GQA Llama (4 query heads over 2 kv heads) in fp32 under CP and as one
process from the same seed, and compares the per-token log-probs (plain head and the chunked
log-prob head, gathered across cp), the token-mean loss, EVERY parameter's gradient after the
cp (and tp) gradient sums, and every parameter after 3 AdamW steps, all within 1e-5. Batches:
ragged right padding with a length that needs padding to 2 * cp, packed documents
(segment_ids), shared-prompt rows; recomputation none / selective / full. Also: a later token
never changes an earlier log-prob, each layer exchanges only the kv heads (one all-gather of
2 B kvh S hd elements), a local mask is refused.
"""

from __future__ import annotations

import pytest
import torch

from aligner.parallel.context_parallel import (
    check_cp_length,
    pad_to_cp,
    padded_len,
    rank_major_order,
    shift_labels,
    split_shifted,
    zigzag_index,
)
from tests.toolkit.assertions import assert_layout_matches, max_abs_diff
from tests.toolkit.models import tiny_model_config
from tests.toolkit.spawn import run_distributed

B, S0 = 3, 13  # 13 tokens: padded to 16 for cp=2 (multiple of 4) and cp=4 (multiple of 8)


# ---- layout helpers (one process) ----------------------------------------------------------------
def test_zigzag_index_balances_chunks():
    # S=16, cp=2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # every position once over the ranks, and equal causal work: sum of (position + 1) per rank
    for cp in (2, 4):
        order = rank_major_order(16, cp)
        assert sorted(order.tolist()) == list(range(16))
        work = {(zigzag_index(16, cp, r) + 1).sum().item() for r in range(cp)}
        assert len(work) == 1, work


def test_lengths_padding_and_label_shift():
    assert [padded_len(n, 2) for n in (1, 4, 5, 13)] == [4, 4, 8, 16]
    with pytest.raises(ValueError, match="sequence length 13 is not a multiple of 2 \\* cp_size = 4; pad it to 16"):
        check_cp_length(13, 2)
    x = torch.arange(6).view(1, 6)
    assert pad_to_cp(x, 2, value=-1).tolist() == [[0, 1, 2, 3, 4, 5, -1, -1]]
    # labels shifted before the split: position t holds token t + 1, the last is the pad id
    assert shift_labels(x, pad_id=9).tolist() == [[1, 2, 3, 4, 5, 9]]
    # a shifted per-token tensor [B, S0 - 1] is padded to S (here S0 = 6: one rank) and split like the ids
    assert split_shifted(torch.ones(1, 5), None).tolist() == [[1, 1, 1, 1, 1, 0]]


# ---- spawned runs --------------------------------------------------------------------------------
def _make_batch(cfg, kind: str, seed: int = 3) -> dict:
    """input_ids [B, S0], the model kwargs of the single-process reference, and the loss inputs
    (mask, advantages, old_log_probs: [B, S0 - 1], position t scores token t + 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, cfg.vocab_size, (B, S0), generator=g)
    mask = torch.ones(B, S0 - 1)
    ref_kw, cp_kw = {}, {}
    if kind == "ragged":  # right padding: rows of 13, 9 and 5 tokens
        for row, n in enumerate((13, 9, 5)):
            ids[row, n:] = 0
            mask[row, n - 1 :] = 0
    elif kind == "packed":  # two or three documents per row, then padding (segment 0)
        seg = torch.tensor([[1] * 6 + [2] * 7, [1] * 4 + [2] * 4 + [3] * 3 + [0] * 2, [1] * 9 + [0] * 4])
        ref_kw = cp_kw = {"segment_ids": seg}
        mask = (seg[:, 1:] == seg[:, :-1]).float() * (seg[:, 1:] > 0).float()
    elif kind == "shared prompt":  # a 4-token prompt, samples of 4 and 3 tokens, padding (-1)
        seg = torch.tensor([[0] * 4 + [1] * 4 + [2] * 3 + [-1] * 2] * B)
        pos = torch.tensor([list(range(8)) + list(range(4, 7)) + [7, 8]] * B)
        ref_kw = cp_kw = {"prompt_segments": seg, "position_ids": pos}
        mask = (seg[:, 1:] > 0).float() * (seg[:, 1:] == seg[:, :-1]).float()
    return {
        "input_ids": ids,
        "ref_kw": ref_kw,
        "cp_kw": cp_kw,
        "mask": mask,
        "advantages": torch.randn(B, S0 - 1, generator=g),
        "old_log_probs": -torch.rand(B, S0 - 1, generator=g) * 3 - 1,
    }


def _per_token_loss(lp, batch_adv, batch_old):
    return -batch_adv * torch.exp(lp - batch_old)


def _swap_grads(model):
    for p in model.parameters():
        p.data, p.grad = p.grad, p.data


def run_cp_case(dims, cp_group, cfg, kind: str, recompute: str = "none", steps: int = 3) -> dict[str, float]:
    """One CP layout against the single-process model: {check: max abs error}."""
    from aligner.model.llama import build_model
    from aligner.nn.chunked import LogProbSpec
    from aligner.nn.vocab import vocab_parallel_log_probs
    from aligner.parallel.context_parallel import cp_inputs, cp_token_mean, split_shifted, sync_cp_grads, zigzag_gather
    from aligner.parallel.parallelize import build_parallel_model
    from aligner.parallel.sharding import gather_full_state_dict
    from aligner.parallel.tensor_parallel import sync_tp_grads, vocab_start

    ref = build_model(cfg, "lm", seed=11)
    model = build_parallel_model(cfg, "lm", dims, recompute=recompute, seed=11, cp_group=cp_group)
    tp_group, vstart = dims.tp_group, vocab_start(model)
    batch = _make_batch(cfg, kind)
    ids = batch["input_ids"]
    inp = cp_inputs(ids, cp_group, **batch["cp_kw"])
    local = {k: split_shifted(batch[k], cp_group) for k in ("mask", "advantages", "old_log_probs")}
    n = S0 - 1
    errs: dict[str, float] = {}

    def ref_loss_and_lp():
        lp = vocab_parallel_log_probs(ref(ids, **batch["ref_kw"])[:, :-1], ids[:, 1:])
        per = _per_token_loss(lp, batch["advantages"], batch["old_log_probs"])
        return (per * batch["mask"]).sum() / batch["mask"].sum(), lp

    def cp_loss_and_lp():
        logits = model(inp["input_ids"], **inp["model"])
        lp = vocab_parallel_log_probs(logits, inp["labels"], tp_group, vstart)
        per = _per_token_loss(lp, local["advantages"], local["old_log_probs"])
        return cp_token_mean(per, local["mask"], cp_group), lp

    with torch.no_grad():
        _, ref_lp = ref_loss_and_lp()
        _, lp = cp_loss_and_lp()
        errs["log_probs (gathered over cp)"] = float((zigzag_gather(lp, cp_group)[:, :n] - ref_lp).abs().max())
        chunked, _ = model(inp["input_ids"], labels=inp["labels"], logprob=LogProbSpec(chunk_size=3), **inp["model"])
        errs["chunked-head log_probs"] = float((zigzag_gather(chunked, cp_group)[:, :n] - ref_lp).abs().max())

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, eps=1e-6)
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        ref_loss, _ = ref_loss_and_lp()
        ref_loss.backward()
        loss, _ = cp_loss_and_lp()
        loss.backward()
        sync_tp_grads(model, tp_group)
        sync_cp_grads(model, cp_group)
        if step == 0:
            errs["token-mean loss"] = float((loss.detach() - ref_loss.detach()).abs())
            _swap_grads(model)
            grads = gather_full_state_dict(model, tp_group)
            _swap_grads(model)
            ref_grads = {k: p.grad for k, p in ref.named_parameters()}
            errs["grads (every parameter)"] = max_abs_diff(grads, ref_grads)
            errs["every parameter has a grad"] = float(len(set(ref_grads) - set(grads)))
        opt.step()
        ref_opt.step()
    errs[f"params after {steps} AdamW steps"] = max_abs_diff(gather_full_state_dict(model, tp_group), dict(ref.state_dict()))
    return errs


CASES = {
    # name: (model overrides, batch kind, recompute)
    "ragged right padding": ({}, "ragged", "none"),
    "packed documents, selective recompute": ({}, "packed", "selective"),
    "shared prompt, full recompute": ({}, "shared prompt", "full"),
    "kv=1, qkv bias, tied embeddings": (dict(num_kv_heads=1, attention_bias=True, tie_word_embeddings=True), "ragged", "none"),
}


def _groups(tp: int):
    """(dims, cp_group) of this rank: tp groups of consecutive ranks, cp groups across them."""
    import torch.distributed as dist

    from aligner.parallel.dims import ParallelDims

    world, rank = dist.get_world_size(), dist.get_rank()
    cp = world // tp
    tp_groups = [dist.new_group(list(range(i * tp, (i + 1) * tp))) for i in range(cp)] if tp > 1 else [None] * cp
    cp_groups = [dist.new_group(list(range(j, world, tp))) for j in range(tp)]
    dims = ParallelDims(tp_size=tp, world_size=tp, rank=rank % tp)
    dims.tp_group = tp_groups[rank // tp]
    return dims, cp_groups[rank % tp]


def cp_battery(rank: int, world_size: int, tp: int, cases: list[str], extra: bool) -> dict:
    """Every case of `cases` on a tp x (world / tp) cp layout, plus (extra) the causal, comm and refusal checks."""
    torch.manual_seed(0)
    dims, cp_group = _groups(tp)
    out = {"cases": {}}
    for name in cases:
        overrides, kind, recompute = CASES[name]
        out["cases"][name] = run_cp_case(dims, cp_group, tiny_model_config(**overrides), kind, recompute)
    if extra:
        out.update(_extra_checks(dims, cp_group))
    return out


def _extra_checks(dims, cp_group) -> dict:
    """Causality across chunks, the zigzag round trip, the K/V exchange volume, a local mask refused."""
    from aligner.nn.comm import counting, group_size
    from aligner.nn.vocab import vocab_parallel_log_probs
    from aligner.parallel.context_parallel import cp_inputs, zigzag_gather, zigzag_split
    from aligner.parallel.parallelize import build_parallel_model

    cfg = tiny_model_config()
    model = build_parallel_model(cfg, "lm", dims, seed=11, cp_group=cp_group)
    ids = torch.randint(1, cfg.vocab_size, (B, S0), generator=torch.Generator().manual_seed(5))

    def gathered_lp(x):
        inp = cp_inputs(x, cp_group)
        with torch.no_grad():
            return zigzag_gather(vocab_parallel_log_probs(model(inp["input_ids"], **inp["model"]), inp["labels"]), cp_group)[:, : S0 - 1]

    out = {}
    p = 7  # perturb token 7: log-probs at t < 6 (tokens <= t) must not move, t >= 6 must
    changed = ids.clone()
    changed[:, p] = (changed[:, p] + 1) % cfg.vocab_size
    a, b = gathered_lp(ids), gathered_lp(changed)
    out["earlier log-probs moved"] = float((a[:, : p - 1] - b[:, : p - 1]).abs().max())
    out["later log-probs moved"] = float((a[:, p - 1 :] - b[:, p - 1 :]).abs().max())

    x = torch.randn(B, 16, 3)
    out["round trip"] = bool(torch.equal(zigzag_gather(zigzag_split(x, cp_group), cp_group), x))

    inp = cp_inputs(ids, cp_group)
    with counting() as c:
        model(inp["input_ids"], **inp["model"])
    out["all_gather"] = (c.calls["all_gather"], c.elements["all_gather"])
    # one all-gather per layer of K and V together, kv heads only: 2 B kvh S hd elements each
    per_layer = 2 * B * cfg.num_kv_heads * inp["seq_len"] * cfg.resolved_head_dim
    out["expected all_gather"] = (cfg.num_layers, cfg.num_layers * per_layer)
    local = torch.ones(1, 1, inp["input_ids"].shape[1], inp["input_ids"].shape[1], dtype=torch.bool)
    try:
        model(inp["input_ids"][:1], position_ids=inp["model"]["position_ids"][:1], attn_mask=local)
    except ValueError as e:
        out["local mask"] = str(e)
    out["cp_size"] = group_size(cp_group)
    return out


def _check(results, layout: str, extra: bool):
    for r in results:
        assert r["cases"], layout
    for name in results[0]["cases"]:
        assert_layout_matches([r["cases"][name] for r in results], f"{layout}, {name}")
    if not extra:
        return
    for r in results:
        assert r["earlier log-probs moved"] < 1e-6, r["earlier log-probs moved"]
        assert r["later log-probs moved"] > 1e-3, r["later log-probs moved"]
        assert r["round trip"]
        assert r["all_gather"] == r["expected all_gather"], (r["all_gather"], r["expected all_gather"])
        assert "attn_mask has" in r["local mask"] and "cp_inputs" in r["local mask"], r.get("local mask")


@pytest.mark.distributed
def test_cp2_matches_one_process():
    results = run_distributed(cp_battery, world_size=2, args=(1, list(CASES), True))
    assert [r["cp_size"] for r in results] == [2, 2]
    _check(results, "cp=2", extra=True)


@pytest.mark.distributed
def test_cp4_matches_one_process():
    results = run_distributed(cp_battery, world_size=4, args=(1, ["ragged right padding", "packed documents, selective recompute"], True))
    assert [r["cp_size"] for r in results] == [4] * 4
    _check(results, "cp=4", extra=True)


@pytest.mark.distributed
def test_tp2_cp2_matches_one_process():
    results = run_distributed(cp_battery, world_size=4, args=(2, ["ragged right padding", "kv=1, qkv bias, tied embeddings"], False))
    _check(results, "tp=2 x cp=2", extra=False)


# ---- config --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "override,fix,more",
    [
        ("actor.parallel.cp_size=0", "must be >= 1", []),
        ("actor.parallel.cp_size=3", "2 * cp_size = 6 divide model.max_seq_len=", []),
        ("critic.parallel.cp_size=2", "runs with dp_backend=fsdp2 or ddp, not deepspeed", ["critic.parallel.dp_backend=deepspeed"]),
        ("actor.parallel.cp_size=2", "set actor.parallel.logprob_chunk_size=-1", ["actor.parallel.logprob_chunk_size=0"]),
        ("rollout.parallel.cp_size=2", "context parallelism is for training", []),
    ],
)
def test_bad_cp_size_is_one_config_error(override, fix, more, tmp_path, monkeypatch):
    from aligner.cli import load_config
    from aligner.config import ConfigError

    monkeypatch.chdir(tmp_path)  # the presets' relative *.init paths must not find checkpoints of the checkout
    with pytest.raises(ConfigError) as e:
        load_config("ppo", [override, *more])
    msg = str(e.value)
    field, value = override.split("=")
    assert "\n" not in msg and f"{field}={value}" in msg and fix in msg, msg


def test_cp_size_defaults_to_one():
    from aligner.config import ParallelConfig

    assert ParallelConfig().cp_size == 1


def test_recompute_keeps_an_instance_core_inside_and_restores_it():
    """apply_recompute wraps a `core` set on the instance before it (the CP attention) and restores it
    on switching back, instead of dropping it for the class's single-process core."""
    from aligner.model.llama import build_model
    from aligner.parallel.parallelize import apply_recompute

    model = build_model(tiny_model_config(), seed=0)
    attn = model.model.layers["0"].self_attn
    calls = []

    def cp_core(q, k, v, mask):
        calls.append(q.shape)
        return type(attn).core(attn, q, k, v, mask)

    attn.__dict__["core"] = cp_core
    apply_recompute(model, "selective")
    assert attn.core is not cp_core
    model(torch.randint(0, 64, (1, 5))).sum().backward()
    assert len(calls) == 2  # forward, then the recomputation in backward
    apply_recompute(model, "none")
    assert attn.core is cp_core
