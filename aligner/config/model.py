"""The model's schema: Llama-family decoder dimensions, RoPE scaling and MoE layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from aligner.config.common import _check, _choice


@dataclass(kw_only=True)
class RopeScalingConfig:
    """Llama 3 style RoPE frequency scaling (HF ``rope_scaling`` with rope_type llama3)."""

    rope_type: str = "llama3"  # only "llama3" is implemented
    factor: float = 8.0  # wavelength stretch for low frequencies
    low_freq_factor: float = 1.0  # wavelengths above original_max/low_freq_factor are scaled fully
    high_freq_factor: float = 4.0  # wavelengths below original_max/high_freq_factor are untouched
    original_max_position_embeddings: int = 8192  # context length of the unscaled model, tokens

    def validate(self, prefix: str) -> None:
        _choice(f"{prefix}.rope_type", self.rope_type, ("llama3",))
        _check(self.factor >= 1.0, f"{prefix}.factor", self.factor, "must be >= 1")
        _check(
            self.high_freq_factor > self.low_freq_factor,
            f"{prefix}.high_freq_factor",
            self.high_freq_factor,
            "must be greater than low_freq_factor",
        )


@dataclass(kw_only=True)
class ModelConfig:
    """Llama-family decoder dimensions (names follow HF LlamaConfig where they exist)."""

    vocab_size: int = 512  # tokens in the vocabulary (the tokenizer must not exceed it)
    hidden_size: int = 128  # model width H
    intermediate_size: int = 352  # SwiGLU inner width
    num_layers: int = 4  # decoder layers
    num_heads: int = 4  # query heads
    num_kv_heads: int = 4  # key/value heads (GQA when < num_heads)
    head_dim: Optional[int] = None  # per-head width; None means hidden_size // num_heads
    max_seq_len: int = 256  # longest sequence (prompt + response), tokens
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: Optional[RopeScalingConfig] = None  # Llama 3 scaling, or None
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2 style)
    o_proj_bias: bool = False  # bias on the attention output projection too (HF Llama attention_bias=true)
    init_std: float = 0.02  # normal init std for random weights
    backend: str = "torch"  # layer implementation: torch | te (Transformer Engine, NVIDIA GPUs)
    dtype: str = "float32"  # parameter dtype when not training with mixed precision
    # Mixture of Experts (Mixtral's layer; aligner.model.moe): 0 = dense SwiGLU MLP
    num_experts: int = 0  # experts per MoE layer (HF num_local_experts); each has intermediate_size
    num_experts_per_tok: int = 2  # top-k experts per token
    moe_router: str = "topk_softmax"  # topk_softmax (Mixtral) | sinkhorn (NeMo / Megatron S-BASE)
    moe_norm_topk_prob: bool = True  # renormalize the top-k probabilities to sum 1 (Mixtral does)
    router_aux_loss_coef: float = 0.001  # Switch load-balancing loss weight (HF Mixtral's default)
    router_z_loss_coef: float = 0.0  # ST-MoE router z-loss weight
    moe_capacity_factor: Optional[float] = None  # None: dropless; c: each expert takes ceil(c*N*k/E)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def validate(self, prefix: str = "model") -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "max_seq_len"):
            _check(getattr(self, name) > 0, f"{prefix}.{name}", getattr(self, name), "must be a positive integer")
        _check(
            self.num_heads % self.num_kv_heads == 0,
            f"{prefix}.num_kv_heads",
            self.num_kv_heads,
            f"must divide {prefix}.num_heads={self.num_heads}",
        )
        if self.head_dim is None:
            _check(
                self.hidden_size % self.num_heads == 0,
                f"{prefix}.num_heads",
                self.num_heads,
                f"must divide {prefix}.hidden_size={self.hidden_size} (or set {prefix}.head_dim)",
            )
        _check(self.resolved_head_dim % 2 == 0, f"{prefix}.head_dim", self.resolved_head_dim, "must be even for RoPE")
        _choice(f"{prefix}.backend", self.backend, ("torch", "te"))
        _choice(f"{prefix}.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        if self.rope_scaling is not None:
            self.rope_scaling.validate(f"{prefix}.rope_scaling")
        _check(self.num_experts >= 0, f"{prefix}.num_experts", self.num_experts, "must be 0 (dense MLP) or the number of experts")
        if self.num_experts:
            _check(
                1 <= self.num_experts_per_tok <= self.num_experts,
                f"{prefix}.num_experts_per_tok",
                self.num_experts_per_tok,
                f"must be between 1 and {prefix}.num_experts={self.num_experts}",
            )
            _choice(f"{prefix}.moe_router", self.moe_router, ("topk_softmax", "sinkhorn"))
            for name in ("router_aux_loss_coef", "router_z_loss_coef"):
                _check(getattr(self, name) >= 0, f"{prefix}.{name}", getattr(self, name), "must be >= 0")
            _check(
                self.moe_capacity_factor is None or self.moe_capacity_factor > 0,
                f"{prefix}.moe_capacity_factor",
                self.moe_capacity_factor,
                "must be > 0, or null for dropless routing",
            )
            _check(
                self.backend == "torch",
                f"{prefix}.backend",
                self.backend,
                "MoE layers run on the torch backend only: set model.backend=torch",
            )

    def num_parameters(self, active: bool = False) -> int:
        """Parameter count of the causal LM (embedding + layers + norm + lm_head).

        With MoE, `active` counts the parameters one token uses (the router and top-k experts)
        instead of all experts."""
        h, hd = self.hidden_size, self.resolved_head_dim
        attn = h * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.attention_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        if self.o_proj_bias:
            attn += h
        mlp = 3 * h * self.intermediate_size
        if self.num_experts:
            mlp = mlp * (self.num_experts_per_tok if active else self.num_experts) + self.num_experts * h
        layer = attn + mlp + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head
