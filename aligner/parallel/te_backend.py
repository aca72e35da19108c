"""Transformer Engine backend (``model.backend=te``): TE fused layers and FP8 on NVIDIA GPUs.

Owns: :func:`apply_te_backend`, which replaces every decoder layer of an aligner Llama model
(after TP sharding) with :class:`TEDecoderLayer`: ``te.LayerNormLinear`` (RMSNorm fused with
the column-parallel q/k/v projection, and with gate/up) and ``te.Linear`` (row-parallel o and
down projections), with the same Megatron TP/SP semantics (``parallel_mode`` "column"/"row",
``tp_group``, ``tp_size``, ``sequence_parallel``); the attention core, RoPE and SwiGLU are the
torch backend's. Also :func:`fp8_recipe` and :func:`fp8_autocast` (``te.autocast`` is a
context-manager class in TE 2.x; ``fp8_autocast`` is its deprecated wrapper).

Recipes: ``delayed`` (DelayedScaling) and ``current`` (Float8CurrentScaling) need Hopper or
newer (sm_90+, H100/H200); ``mxfp8`` (MXFP8BlockScaling) and ``nvfp4`` (NVFP4BlockScaling)
need Blackwell (sm_100+) and are refused elsewhere with a ValueError.

Simplifications: fused q/k/v rows are this rank's [q | k | v] shards concatenated, so
num_kv_heads must be divisible by tp_size (replicated kv heads are refused); embeddings, the
final norm and the heads stay torch layers; TE layers do not carry HF parameter names, so
checkpoints/exports of a TE model go through :func:`te_layer_to_hf` (layer-local names).
Transformer Engine is imported lazily; without it a clear ImportError says what to install.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from aligner.model.llama import apply_rope
from aligner.nn import comm

INSTALL_HINT = "model.backend=te needs Transformer Engine on an NVIDIA GPU: pip install 'aligner[te]' (transformer-engine[pytorch])"
RECIPES = ("delayed", "current", "mxfp8", "nvfp4")
_BLACKWELL_ONLY = ("mxfp8", "nvfp4")


def import_te():
    """``transformer_engine.pytorch`` or ImportError with the install hint."""
    try:
        import transformer_engine.pytorch as te
    except Exception as e:  # ImportError, or OSError from missing CUDA libraries
        raise ImportError(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from e
    return te


def fp8_recipe(name: str, capability: Optional[tuple[int, int]] = None, amax_history_len: int = 16):
    """The TE recipe object for `name` (delayed | current | mxfp8 | nvfp4).

    capability: (major, minor) CUDA compute capability; None reads the current device.
    Raises:
        ValueError: unknown name, FP8 on a GPU older than Hopper (sm_90), or mxfp8/nvfp4
            on a GPU older than Blackwell (sm_100).
    """
    if name not in RECIPES:
        raise ValueError(f"fp8 recipe={name!r} is invalid: valid choices are {', '.join(RECIPES)}")
    if capability is None:
        capability = torch.cuda.get_device_capability()
    if tuple(capability) < (9, 0):
        raise ValueError(
            f"fp8 recipe={name!r} needs an sm_90+ GPU (H100/H200); this GPU is sm_{capability[0]}{capability[1]}: train in bf16"
        )
    if name in _BLACKWELL_ONLY and tuple(capability) < (10, 0):
        raise ValueError(
            f"fp8 recipe={name!r} needs a Blackwell GPU (sm_100+); this GPU is sm_{capability[0]}{capability[1]}: "
            "use recipe=delayed or recipe=current on Hopper"
        )
    from transformer_engine.common import recipe

    if name == "delayed":
        return recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=amax_history_len, amax_compute_algo="max")
    if name == "current":
        return recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID)
    if name == "mxfp8":
        return recipe.MXFP8BlockScaling()
    return recipe.NVFP4BlockScaling()


def fp8_autocast(enabled: bool = True, recipe=None, amax_reduction_group=None):
    """``te.autocast`` context manager: FP8 (or the recipe's format) GEMMs inside the block.

    amax_reduction_group: the group amaxes are reduced over (the tp group, or tp x dp with
    delayed scaling so every replica uses the same scales).
    """
    te = import_te()
    return te.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=amax_reduction_group)


class TEDecoderLayer(nn.Module):
    """Pre-norm decoder block on TE layers; same math as ``aligner.model.llama.DecoderLayer``.

    Forward: h [B, T(/tp with SP), H] -> same shape. TE's sequence parallelism splits dim 0,
    so the block works sequence-first ([T, B, H]) inside and transposes at its edges.
    """

    def __init__(self, cfg, tp_group, sequence_parallel: bool, params_dtype: torch.dtype, device="cuda"):
        super().__init__()
        te = import_te()
        tp = comm.group_size(tp_group)
        hd = cfg.resolved_head_dim
        self.head_dim = hd
        self.q_local, self.kv_local = cfg.num_heads * hd // tp, cfg.num_kv_heads * hd // tp
        self.inter_local = cfg.intermediate_size // tp
        self.sequence_parallel = sequence_parallel and tp > 1
        common = dict(tp_group=tp_group, tp_size=tp, sequence_parallel=self.sequence_parallel, params_dtype=params_dtype, device=device)
        self.qkv = te.LayerNormLinear(
            cfg.hidden_size,
            (cfg.num_heads + 2 * cfg.num_kv_heads) * hd,
            eps=cfg.rms_norm_eps,
            normalization="RMSNorm",
            bias=cfg.attention_bias,
            parallel_mode="column",
            **common,
        )
        self.o_proj = te.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=False, parallel_mode="row", **common)
        self.gate_up = te.LayerNormLinear(
            cfg.hidden_size,
            2 * cfg.intermediate_size,
            eps=cfg.rms_norm_eps,
            normalization="RMSNorm",
            bias=False,
            parallel_mode="column",
            **common,
        )
        self.down_proj = te.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, parallel_mode="row", **common)

    def forward(self, h, cos, sin, mask, kv_cache=None, cache_positions=None):

        if kv_cache is not None:
            raise ValueError("the te backend is for training; generate with the torch backend (rollout engines)")
        x = h.transpose(0, 1).contiguous()  # [T(/tp), B, H]
        qkv = self.qkv(x).transpose(0, 1)  # [B, T, q+k+v local]
        b, t = qkv.shape[0], qkv.shape[1]
        q, k, v = qkv.split([self.q_local, self.kv_local, self.kv_local], dim=-1)
        q = q.reshape(b, t, -1, self.head_dim).transpose(1, 2)
        k = k.reshape(b, t, -1, self.head_dim).transpose(1, 2)
        v = v.reshape(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        attn = attn.transpose(1, 2).reshape(b, t, -1).transpose(0, 1).contiguous()  # [T, B, q local]
        x = x + self.o_proj(attn)
        gate, up = self.gate_up(x).split([self.inter_local, self.inter_local], dim=-1)
        x = x + self.down_proj(F.silu(gate) * up)
        return x.transpose(0, 1).contiguous()

    @torch.no_grad()
    def load_from_torch_layer(self, layer: nn.Module) -> None:
        """Copy a (TP-sharded) torch DecoderLayer's local weights into this layer."""
        a, m = layer.self_attn, layer.mlp
        self.qkv.layer_norm_weight.copy_(layer.input_layernorm.weight)
        self.qkv.weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
        if a.q_proj.bias is not None:
            self.qkv.bias.copy_(torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
        self.o_proj.weight.copy_(a.o_proj.weight)
        self.gate_up.layer_norm_weight.copy_(layer.post_attention_layernorm.weight)
        self.gate_up.weight.copy_(torch.cat([m.gate_proj.weight, m.up_proj.weight]))
        self.down_proj.weight.copy_(m.down_proj.weight)


def te_layer_to_hf(layer: TEDecoderLayer, prefix: str) -> dict[str, torch.Tensor]:
    """This rank's TE layer weights under HF names (TP-local shards; ``prefix`` like
    ``model.layers.3.``), inverting :meth:`TEDecoderLayer.load_from_torch_layer`."""
    q, k, v = layer.qkv.weight.detach().split([layer.q_local, layer.kv_local, layer.kv_local])
    gate, up = layer.gate_up.weight.detach().split([layer.inter_local, layer.inter_local])
    out = {
        "input_layernorm.weight": layer.qkv.layer_norm_weight.detach(),
        "self_attn.q_proj.weight": q,
        "self_attn.k_proj.weight": k,
        "self_attn.v_proj.weight": v,
        "self_attn.o_proj.weight": layer.o_proj.weight.detach(),
        "post_attention_layernorm.weight": layer.gate_up.layer_norm_weight.detach(),
        "mlp.gate_proj.weight": gate,
        "mlp.up_proj.weight": up,
        "mlp.down_proj.weight": layer.down_proj.weight.detach(),
    }
    if getattr(layer.qkv, "bias", None) is not None and layer.qkv.bias.numel():
        qb, kb, vb = layer.qkv.bias.detach().split([layer.q_local, layer.kv_local, layer.kv_local])
        out.update({"self_attn.q_proj.bias": qb, "self_attn.k_proj.bias": kb, "self_attn.v_proj.bias": vb})
    return {prefix + k: v for k, v in out.items()}


def apply_te_backend(
    model: nn.Module, tp_group=None, sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Replace every decoder layer of `model` (already TP-sharded over `tp_group`, on CUDA) with a
    :class:`TEDecoderLayer` holding the same weights. In place; returns `model`.

    Raises:
        ImportError: Transformer Engine is not importable (install hint).
        ValueError: the model is not on a CUDA device, or num_kv_heads is not divisible by tp_size.
    """
    cfg = model.cfg
    tp = comm.group_size(tp_group)
    if cfg.num_kv_heads % tp:
        raise ValueError(
            f"model.backend=te needs num_kv_heads={cfg.num_kv_heads} divisible by tp_size={tp} "
            "(replicated kv heads are torch-backend only): pick a tp_size dividing num_kv_heads"
        )
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"model.backend=te runs on NVIDIA GPUs; the model is on {device}: move it to cuda or use model.backend=torch")
    import_te()
    layers = model.model.layers
    for key in list(layers.keys()):
        new = TEDecoderLayer(cfg, tp_group, sequence_parallel, params_dtype, device=device)
        new.load_from_torch_layer(layers[key])
        layers[key] = new
    return model
