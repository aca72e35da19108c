"""LoRA (aligner.nn.lora) against PEFT 0.21 on the same base weights and the same A / B.

Our adapted model must give PEFT's ``LoraModel`` logits on HF's LlamaForCausalLM (same base weights,
A and B copied in), our exported adapter must load with ``PeftModel.from_pretrained`` and give the same
logits, our merged export must equal PEFT's ``merge_and_unload``; the base stays bitwise frozen while
AdamW trains only the adapters, and checkpoints hold only the adapters. The tp=2 runs are in
tests/parallel/test_lora_tp.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from aligner.config import LoraConfig, OptimConfig, ParallelConfig
from aligner.model.hf import save_hf
from aligner.model.llama import build_model
from aligner.nn import lora
from tests.toolkit.models import tiny_model_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CFG = tiny_model_config(intermediate_size=48, init_std=0.2)


def _adapted(rank=4, alpha=8.0, targets=TARGETS, seed=3):
    """Our model with adapters whose B is random (B = 0 at init would hide the adapter)."""
    model = build_model(CFG, seed=1)
    lora.apply_lora(model, rank, alpha, 0.0, targets, seed=seed)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for ad in lora.adapters(model):
            ad.B.copy_(torch.randn(ad.B.shape, generator=g) * 0.3)
    return model.eval()


def _ids():
    return torch.randint(0, CFG.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))


def _full_sd(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _hf_base(tmp_path, model):
    base = {k: v for k, v in _full_sd(model).items() if not lora.is_adapter_key(k)}
    return save_hf(base, CFG, tmp_path / "base")


def _peft_model(hf_dir, model, rank, alpha, targets):
    peft = pytest.importorskip("peft", reason="PEFT is the reference LoRA implementation")
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets))
    sd = _full_sd(model)
    with torch.no_grad():
        for name, mod in pm.named_modules():
            if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
                ours = name.removeprefix("base_model.model.")
                mod.lora_A["default"].weight.copy_(sd[f"{ours}.lora.A"])
                mod.lora_B["default"].weight.copy_(sd[f"{ours}.lora.B"])
    return pm.eval()


def test_forward_equals_peft_lora_model(tmp_path):
    model = _adapted()
    hf_dir = _hf_base(tmp_path, model)
    pm = _peft_model(hf_dir, model, 4, 8.0, TARGETS)
    with torch.no_grad():
        ours, theirs = model(_ids()), pm(input_ids=_ids()).logits
        with lora.disable_adapters(model):
            base = model(_ids())
    assert (ours - base).abs().max() > 1e-2, "the adapters must change the logits"
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    with torch.no_grad(), pm.disable_adapter():
        torch.testing.assert_close(base, pm(input_ids=_ids()).logits, atol=1e-6, rtol=0)


def test_exported_adapter_loads_in_peft_and_merge_equals_merge_and_unload(tmp_path):
    peft = pytest.importorskip("peft", reason="PEFT is the reference LoRA implementation")
    from transformers import LlamaForCausalLM

    model = _adapted(rank=3, alpha=5.0, targets=["q_proj", "v_proj", "down_proj"])
    hf_dir = _hf_base(tmp_path, model)
    sd = _full_sd(model)
    cfg = lora.peft_adapter_config(3, 5.0, 0.0, ["q_proj", "v_proj", "down_proj"], str(hf_dir))
    out = lora.save_peft_adapter(sd, str(tmp_path / "adapter"), cfg)
    # our key names are the ones PEFT itself writes
    ref = peft.get_peft_model(
        LlamaForCausalLM.from_pretrained(hf_dir), peft.LoraConfig(r=3, lora_alpha=5.0, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    ref.save_pretrained(tmp_path / "peft_saved")
    from safetensors.torch import load_file

    assert set(load_file(tmp_path / "peft_saved" / "adapter_model.safetensors")) == set(load_file(f"{out}/adapter_model.safetensors"))
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["peft_type"] == "LORA"

    loaded = peft.PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32), out).eval()
    with torch.no_grad():
        ours = model(_ids())
        torch.testing.assert_close(loaded(input_ids=_ids()).logits, ours, atol=1e-6, rtol=0)
        merged_peft = loaded.merge_and_unload().state_dict()
    merged = lora.merged_state_dict(sd, 5.0 / 3)
    assert set(merged) == set(merged_peft)
    for k, v in merged.items():
        torch.testing.assert_close(v, merged_peft[k], atol=1e-6, rtol=0, msg=k)
    # in-place merge of the local weights: same logits with the adapter term folded in, unmerge restores
    w0 = model.model.layers["0"].self_attn.q_proj.weight.detach().clone()
    lora.merge_adapters(model)
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()), ours, atol=1e-5, rtol=0)
    torch.testing.assert_close(model.model.layers["0"].self_attn.q_proj.weight, merged["model.layers.0.self_attn.q_proj.weight"])
    lora.unmerge_adapters(model)
    torch.testing.assert_close(model.model.layers["0"].self_attn.q_proj.weight, w0, atol=1e-7, rtol=0)


def test_init_matches_peft_scheme_and_freezes_base():
    model = build_model(CFG, seed=1)
    names = lora.apply_lora(model, 8, 16.0, 0.0, ["q_proj", "down_proj"], seed=0)
    assert names == [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "mlp.down_proj")]
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"{n}.lora.{x}" for n in names for x in "AB")
    for ad in lora.adapters(model):
        assert ad.scaling == 2.0 and torch.count_nonzero(ad.B) == 0  # PEFT: alpha / r, B = 0
        bound = 1 / ad.in_features**0.5  # kaiming_uniform_(a=sqrt(5)) on [r, in]
        assert ad.A.abs().max() <= bound and ad.A.abs().max() > 0.8 * bound
    with pytest.raises(ValueError, match="rank"):
        lora.apply_lora(build_model(CFG, seed=1), 0, 1.0, 0.0, ["q_proj"])


def test_runtime_trains_only_adapters_and_checkpoints_only_them(tmp_path):
    from aligner.parallel.dims import ParallelDims
    from aligner.runtime.train_runtime import TrainRuntime

    def runtime(rank=4):
        return TrainRuntime(
            CFG,
            "lm",
            ParallelConfig(dp_backend="ddp"),
            OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant"),
            ParallelDims(device_type="cpu"),
            10,
            seed=1,
            lora=LoraConfig(rank=rank, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"]),
        )

    rt = runtime()
    base = {n: p.detach().clone() for n, p in rt.module.named_parameters() if not p.requires_grad}
    opt_params = {id(p) for g in rt.optimizer.param_groups for p in g["params"]}
    assert opt_params == {id(p) for n, p in rt.module.named_parameters() if lora.is_adapter_key(n)}
    ids = _ids()
    for _ in range(3):
        logits = rt(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, CFG.vocab_size), ids[:, 1:].reshape(-1))
        rt.backward(loss)
        rt.step()
        rt.zero_grad()
    for n, p in rt.module.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), f"frozen {n} changed"
    assert all(torch.count_nonzero(ad.B) > 0 for ad in lora.adapters(rt.module)), "B must train"
    rt.save(str(tmp_path / "ckpt"))
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    saved = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    assert saved == {n for n, _ in rt.module.named_parameters() if lora.is_adapter_key(n)}
    fresh = runtime()
    fresh.load(str(tmp_path / "ckpt"))
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids), rt(ids), atol=0, rtol=0)
    with pytest.raises(ValueError, match="same lora settings"):
        runtime(rank=2).load(str(tmp_path / "ckpt"))
    merged = lora.merged_state_dict(rt.full_state_dict(), 2.0)
    assert set(merged) == set(base), "the merged export holds exactly the base model's tensors"


def test_config_validation_one_line_errors():
    from aligner.config import ConfigError

    ok = ParallelConfig()
    LoraConfig(rank=0, target_modules=["nope"]).validate("actor.lora", ok)  # off: nothing else checked
    for bad, field in (
        (LoraConfig(rank=-1), "actor.lora.rank"),
        (LoraConfig(rank=8, alpha=0), "actor.lora.alpha"),
        (LoraConfig(rank=8, dropout=1.0), "actor.lora.dropout"),
        (LoraConfig(rank=8, target_modules=["qkv"]), "actor.lora.target_modules"),
        (LoraConfig(rank=8, target_modules=[]), "actor.lora.target_modules"),
    ):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as e:
            bad.validate("actor.lora", ok)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="dp_backend"):
        LoraConfig(rank=8).validate("actor.lora", ParallelConfig(dp_backend="deepspeed"))


def test_lora_ppo_reference_is_the_actor_without_a_ref_group(tmp_path, monkeypatch):
    from aligner.cli import load_config

    monkeypatch.chdir(tmp_path)
    overrides = ["actor.init=", "critic.init=", "reward.init=", "algorithm.kl_coef=0.1"]
    full = load_config("ppo", overrides)
    assert "ref" in full.roles_used() and not full.ref_from_actor
    cfg = load_config("ppo", [*overrides, "actor.lora.rank=8", "actor.lora.alpha=16", "actor.lora.target_modules=[q_proj,v_proj]"])
    assert cfg.ref_from_actor and "ref" not in cfg.roles_used() and "actor" in cfg.roles_used()
    assert cfg.actor.lora.target_modules == ["q_proj", "v_proj"]
    assert not load_config("sft", ["actor.lora.rank=8"]).ref_from_actor
    from aligner.config import ConfigError

    with pytest.raises(ConfigError, match="ref.init"):
        load_config("ppo", [*overrides, "actor.lora.rank=8", f"ref.init={tmp_path}"])


def test_score_model_adapter_loads_in_peft_as_seq_cls(tmp_path):
    """A reward model / critic exports its adapters with the trained head as PEFT's SEQ_CLS layout
    (``modules_to_save=["score"]``): PEFT on LlamaForSequenceClassification gives our last-token scores."""
    peft = pytest.importorskip("peft", reason="PEFT is the reference LoRA implementation")
    from transformers import LlamaForSequenceClassification

    model = build_model(CFG, kind="score", seed=1)
    base = save_hf(_full_sd(model), CFG, tmp_path / "base", kind="score")  # the head before training
    lora.apply_lora(model, 4, 8.0, 0.0, ["q_proj", "up_proj"], seed=2, trainable=("score.weight",))
    assert {n for n, p in model.named_parameters() if p.requires_grad} >= {"score.weight"}
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=g))
        for ad in lora.adapters(model):
            ad.B.copy_(torch.randn(ad.B.shape, generator=g) * 0.3)
    cfg = lora.peft_adapter_config(4, 8.0, 0.0, ["q_proj", "up_proj"], str(base), kind="score")
    out = lora.save_peft_adapter(_full_sd(model), str(tmp_path / "adapter"), cfg)
    hf = LlamaForSequenceClassification.from_pretrained(base, torch_dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(hf, out).eval()
    ids = _ids()[:1]  # one row: HF picks the last token without a pad id
    with torch.no_grad():
        ours = model.eval()(ids)[:, -1]
        torch.testing.assert_close(loaded(input_ids=ids).logits.squeeze(-1), ours, atol=1e-6, rtol=0)
