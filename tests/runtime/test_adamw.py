"""bf16 Adam moments (optim.state_dtype=bfloat16, aligner.runtime.adamw) against torch's AdamW.

- state_dtype=float32 keeps torch.optim.AdamW (the path unchanged); MixedPrecisionAdamW with fp32
  state equals torch's AdamW within 1e-6 over several steps, chunked tensors included;
- bf16 moments: parameters stay fp32, moments are bf16, and every step equals torch's AdamW whose
  moments are rounded to bf16 after each step (the claimed semantics), within 1e-6; one step from
  zero state equals torch's AdamW's parameters and its moments rounded to bf16;
- checkpoints: save/load round trip of a bf16-moment runtime resumes like the uninterrupted run,
  fp32 <-> bf16 moments load into each other (cast), FSDP2 dp=2 and tp=2 (GQA rows replicated over
  tp) save and reshard bf16 moments;
- the tiny SFT stage (built-in task, through Ray): 40 steps with bf16 moments, the loss at every
  logged step within 1% (relative) of the fp32-moment run.
"""

from __future__ import annotations

import pytest
import torch

from aligner.config import ConfigError, OptimConfig, ParallelConfig
from aligner.nn.vocab import shifted_log_probs
from aligner.parallel.dims import ParallelDims
from aligner.runtime.adamw import MixedPrecisionAdamW, build_adamw, state_bytes_per_parameter
from aligner.runtime.train_runtime import TrainRuntime
from tests.toolkit.models import tiny_model_config
from tests.toolkit.spawn import run_distributed
from tests.toolkit.training import batches

OPTIM = dict(lr=1e-2, warmup_steps=1, grad_clip=0.05, weight_decay=0.01)
KW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in ((37, 23), (50,), (9, 4, 5))]


def set_grads(groups: list[list[torch.Tensor]], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(groups[0]):
        grad = torch.randn(p.shape, generator=g) * (0.1 if i else 1e-3)  # one tensor with tiny grads
        for params in groups:
            params[i].grad = grad.clone()


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(a, b))


# ---- the update ------------------------------------------------------------------------------
def test_float32_state_keeps_torch_adamw():
    params = [p.requires_grad_() for p in tensors()]
    opt = build_adamw(params, OptimConfig())
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["fused"]
    eng = TrainRuntime(tiny_model_config(), "lm", ParallelConfig(), OptimConfig(), ParallelDims(), total_steps=2)
    assert type(eng.optimizer) is torch.optim.AdamW
    eng = TrainRuntime(tiny_model_config(), "lm", ParallelConfig(), OptimConfig(state_dtype="bfloat16"), ParallelDims(), total_steps=2)
    assert type(eng.optimizer) is MixedPrecisionAdamW and eng.optimizer.state_dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="optim.state_dtype='bfloat16' is invalid: DeepSpeed builds its own fp32 Adam state"):
        TrainRuntime(
            tiny_model_config(), "lm", ParallelConfig(dp_backend="deepspeed"), OptimConfig(state_dtype="bfloat16"), ParallelDims(), 2
        )


@pytest.mark.parametrize("chunk", [None, 100])  # the default (whole tensors here); 100-element pieces
def test_fp32_state_matches_torch_adamw(chunk):
    ref, mine = [p.requires_grad_() for p in tensors()], [p.requires_grad_() for p in tensors()]
    a = torch.optim.AdamW(ref, **KW)
    b = MixedPrecisionAdamW(mine, **KW, state_dtype=torch.float32, chunk_numel=chunk)
    for step in range(6):
        set_grads([ref, mine], step)
        a.step()
        b.step()
        assert max_diff(ref, mine) < 1e-6, step
    for p, q in zip(ref, mine):
        assert float(b.state[q]["step"]) == float(a.state[p]["step"]) == 6
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(b.state[q][key], a.state[p][key], rtol=1e-6, atol=1e-9)


def test_bf16_moments_one_step_equals_torch_adamw():
    ref, mine = [p.requires_grad_() for p in tensors()], [p.requires_grad_() for p in tensors()]
    a = torch.optim.AdamW(ref, **KW)
    b = MixedPrecisionAdamW(mine, **KW)
    set_grads([ref, mine], 0)
    a.step()
    b.step()
    # the update uses the fp32 moments before they are rounded for storage
    torch.testing.assert_close([p.detach() for p in mine], [p.detach() for p in ref], rtol=1e-6, atol=1e-7)
    for p, q in zip(ref, mine):
        assert q.dtype == torch.float32
        for key in ("exp_avg", "exp_avg_sq"):
            got, want = b.state[q][key], a.state[p][key]
            assert got.dtype == torch.bfloat16
            # torch's fp32 moment rounded to bf16: within half a bf16 ulp (2^-9 relative), not fp32-exact
            torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=0)
            assert not torch.equal(got.float(), want)


@pytest.mark.parametrize("chunk", [None, 64])
def test_bf16_moments_equal_adamw_with_rounded_moments(chunk):
    """Several steps: torch's AdamW with its fp32 moments rounded to bf16 after every step is the
    reference of the claimed semantics (compute in fp32, store rounded to nearest)."""
    ref, mine = [p.requires_grad_() for p in tensors()], [p.requires_grad_() for p in tensors()]
    plain = [p.requires_grad_() for p in tensors()]
    # fused: the kernel MixedPrecisionAdamW runs, so a moment near a bf16 rounding boundary rounds alike
    a, b = torch.optim.AdamW(ref, **KW, fused=True), MixedPrecisionAdamW(mine, **KW, chunk_numel=chunk)
    c = torch.optim.AdamW(plain, **KW, fused=True)
    for step in range(8):
        set_grads([ref, mine, plain], step)
        a.step()
        b.step()
        c.step()
        for st in a.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                st[key].copy_(st[key].bfloat16())
        assert max_diff(ref, mine) < 1e-6, step
    assert max_diff(plain, mine) > 1e-6, "bf16 rounding must show against fp32 moments"


def test_state_dict_roundtrip_keeps_bf16_and_converts_fp32():
    params = [p.requires_grad_() for p in tensors()]
    b = MixedPrecisionAdamW(params, **KW)
    set_grads([params], 0)
    b.step()
    fresh = MixedPrecisionAdamW(params, **KW)
    fresh.load_state_dict(b.state_dict())  # torch casts floating state to the parameter's dtype; cast back
    for p in params:
        assert fresh.state[p]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(fresh.state[p]["exp_avg_sq"], b.state[p]["exp_avg_sq"])
    fp32 = torch.optim.AdamW(params, **KW)
    fp32.step()
    fresh.load_state_dict(fp32.state_dict())
    for p in params:
        assert fresh.state[p]["exp_avg"].dtype == torch.bfloat16 and float(fresh.state[p]["step"]) == 1


def test_refuses_non_fp32_parameters():
    with pytest.raises(ValueError, match="keeps fp32 master weights; got a torch.bfloat16 parameter"):
        MixedPrecisionAdamW([torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)])


def test_measured_state_bytes_per_parameter():
    """fp32 moments: 8 B per parameter element; bf16: 4 B (plus a 4 B step per tensor here)."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        params = [p.requires_grad_() for p in tensors()]
        opt = build_adamw(params, OptimConfig(state_dtype=dtype))
        set_grads([params], 0)
        opt.step()
        out[dtype] = state_bytes_per_parameter(opt) - 4 * len(params) / sum(p.numel() for p in params)
    assert out == {"float32": 8.0, "bfloat16": 4.0}


# ---- in a TrainRuntime: checkpoints -----------------------------------------------------------
def run(engine: TrainRuntime, data: list[torch.Tensor]) -> list[float]:
    """Train on this dp rank's slice of each batch; the dp-mean loss per step."""
    from aligner.parallel.tensor_parallel import vocab_start

    d = engine.dims
    start = vocab_start(engine.module) if d.is_last_pp_stage else 0
    losses = []
    for ids in data:
        mb = {"input_ids": ids.chunk(d.dp_size)[d.dp_rank]}
        loss = engine.forward_backward([mb], lambda out, m: -shifted_log_probs(out, m["input_ids"], d.tp_group, start).mean()).mean()
        engine.step()
        engine.zero_grad()
        if d.dp_group is not None:
            torch.distributed.all_reduce(loss, group=d.dp_group)
            loss /= d.dp_size
        losses.append(float(loss))
    return losses


def engine(state_dtype: str, dims: ParallelDims | None = None, parallel: ParallelConfig | None = None, seed: int = 0, **model):
    optim = OptimConfig(**OPTIM, state_dtype=state_dtype)
    return TrainRuntime(tiny_model_config(**model), "lm", parallel or ParallelConfig(), optim, dims or ParallelDims(), 10, seed=seed)


def moments(eng: TrainRuntime) -> dict[str, torch.Tensor]:
    return {f"{n}.{k}": eng.optimizer.state[p][k] for n, p in eng.module.named_parameters() for k in ("exp_avg", "exp_avg_sq")}


def test_checkpoint_roundtrip_and_cross_dtype_loads(tmp_path):
    from aligner.runtime.checkpoint import read_meta

    data = batches(4)
    a = engine("bfloat16")
    run(a, data[:2])
    a.save(str(tmp_path / "bf16"))
    assert read_meta(str(tmp_path / "bf16"))["optim_state_dtype"] == "bfloat16"
    b = engine("bfloat16", seed=1)
    b.load(str(tmp_path / "bf16"))
    for k, t in moments(a).items():
        assert moments(b)[k].dtype == torch.bfloat16 and torch.equal(moments(b)[k], t), k  # a copy, no arithmetic
    assert run(b, data[2:]) == pytest.approx(run(a, data[2:]), abs=1e-7)  # resume == uninterrupted

    f = engine("float32")
    run(f, data[:2])
    f.save(str(tmp_path / "fp32"))
    g = engine("bfloat16", seed=1)
    g.load(str(tmp_path / "fp32"))  # fp32 moments -> bf16: rounded to nearest
    for k, t in moments(f).items():
        assert moments(g)[k].dtype == torch.bfloat16 and torch.equal(moments(g)[k], t.bfloat16()), k
    cont_f, cont_g = run(f, data[2:]), run(g, data[2:])
    assert cont_g == pytest.approx(cont_f, rel=1e-3)

    h = engine("float32", seed=1)
    h.load(str(tmp_path / "bf16"))  # bf16 moments -> fp32: exact
    c = engine("bfloat16", seed=2)
    c.load(str(tmp_path / "bf16"))  # the saved bf16 moments, for reference (b has trained on since)
    for k, t in moments(c).items():
        assert moments(h)[k].dtype == torch.float32 and torch.equal(moments(h)[k], t.float()), k


def save_fsdp2_then_tp2(rank: int, world: int, root: str) -> dict:
    """dp=2 FSDP2 with bf16 moments: 3 steps, save; tp=2 (1 kv head: GQA rows replicated over tp)
    loads it, trains 2 steps and saves again."""
    data = batches(5)

    def dims(tp: int, dp: int) -> ParallelDims:
        return ParallelDims(tp_size=tp, dp_size=dp, world_size=world, rank=rank).build()

    fsdp = engine("bfloat16", dims(1, 2), ParallelConfig(dp_size=2), num_kv_heads=1)
    first = run(fsdp, data[:3])
    st = fsdp.optimizer.state[next(fsdp.module.parameters())]
    kinds = (type(st["exp_avg"]).__name__, str(st["exp_avg"].dtype), str(next(fsdp.module.parameters()).dtype))
    fsdp.save(f"{root}/fsdp2")
    tp = engine("bfloat16", dims(2, 1), ParallelConfig(tp_size=2), seed=3, num_kv_heads=1)
    tp.load(f"{root}/fsdp2")
    second = run(tp, data[3:])
    tp.save(f"{root}/tp2")
    return {"first": first, "second": second, "kinds": kinds}


@pytest.mark.distributed
def test_fsdp2_and_tp2_reshard_bf16_moments(tmp_path):
    ref = engine("bfloat16", num_kv_heads=1)
    want = run(ref, batches(5))
    got = run_distributed(save_fsdp2_then_tp2, world_size=2, args=(str(tmp_path),), timeout_s=600)
    assert got[0]["kinds"] == ("DTensor", "torch.bfloat16", "torch.float32")
    # different reduction orders can flip a bf16 rounding: layouts agree to 1e-5 (measured 5e-7), not bitwise
    assert got[0]["first"] + got[0]["second"] == pytest.approx(want, abs=1e-5)
    one = engine("bfloat16", seed=5, num_kv_heads=1)
    one.load(str(tmp_path / "tp2"))
    for k, t in moments(ref).items():
        assert moments(one)[k].dtype == torch.bfloat16, k
        torch.testing.assert_close(moments(one)[k].float(), t.float(), rtol=2**-6, atol=1e-7)


# ---- the tiny SFT stage ------------------------------------------------------------------------
def saved_moment_dtypes(run_dir) -> set[str]:
    """dtypes of the Adam moments in the run's last checkpoint (meta.json and the dcp metadata)."""
    import json

    import torch.distributed.checkpoint as dcp

    metas = sorted(run_dir.rglob("meta.json"))
    assert metas, f"no checkpoint under {run_dir}"
    meta = json.loads(metas[-1].read_text())
    saved = dcp.FileSystemReader(str(metas[-1].parent)).read_metadata().state_dict_metadata
    dtypes = {str(m.properties.dtype).removeprefix("torch.") for k, m in saved.items() if k.endswith(".exp_avg")}
    return dtypes | {meta["optim_state_dtype"]}


@pytest.mark.slow
@pytest.mark.e2e
def test_tiny_sft_loss_curve_within_1_percent_of_fp32_moments(ray_cluster, tmp_path, monkeypatch):
    """40 SFT steps on the built-in task through Ray (tiny preset, lr 1e-3): the criterion is
    max over the 40 logged steps of |loss_bf16 - loss_fp32| / loss_fp32 <= 0.01.

    lr 1e-3, not the preset's 3e-3: at 3e-3 the loss spikes after warmup and the run is chaotic
    there: fp32 moments with lr x 1.001 already move some step's loss by 6.4% (bf16 moments: 6.8%).
    At 1e-3 (measured on the 2-core dev CPU): bf16 moments 0.035% max, fp32 with lr x 1.001 0.63%.
    """
    from aligner.cli import load_config
    from aligner.tracking import read_metrics
    from aligner.trainers.sft import SFTTrainer

    monkeypatch.chdir(tmp_path)
    common = ["trainer.progress=false", "trainer.max_steps=40", "trainer.eval_every=0", "trainer.save_every=0"]
    common += ["task.num_sft=2560", "task.num_eval=32", "trainer.eval_batch_size=32", "actor.optim.lr=1e-3"]
    common += ["actor.optim.warmup_steps=5"]  # 40 steps: the preset's 250 warm-up steps would leave the lr near 0
    curves = {}
    for dtype in ("float32", "bfloat16"):  # on the session's Ray instance (tests.toolkit.ray)
        out = tmp_path / dtype
        assert SFTTrainer(load_config("sft", common + [f"output_dir={out}", f"actor.optim.state_dtype={dtype}"])).run() == 0
        curves[dtype] = {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}
        assert saved_moment_dtypes(out) == {dtype}, "the workers must have trained with the configured moments"
    fp32, bf16 = curves["float32"], curves["bfloat16"]
    assert sorted(fp32) == sorted(bf16) == list(range(1, 41))
    assert fp32[40] < 0.5 * fp32[1], "the run must learn for the comparison to mean anything"
    worst = max(abs(bf16[s] - fp32[s]) / fp32[s] for s in fp32)
    assert worst <= 0.01, worst
