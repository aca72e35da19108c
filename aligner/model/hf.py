"""HF checkpoint import and export for the Llama family.

Owns: config.json <-> ModelConfig, reading HF weights from a local directory
(``model.safetensors``, sharded ``model.safetensors.index.json``, or
``pytorch_model.bin`` loaded with ``weights_only=True``), and writing a directory
that ``transformers`` loads as ``LlamaForCausalLM`` (policy) or
``LlamaForSequenceClassification`` with one label (critic / reward model).

Our parameter names equal HF's, so import/export is a copy plus checks; MoE layers are renamed
to and from HF Mixtral's per-expert layout (:func:`moe_to_hf`, :func:`moe_from_hf`). Tied
embeddings are written without ``lm_head.weight`` (HF re-ties on load). Writes go to
a temporary directory that is renamed into place, so a crash never leaves a
half-written export. Nothing is fetched from a hub and no remote code is trusted.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from aligner.config import ModelConfig, RopeScalingConfig
from aligner.errors import CheckpointError
from aligner.model.llama import build_model

ARCH = {"lm": "ForCausalLM", "score": "ForSequenceClassification"}
FAMILY = {"llama": "Llama", "qwen2": "Qwen2", "mixtral": "Mixtral"}
# our MoE expert weights [E, ., .] <-> HF Mixtral's per-expert Linear weights (w1 gate, w3 up, w2 down)
MIXTRAL_EXPERTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
SAFE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def model_config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """ModelConfig from an HF Llama/Qwen2-style config dict. Raises CheckpointError for unsupported fields."""
    model_type = hf.get("model_type", "llama")
    if model_type not in FAMILY:
        raise CheckpointError(f"{source}: model_type {model_type!r} is not supported: valid are {', '.join(FAMILY)}")
    try:
        rope = dict(hf.get("rope_parameters") or {})  # transformers >= 5 keeps theta and scaling here
        rs = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        scaling = None
        if rs:
            rtype = rs.get("rope_type", rs.get("type"))
            if rtype != "llama3":
                raise CheckpointError(f"{source}: rope_scaling type {rtype!r} is not supported (only llama3)")
            scaling = RopeScalingConfig(
                factor=float(rs["factor"]),
                low_freq_factor=float(rs["low_freq_factor"]),
                high_freq_factor=float(rs["high_freq_factor"]),
                original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
            )
        heads = int(hf["num_attention_heads"])
        cfg = ModelConfig(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=None if hf.get("head_dim") in (None, int(hf["hidden_size"]) // heads) else int(hf["head_dim"]),
            max_seq_len=int(hf.get("max_position_embeddings", 4096)),
            rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)) or model_type == "qwen2",
            o_proj_bias=model_type == "llama" and bool(hf.get("attention_bias", False)),
        )
        if model_type == "mixtral":
            cfg.num_experts = int(hf["num_local_experts"])
            cfg.num_experts_per_tok = int(hf.get("num_experts_per_tok", 2))
            cfg.router_aux_loss_coef = float(hf.get("router_aux_loss_coef", 0.001))
            cfg.moe_router = str(hf.get("aligner_moe_router", "topk_softmax"))
    except KeyError as e:
        raise CheckpointError(f"{source}: required field {e.args[0]!r} is missing (is this a Llama-family config.json?)") from None
    cfg.validate("model")
    return cfg


def model_config_to_hf(cfg: ModelConfig, kind: str = "lm") -> dict:
    """HF config.json dict for `cfg`; kind lm -> LlamaForCausalLM, score -> LlamaForSequenceClassification."""
    if kind not in ARCH:
        raise ValueError(f"kind={kind!r}: valid choices are {', '.join(ARCH)}")
    if cfg.num_experts:
        if cfg.attention_bias or cfg.o_proj_bias:
            raise ValueError("model.attention_bias with MoE layers has no HF architecture (Mixtral has no attention bias)")
        model_type = "mixtral"
    elif cfg.attention_bias and not cfg.o_proj_bias:
        model_type = "qwen2"  # q/k/v bias without an o_proj bias is Qwen2's layout
    elif cfg.attention_bias == cfg.o_proj_bias:
        model_type = "llama"
    else:
        raise ValueError("model.o_proj_bias without model.attention_bias has no HF architecture; set both or neither")
    out = {
        "architectures": [FAMILY[model_type] + ARCH[kind]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": False,
        "use_sliding_window": False,
        "hidden_act": "silu",
        "torch_dtype": cfg.dtype,
    }
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
    if cfg.num_experts:
        out.pop("mlp_bias")
        out.pop("use_sliding_window")
        out.update(
            num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            router_aux_loss_coef=cfg.router_aux_loss_coef,
            output_router_logits=False,
            sliding_window=None,
        )
        if cfg.moe_router != "topk_softmax":  # HF Mixtral always routes top-k softmax; kept for our import
            out["aligner_moe_router"] = cfg.moe_router
    if kind == "score":
        out["num_labels"] = 1
        out["pad_token_id"] = 0
    return out


def moe_to_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our MoE names -> HF Mixtral's: ``layers.{i}.mlp.gate.weight`` -> ``layers.{i}.block_sparse_moe.gate.weight``,
    ``layers.{i}.mlp.experts.gate_proj`` [E, I, H] -> ``layers.{i}.block_sparse_moe.experts.{e}.w1.weight`` [I, H]
    (up_proj -> w3, down_proj [E, H, I] -> w2 [H, I]). Other tensors pass unchanged."""
    out = {}
    for k, v in sd.items():
        if ".mlp.gate." in k:
            out[k.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = v
        elif ".mlp.experts." in k:
            prefix, name = k.rsplit(".mlp.experts.", 1)
            for e in range(v.shape[0]):
                out[f"{prefix}.block_sparse_moe.experts.{e}.{MIXTRAL_EXPERTS[name]}.weight"] = v[e]
        else:
            out[k] = v
    return out


def moe_from_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`moe_to_hf` (experts stacked in expert order); also accepts transformers 5's
    in-memory fused names (``mlp.experts.gate_up_proj`` [E, 2I, H] = gate rows then up rows)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    names = {v: k for k, v in MIXTRAL_EXPERTS.items()}
    for k, v in sd.items():
        if ".block_sparse_moe.gate." in k:
            out[k.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = v
        elif ".block_sparse_moe.experts." in k:
            prefix, rest = k.split(".block_sparse_moe.experts.", 1)
            e, w, _ = rest.split(".")
            experts.setdefault(f"{prefix}.mlp.experts.{names[w]}", {})[int(e)] = v
        elif k.endswith(".mlp.experts.gate_up_proj"):
            gate, up = v.chunk(2, dim=1)
            out[k.replace("gate_up_proj", "gate_proj")], out[k.replace("gate_up_proj", "up_proj")] = gate, up
        else:
            out[k] = v
    for k, per in experts.items():
        out[k] = torch.stack([per[e] for e in sorted(per)])
    return out


def read_hf_config(model_dir: str | os.PathLike) -> dict:
    recover_dir(Path(model_dir))
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; an HF model dir needs config.json and safetensors weights")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"{path}: cannot read safetensors ({e}); the file is truncated or corrupted — re-export or re-download it"
        ) from None


def load_hf_state_dict(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of an HF dir: model.safetensors, a sharded index, or pytorch_model.bin (weights_only)."""
    d = Path(model_dir)
    recover_dir(d)
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a directory; give an HF model dir with config.json and *.safetensors")
    if (d / INDEX_NAME).is_file():
        try:
            index = json.loads((d / INDEX_NAME).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{d / INDEX_NAME}: not a valid safetensors index ({e})") from None
        sd: dict[str, torch.Tensor] = {}
        for shard in sorted(set(index.values())):
            if not (d / shard).is_file():
                raise CheckpointError(f"{d / shard}: listed in {INDEX_NAME} but missing")
            sd.update(_load_safetensors(d / shard))
        return sd
    if (d / SAFE_NAME).is_file():
        return _load_safetensors(d / SAFE_NAME)
    if (d / "pytorch_model.bin").is_file():
        try:
            return torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
            raise CheckpointError(f"{d / 'pytorch_model.bin'}: cannot load with weights_only=True ({e})") from None
    raise CheckpointError(f"{d}: no model.safetensors, {INDEX_NAME} or pytorch_model.bin found")


def to_model_state_dict(hf_sd: dict[str, torch.Tensor], model: torch.nn.Module, source: str) -> dict[str, torch.Tensor]:
    """Check names and shapes of an HF state dict against a full (unsharded) `model`; return what to load.

    Raises CheckpointError listing missing/unexpected tensors or the first shape mismatch.
    """
    expected = model.state_dict()
    sd = dict(hf_sd)
    tied = getattr(getattr(model, "cfg", None), "tie_word_embeddings", False)
    if tied:
        sd.pop("lm_head.weight", None)
        expected = {k: v for k, v in expected.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(k for k in set(sd) - set(expected) if not k.endswith("rotary_emb.inv_freq"))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: weights do not match the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''} (a checkpoint of another model kind or size?)"
        )
    for k, v in expected.items():
        if tuple(sd[k].shape) != tuple(v.shape):
            raise CheckpointError(
                f"{source}: tensor {k} has shape {tuple(sd[k].shape)} but the model expects {tuple(v.shape)} "
                "(a checkpoint from another model size? check model.* against config.json)"
            )
    return {k: sd[k] for k in expected}


def load_hf_model(model_dir: str | os.PathLike, kind: str = "lm", dtype: Optional[torch.dtype] = None):
    """Build a full aligner model from an HF dir. Returns (model, ModelConfig).

    A causal-LM checkpoint loaded as kind="score" keeps the trunk and starts the score head at zero
    (a critic or RM initialized from a policy, as in Ouyang et al. 2022).
    """

    cfg = model_config_from_hf(read_hf_config(model_dir), source=str(Path(model_dir) / "config.json"))
    model = build_model(cfg, kind=kind, seed=0)
    hf_sd = load_hf_state_dict(model_dir)
    if kind == "score":
        hf_sd = {k: v for k, v in hf_sd.items() if k != "lm_head.weight"}
        hf_sd.setdefault("score.weight", torch.zeros(1, cfg.hidden_size))
    if cfg.num_experts:
        hf_sd = moe_from_hf(hf_sd)
    sd = to_model_state_dict(hf_sd, model, source=str(model_dir))
    model.load_state_dict(sd, strict=not cfg.tie_word_embeddings)
    if dtype is not None:
        model.to(dtype)
    return model, cfg


def recover_dir(final: Path) -> None:
    """Finish or undo an interrupted :func:`atomic_dir` replace of `final`.

    A replace moves the old dir to ``.<name>.old-<pid>`` and then the new one into place; a
    kill between the two leaves no `final`: the newest old copy is moved back. Stale temp and
    old copies beside an existing `final` are removed.
    """
    parent = final.parent
    if not parent.is_dir():
        return
    olds = sorted(parent.glob(f".{final.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if not final.exists() and olds:
        os.replace(olds.pop(), final)
    if final.exists():
        for stale in olds + list(parent.glob(f".{final.name}.tmp-*")):
            shutil.rmtree(stale, ignore_errors=True)


def atomic_dir(final: str | os.PathLike):
    """Context manager yielding a temp dir beside `final` that replaces `final` on success."""
    return _AtomicDir(Path(final))


class _AtomicDir:
    def __init__(self, final: Path):
        self.final = final

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        recover_dir(self.final)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.tmp-", dir=self.final.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        _apply_umask(self.tmp)
        old = None
        if self.final.exists():
            old = self.final.with_name(f".{self.final.name}.old-{os.getpid()}")
            os.replace(self.final, old)
        os.replace(self.tmp, self.final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _apply_umask(root: Path) -> None:
    """Give `root` and the files below it the modes a plain mkdir / open would (0777 / 0666 less the
    umask): mkdtemp makes 0700 and safetensors writes 0600, but an export is meant to be shared."""
    mask = _current_umask()
    for dirpath, _, files in os.walk(root):
        os.chmod(dirpath, 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o666 & ~mask)


def save_hf(
    state_dict: dict[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    kind: str = "lm",
    max_shard_bytes: int = 5 * 2**30,
    tokenizer=None,
) -> Path:
    """Write an HF dir (config.json + safetensors, sharded above `max_shard_bytes`) atomically.

    state_dict: full (gathered) tensors with HF names. Non-finite weights raise CheckpointError and nothing is written.
    tokenizer: optional HF tokenizer saved alongside.
    """
    from safetensors.torch import save_file

    sd = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    if cfg.num_experts:
        sd = {k: v.contiguous() for k, v in moe_to_hf(sd).items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    for k, v in sd.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise CheckpointError(f"refusing to export {out_dir}: tensor {k} has NaN/Inf values")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(sd):
        nbytes = sd[k].numel() * sd[k].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = sd[k]
        size += nbytes
    with atomic_dir(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(model_config_to_hf(cfg, kind), indent=2))
        if len(shards) == 1:
            save_file(shards[0], str(tmp / SAFE_NAME), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                weight_map.update({k: name for k in shard})
            total = sum(v.numel() * v.element_size() for v in sd.values())
            (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return Path(out_dir)
