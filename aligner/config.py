"""Configuration schemas for every aligner stage (SFT, RM, PPO, plan).

Owns: the keyword-only dataclasses that Hydra/OmegaConf compose into, and their
validation (``__post_init__``). Configs are never mutated after they are built;
per-rank derived sizes (local heads, local batch) live in separate objects in
``aligner.parallel``.

Every bad value raises :class:`ConfigError` (a ``ValueError``) whose message names
the dotted field, the bad value and the valid choices or the fix. The entry
points turn it into a one-line message and exit code 2, with no traceback.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Optional, get_type_hints

from aligner import algorithms as alg
from aligner.errors import ConfigError

PRESETS = ("tiny", "smollm2_135m", "smollm2_ifeval", "llama2_7b", "llama2_13b", "llama2_70b")
STAGES = ("sft", "rm", "ppo", "plan", "dpo")
ROLES = ("actor", "critic", "reward", "ref", "rollout")
MODEL_ROLES = ("actor", "critic", "reward", "ref")  # the roles with a RoleConfig (init, parallel, resources)
# the keys of aligner.data.formats.FORMATS, in order (config imports nothing from aligner.data, which imports
# config; tests/test_config.py asserts the two agree)
DATA_FORMATS = ("prompt", "sft", "chat", "pairs", "hh", "gsm8k", "text", "prompt_completion", "unpaired")
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline")  # advantage estimators with a per-prompt group baseline


def _check(ok: bool, field_name: str, value: Any, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}={value!r} is invalid: {fix}")


def _choice(field_name: str, value: Any, choices: tuple) -> None:
    _check(value in choices, field_name, value, f"valid choices are {', '.join(map(str, choices))}")


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


@dataclass(kw_only=True)
class TokenizerConfig:
    """Where the tokenizer comes from."""

    path: str = ""  # HF tokenizer dir, tokenizer.json or tokenizer.model; "" = the built-in task's own tokenizer
    chat_template: str = ""  # Jinja chat template overriding the tokenizer's; "" = tokenizer's or the default


@dataclass(kw_only=True)
class DataConfig:
    """Training/eval data."""

    train_path: str = ""  # jsonl/json/parquet file or saved HF dataset dir; "" = the built-in task
    eval_path: str = ""  # held-out split; "" = built-in task's or a slice of train
    format: str = "auto"  # auto or one of DATA_FORMATS (the keys of aligner.data.formats.FORMATS)
    max_prompt_len: int = 64  # tokens; longer prompts follow `truncation`
    max_seq_len: int = 128  # tokens, prompt + response
    truncation: str = "error"  # error | left | right | skip: what to do with over-long rows
    skip_invalid: bool = False  # skip (and count) invalid rows instead of failing
    packing: bool = False  # pack several SFT samples into one sequence
    eval_fraction: float = 0.05  # fraction of train held out when eval_path is empty
    shuffle_seed: int = 0  # order of samples per epoch
    apply_chat_template: bool = False  # render plain-text prompts as one user turn through the tokenizer's chat template (instruct models)
    prompt_suffix: str = ""  # appended to every plain-text prompt before rendering (e.g. an answer-format instruction)

    def validate(self, prefix: str = "data") -> None:
        _choice(f"{prefix}.format", self.format, ("auto", *DATA_FORMATS))
        _choice(f"{prefix}.truncation", self.truncation, ("error", "left", "right", "skip"))
        _check(self.max_prompt_len > 0, f"{prefix}.max_prompt_len", self.max_prompt_len, "must be positive")
        _check(
            self.max_seq_len > self.max_prompt_len,
            f"{prefix}.max_seq_len",
            self.max_seq_len,
            f"must exceed {prefix}.max_prompt_len={self.max_prompt_len}",
        )
        _check(0.0 <= self.eval_fraction < 1.0, f"{prefix}.eval_fraction", self.eval_fraction, "must be in [0, 1)")


@dataclass(kw_only=True)
class TaskConfig:
    """The built-in arithmetic task used by the embedded default (aligner.data.task)."""

    name: str = "addition"  # built-in task name
    seed: int = 1234  # generator seed: the whole task is a function of it
    min_digits: int = 1  # smallest operand width
    max_digits: int = 2  # largest operand width
    num_sft: int = 4000  # SFT demonstrations, rows
    carry_error_rate: float = 0.6  # fraction of carry problems whose SFT demonstration forgets the carry (wrong)
    num_pairs: int = 3000  # preference pairs for the RM, rows
    num_rl: int = 2000  # RL prompts, rows
    num_eval: int = 256  # held-out problems (disjoint from every train split), rows per eval split
    tokenizer_vocab_size: int = 256  # upper bound on the trained BPE vocabulary, tokens (specials included)

    def validate(self, prefix: str = "task") -> None:
        _choice(f"{prefix}.name", self.name, ("addition",))
        _check(
            0 < self.min_digits <= self.max_digits <= 9, f"{prefix}.min_digits", self.min_digits, "need 0 < min_digits <= max_digits <= 9"
        )
        _check(0.0 <= self.carry_error_rate <= 1.0, f"{prefix}.carry_error_rate", self.carry_error_rate, "must be in [0, 1]")
        for name in ("num_sft", "num_pairs", "num_rl", "num_eval"):
            _check(getattr(self, name) >= 1, f"{prefix}.{name}", getattr(self, name), "must be >= 1")
        _check(
            self.tokenizer_vocab_size >= 20,
            f"{prefix}.tokenizer_vocab_size",
            self.tokenizer_vocab_size,
            "must be >= 20 (specials, digits and +-=)",
        )


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW and the learning-rate schedule (warmup + cosine by default)."""

    lr: float = 1e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # final lr as a fraction of lr (cosine)
    warmup_steps: int = 10  # linear warmup, optimizer steps
    schedule: str = "cosine"  # cosine | constant
    weight_decay: float = 0.0  # decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.95)  # Adam betas
    eps: float = 1e-8  # Adam epsilon
    grad_clip: float = 1.0  # max global grad norm over tp, pp and dp; 0 disables
    state_dtype: str = "float32"  # AdamW moments: float32 | bfloat16 (fp32 math and master weights either way)

    def validate(self, prefix: str) -> None:
        _check(self.lr > 0, f"{prefix}.lr", self.lr, "learning rate must be positive (e.g. 1e-5)")
        _check(0 <= self.min_lr_ratio <= 1, f"{prefix}.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        _check(self.warmup_steps >= 0, f"{prefix}.warmup_steps", self.warmup_steps, "must be >= 0")
        _choice(f"{prefix}.schedule", self.schedule, ("cosine", "constant"))
        _check(self.weight_decay >= 0, f"{prefix}.weight_decay", self.weight_decay, "must be >= 0")
        _check(self.grad_clip >= 0, f"{prefix}.grad_clip", self.grad_clip, "must be >= 0 (0 disables clipping)")
        _choice(f"{prefix}.state_dtype", self.state_dtype, ("float32", "bfloat16"))

    def validate_with(self, prefix: str, parallel: ParallelConfig, model: Optional[ModelConfig] = None) -> None:
        """Checks against the role's layout and model: bf16 moments need fp32 master weights
        (model.dtype=float32) and a backend whose optimizer aligner builds (not DeepSpeed's)."""
        if self.state_dtype == "float32":
            return
        _check(
            parallel.dp_backend != "deepspeed",
            f"{prefix}.state_dtype",
            self.state_dtype,
            "DeepSpeed builds its own fp32 Adam state; use state_dtype=float32 with dp_backend=deepspeed, or dp_backend=fsdp2 / ddp",
        )
        if model is not None:
            _check(
                model.dtype == "float32",
                f"{prefix}.state_dtype",
                self.state_dtype,
                f"needs fp32 master weights but model.dtype={model.dtype} (its moments already follow the parameters); "
                "set model.dtype=float32 (with parallel.mixed_precision=bf16 for bf16 compute) or state_dtype=float32",
            )


@dataclass(kw_only=True)
class ParallelConfig:
    """One role's TP x PP x DP layout and how it trains (Megatron-style TP/SP, 1F1B PP)."""

    tp_size: int = 1  # tensor-parallel ranks
    pp_size: int = 1  # pipeline stages
    dp_size: int = 1  # data-parallel replicas
    ep_size: int = 1  # expert parallelism (MoE): each group of ep_size dp ranks splits the experts (divides dp_size)
    sequence_parallel: bool = False  # split norm regions along the sequence (needs tp_size > 1 to matter)
    recompute: str = "none"  # activation recomputation per layer: none | selective | full
    dp_backend: str = "fsdp2"  # fsdp2 | ddp | deepspeed
    zero_stage: int = 1  # DeepSpeed ZeRO stage 1-3 (dp_backend=deepspeed only)
    offload_optimizer: bool = False  # DeepSpeed CPU-offloaded Adam (dp_backend=deepspeed only)
    mixed_precision: str = "fp32"  # fp32 | bf16 (bf16 compute, fp32 master weights and grad reduction)
    num_microbatches: int = 0  # pipeline micro-batches per step; 0 = derive from batch sizes
    pp_layer_split: Optional[list[int]] = None  # layers per stage (uneven splits); None = even
    # policy log-probs / entropy: positions per chunk of the fused head + softmax (aligner.nn.chunked),
    # so no [B, R, V/tp] fp32 logits exist; 0 = the unchunked path (the head's logits, then aligner.nn.vocab);
    # -1 = as many positions as keep one chunk's fp32 logits within 256 MiB (aligner.nn.chunked.auto_chunk_size)
    logprob_chunk_size: int = -1
    # torch.compile each decoder block for training (torchtitan's per-block compile, applied by
    # aligner.parallel.parallelize); off by default: on the CPU it was measured no faster (benchmarks/RESULTS.md)
    compile: bool = False

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size

    def validate(self, prefix: str, model: Optional[ModelConfig] = None) -> None:
        for name in ("tp_size", "pp_size", "dp_size"):
            _check(getattr(self, name) >= 1, f"{prefix}.{name}", getattr(self, name), "must be >= 1")
        _choice(f"{prefix}.recompute", self.recompute, ("none", "selective", "full"))
        _choice(f"{prefix}.dp_backend", self.dp_backend, ("fsdp2", "ddp", "deepspeed"))
        _choice(f"{prefix}.mixed_precision", self.mixed_precision, ("fp32", "bf16"))
        _choice(f"{prefix}.zero_stage", self.zero_stage, (0, 1, 2, 3))
        _check(
            self.logprob_chunk_size >= -1,
            f"{prefix}.logprob_chunk_size",
            self.logprob_chunk_size,
            "must be >= -1 (positions per chunk, e.g. 512; 0 = unchunked logits; -1 = chunks of 256 MiB of logits)",
        )
        _check(
            self.ep_size >= 1 and self.dp_size % self.ep_size == 0,
            f"{prefix}.ep_size",
            self.ep_size,
            f"must divide {prefix}.dp_size={self.dp_size} (experts are split over groups of ep_size data-parallel ranks)",
        )
        if self.ep_size > 1:
            _check(
                self.dp_backend != "deepspeed",
                f"{prefix}.ep_size",
                self.ep_size,
                "expert parallelism runs with dp_backend=fsdp2 or ddp, not deepspeed; set ep_size=1 or another dp_backend",
            )
        if self.dp_backend == "deepspeed":
            _check(
                self.tp_size == 1 and self.pp_size == 1,
                f"{prefix}.dp_backend",
                self.dp_backend,
                "DeepSpeed ZeRO is supported only where tp_size = pp_size = 1; use fsdp2 or ddp",
            )
        if model is None:
            return
        _check(
            model.num_heads % self.tp_size == 0,
            f"{prefix}.tp_size",
            self.tp_size,
            f"must divide model.num_heads={model.num_heads}; valid: "
            + ", ".join(str(d) for d in range(1, model.num_heads + 1) if model.num_heads % d == 0),
        )
        kv, tp = model.num_kv_heads, self.tp_size
        _check(
            kv % tp == 0 or tp % kv == 0,
            f"{prefix}.tp_size",
            tp,
            f"must divide or be a multiple of model.num_kv_heads={kv}",
        )
        _check(
            model.intermediate_size % tp == 0,
            f"{prefix}.tp_size",
            tp,
            f"must divide model.intermediate_size={model.intermediate_size}",
        )
        _check(
            self.pp_size <= model.num_layers,
            f"{prefix}.pp_size",
            self.pp_size,
            f"cannot exceed model.num_layers={model.num_layers}",
        )
        if self.ep_size > 1:
            _check(
                model.num_experts > 0 and model.num_experts % self.ep_size == 0,
                f"{prefix}.ep_size",
                self.ep_size,
                f"needs an MoE model whose model.num_experts={model.num_experts} it divides; set ep_size=1 for a dense model",
            )
        if self.pp_layer_split is not None:
            split = list(self.pp_layer_split)
            _check(
                len(split) == self.pp_size and sum(split) == model.num_layers and min(split) >= 1,
                f"{prefix}.pp_layer_split",
                split,
                f"needs {self.pp_size} positive entries summing to model.num_layers={model.num_layers}",
            )


@dataclass(kw_only=True)
class ResourceConfig:
    """What one role asks of the cluster (its node group)."""

    num_nodes: int = 1  # nodes in this role's node group
    gpus_per_node: int = 0  # GPUs per node this role uses; 0 = CPU workers
    cpus_per_worker: int = 1  # CPUs per Ray worker (on CPU runs also torch threads per worker)


@dataclass(kw_only=True)
class RoleConfig:
    """The fields of every model-hosting role (actor, critic, reward, ref): its weights and its place.

    A field appears only under the roles that use it: ``optim`` under the trained roles
    (:class:`TrainableRoleConfig`), ``type`` and ``rule`` under reward (:class:`RewardRoleConfig`);
    the schema refuses them elsewhere as unknown keys.
    """

    init: str = ""  # aligner checkpoint dir or HF model dir; "" = the stage's default
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # TP x PP x DP layout of this role
    resources: ResourceConfig = field(default_factory=ResourceConfig)  # node group
    colocate_with: str = ""  # name of a role whose bundles this one shares ("" = own node group)

    def validate(self, prefix: str, model: Optional[ModelConfig] = None) -> None:
        self.parallel.validate(f"{prefix}.parallel", model)
        _check(self.resources.num_nodes >= 1, f"{prefix}.resources.num_nodes", self.resources.num_nodes, "must be >= 1")
        _check(self.resources.gpus_per_node >= 0, f"{prefix}.resources.gpus_per_node", self.resources.gpus_per_node, "must be >= 0")
        _check(self.resources.cpus_per_worker >= 1, f"{prefix}.resources.cpus_per_worker", self.resources.cpus_per_worker, "must be >= 1")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # = aligner.nn.lora.TARGET_MODULES


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA adapters on this role's linears (Hu et al. 2021; aligner.nn.lora): the base weights are frozen,
    only the adapters (and a critic's / reward model's scalar head) train and are checkpointed."""

    rank: int = 0  # r, the adapters' rank; 0 = off (full fine-tuning)
    alpha: float = 16.0  # scaling numerator: the adapter's term is (alpha / rank) * B A x
    dropout: float = 0.0  # dropout probability on the adapter's input
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])  # linears adapted (HF/PEFT names)

    def validate(self, prefix: str, parallel: ParallelConfig, model: Optional[ModelConfig] = None) -> None:
        _check(self.rank >= 0, f"{prefix}.rank", self.rank, "must be >= 0 (0 turns LoRA off)")
        if self.rank == 0:
            return
        _check(self.alpha > 0, f"{prefix}.alpha", self.alpha, "must be > 0 (e.g. 2 * rank)")
        _check(0 <= self.dropout < 1, f"{prefix}.dropout", self.dropout, "must be in [0, 1)")
        bad = [t for t in self.target_modules if t not in LORA_TARGETS]
        _check(
            bool(self.target_modules) and not bad,
            f"{prefix}.target_modules",
            list(self.target_modules),
            f"give a non-empty list of {', '.join(LORA_TARGETS)}",
        )
        _check(
            parallel.dp_backend != "deepspeed",
            f"{prefix}.rank",
            self.rank,
            "LoRA runs with dp_backend=fsdp2 or ddp; set the role's parallel.dp_backend to one of them, or lora.rank=0",
        )
        if model is not None:
            _check(model.backend == "torch", f"{prefix}.rank", self.rank, f"LoRA needs model.backend=torch (got {model.backend})")
            mlp = sorted({"gate_proj", "up_proj", "down_proj"} & set(self.target_modules))
            _check(
                not (model.num_experts and mlp),
                f"{prefix}.target_modules",
                list(self.target_modules),
                f"an MoE model's experts take no LoRA adapters yet: drop {', '.join(mlp)} (attention projections only)",
            )


@dataclass(kw_only=True)
class TrainableRoleConfig(RoleConfig):
    """A role some stage trains: actor (SFT and PPO) and critic (PPO); the base of the reward role."""

    optim: OptimConfig = field(default_factory=OptimConfig)  # AdamW and the LR schedule of this role's training
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters (rank 0 = full fine-tuning)

    def validate(self, prefix: str, model: Optional[ModelConfig] = None) -> None:
        super().validate(prefix, model)
        self.optim.validate(f"{prefix}.optim")
        self.optim.validate_with(f"{prefix}.optim", self.parallel, model)
        self.lora.validate(f"{prefix}.lora", self.parallel, model)


PROMPT_LEARNING_TYPES = ("none", "prompt_tuning", "p_tuning")


@dataclass(kw_only=True)
class PromptLearningConfig:
    """Prompt learning of the SFT policy: trained virtual tokens prepended to every sequence, base frozen.

    prompt_tuning: the virtual-token embeddings are the parameters (Lester et al. 2021). p_tuning: a
    small prompt encoder (MLP or bidirectional LSTM + MLP, PEFT's PromptEncoder) maps trained input
    embeddings to them (Liu et al. 2021). See :mod:`aligner.model.prompt`.
    """

    type: str = "none"  # none | prompt_tuning | p_tuning
    num_virtual_tokens: int = 8  # virtual tokens prepended to every sequence
    init: str = "random"  # random (normal, the token embedding's std) | text (embeddings of init_text's tokens)
    init_text: str = ""  # init=text: text whose token embeddings, repeated/truncated to num_virtual_tokens, start the prompt
    encoder: str = "mlp"  # p_tuning: mlp | lstm
    encoder_hidden_size: int = 128  # p_tuning: the encoder's hidden width

    @property
    def enabled(self) -> bool:
        return self.type != "none"

    def validate(self, prefix: str, model: Optional[ModelConfig] = None) -> None:
        _choice(f"{prefix}.type", self.type, PROMPT_LEARNING_TYPES)
        _choice(f"{prefix}.init", self.init, ("random", "text"))
        _choice(f"{prefix}.encoder", self.encoder, ("mlp", "lstm"))
        _check(self.num_virtual_tokens >= 1, f"{prefix}.num_virtual_tokens", self.num_virtual_tokens, "must be >= 1")
        _check(self.encoder_hidden_size >= 1, f"{prefix}.encoder_hidden_size", self.encoder_hidden_size, "must be >= 1")
        if self.enabled and self.init == "text":
            _check(bool(self.init_text.strip()), f"{prefix}.init_text", self.init_text, f"{prefix}.init=text needs a non-empty text")


@dataclass(kw_only=True)
class ActorRoleConfig(TrainableRoleConfig):
    """The actor role: a trainable role plus prompt learning (SFT only)."""

    prompt_learning: PromptLearningConfig = field(default_factory=PromptLearningConfig)  # virtual tokens, base frozen

    def validate(self, prefix: str, model: Optional[ModelConfig] = None) -> None:
        super().validate(prefix, model)
        self.prompt_learning.validate(f"{prefix}.prompt_learning", model)


@dataclass(kw_only=True)
class RewardRoleConfig(TrainableRoleConfig):
    """The reward role: a reward model (trained by the RM stage with ``optim``, frozen in PPO) or a rule."""

    type: str = "model"  # PPO's reward: model (the reward model at init) | rule (a function on the driver)
    rule: str = "task_accuracy"  # type=rule: the rule's name in aligner.reward.rules.RULES

    def validate(self, prefix: str, model: Optional[ModelConfig] = None) -> None:
        super().validate(prefix, model)
        _choice(f"{prefix}.type", self.type, ("model", "rule"))


@dataclass(kw_only=True)
class RefRoleConfig(RoleConfig):
    """The frozen reference policy (KL terms): no optimizer, only the fields of :class:`RoleConfig`."""


@dataclass(kw_only=True)
class SamplingConfig:
    """Rollout sampling parameters."""

    temperature: float = 1.0  # softmax temperature; 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # nucleus mass in (0, 1]
    max_new_tokens: int = 16  # response tokens per prompt
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens besides EOS

    def validate(self, prefix: str) -> None:
        _check(self.temperature >= 0, f"{prefix}.temperature", self.temperature, "must be >= 0 (0 = greedy)")
        _check(self.top_k >= 0, f"{prefix}.top_k", self.top_k, "must be >= 0 (0 = off)")
        _check(0 < self.top_p <= 1, f"{prefix}.top_p", self.top_p, "must be in (0, 1]")
        _check(self.max_new_tokens >= 1, f"{prefix}.max_new_tokens", self.max_new_tokens, "must be >= 1")


@dataclass(kw_only=True)
class RolloutConfig:
    """The actor's rollout engine and refit."""

    backend: str = "torch"  # torch (aligner's engine, CPU or CUDA) | trtllm (TensorRT-LLM 1.2 on the actor's GPUs; bf16/fp16)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # engine tp/pp layout (dp = replicas)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # how responses are sampled
    refit_bucket_mb: int = 256  # refit sends weights in buckets of this size, MiB
    max_batch_size: int = 256  # continuous: KV-cache slots (requests decoding at once); static: sequences per batch
    scheduler: str = "continuous"  # continuous (slots refilled as responses stop, shared prompt prefixes) | static
    micro_batches: int = 0  # continuous: slot-pool blocks in flight through the engine's pipeline (0 = its pp_size)
    cuda_graphs: bool = True  # capture decode steps in CUDA graphs (GPU, static scheduler only)
    compile: str = (
        "auto"  # torch.compile each decoder layer for generation: on | off | auto (= off for now: no faster on CPU, unrun on CUDA)
    )
    dtype: str = "float32"  # engine weights and KV cache: float32 | bfloat16 | float16 (refit casts)

    def validate(self, prefix: str, model: Optional[ModelConfig] = None) -> None:
        _choice(f"{prefix}.backend", self.backend, ("torch", "trtllm"))
        _choice(f"{prefix}.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        _choice(f"{prefix}.scheduler", self.scheduler, ("continuous", "static"))
        _choice(f"{prefix}.compile", self.compile, ("auto", "on", "off"))
        _check(self.max_batch_size >= 1, f"{prefix}.max_batch_size", self.max_batch_size, "must be >= 1")
        _check(self.micro_batches >= 0, f"{prefix}.micro_batches", self.micro_batches, f"must be >= 0 (0 = {prefix}.parallel.pp_size)")
        self.parallel.validate(f"{prefix}.parallel", model)
        self.sampling.validate(f"{prefix}.sampling")
        _check(self.refit_bucket_mb > 0, f"{prefix}.refit_bucket_mb", self.refit_bucket_mb, "must be positive")


@dataclass(kw_only=True)
class AlgorithmConfig:
    """PPO-family algorithm settings (formulas and papers in aligner.algorithms).

    The KL to the reference policy enters in one or both of two places: in the reward
    (``kl_in_reward``, coefficient ``kl_coef`` under ``kl_controller``: per token for gae
    and reinforce_pp, per sequence for grpo and rloo), or as a loss term of the actor
    (``kl_loss_coef`` with ``kl_loss_estimator``, as DeepSeekMath's GRPO). A coefficient
    that nothing applies is refused.
    """

    advantage: str = "gae"  # a key of aligner.algorithms.ADVANTAGE_ESTIMATORS
    gamma: float = 1.0  # discount
    gae_lambda: float = 0.95  # GAE lambda
    clip_eps: float = 0.2  # PPO ratio clip (lower, and upper unless clip_eps_high is set)
    clip_eps_high: Optional[float] = None  # upper ratio clip, "clip-higher" (DAPO, Yu et al. 2025); None = clip_eps
    dual_clip: Optional[float] = None  # dual-clip bound c > 1 (Ye et al. 2020); None = off
    value_clip_eps: Optional[float] = 0.2  # clipped value loss; None = unclipped
    loss_agg: str = "token-mean"  # actor loss aggregation: token-mean | seq-mean-token-mean (GRPO paper) | seq-mean-token-sum (Dr. GRPO)
    norm_by_std: bool = True  # grpo only: divide by the group std; false = Dr. GRPO (Liu et al. 2025)
    kl_in_reward: Optional[bool] = None  # KL penalty in the reward; None = true except for grpo (KL as a loss there)
    kl_coef: float = 0.05  # (initial) coefficient of the KL in the reward
    kl_estimator: str = "k1"  # KL estimator in the reward and the KL metrics: a key of KL_ESTIMATORS
    kl_controller: str = "fixed"  # fixed | adaptive (Ziegler et al. 2019), for kl_coef
    kl_target: float = 6.0  # adaptive controller target KL, nats per sequence
    kl_horizon: int = 10000  # adaptive controller horizon, samples
    kl_loss_coef: float = 0.0  # coefficient of the KL loss term in the actor loss (TRL GRPO beta, verl kl_loss_coef); 0 = off
    kl_loss_estimator: str = "k3"  # estimator of the KL loss term (DeepSeekMath: k3)
    entropy_coef: float = 0.0  # entropy bonus weight
    whiten_advantages: bool = True  # gae: normalize advantages over the batch
    ppo_epochs: int = 1  # passes over each rollout batch
    critic_warmup_steps: int = 0  # steps that train only the critic
    normalize_rewards: bool = True  # standardize RM scores with the RM's saved mean/std
    tis_cap: Optional[float] = None  # truncated importance-sampling cap on exp(old - rollout); None = off
    # false: skip the actor's old-log-prob forward of the inference phase; the update uses its own
    # forward's log-probs, detached, as old (ratio 1; exact only when the update is on-policy: one
    # epoch, one mini-batch, no KL in the reward, no tis_cap; TRL GRPOTrainer with num_iterations=1).
    # The engine-vs-trainer mismatch metrics are then not measured.
    recompute_old_log_probs: bool = True
    vf_coef: float = 1.0  # value-loss weight

    @property
    def resolved_kl_in_reward(self) -> bool:
        """``kl_in_reward``, or its default: true for every estimator but grpo."""
        return self.advantage != "grpo" if self.kl_in_reward is None else bool(self.kl_in_reward)

    @property
    def reward_kl_coef_used(self) -> bool:
        """Whether the KL-in-reward coefficient can be nonzero in this run."""
        return self.resolved_kl_in_reward and (self.kl_coef > 0 or self.kl_controller == "adaptive")

    @property
    def uses_reference(self) -> bool:
        """Whether any KL term needs the reference policy's log-probs."""
        return self.reward_kl_coef_used or self.kl_loss_coef > 0

    def validate(self, prefix: str = "algorithm") -> None:
        _choice(f"{prefix}.advantage", self.advantage, tuple(alg.ADVANTAGE_ESTIMATORS))
        _choice(f"{prefix}.kl_estimator", self.kl_estimator, tuple(alg.KL_ESTIMATORS))
        _choice(f"{prefix}.kl_loss_estimator", self.kl_loss_estimator, tuple(alg.KL_ESTIMATORS))
        _choice(f"{prefix}.kl_controller", self.kl_controller, tuple(alg.KL_CONTROLLERS))
        _choice(f"{prefix}.loss_agg", self.loss_agg, alg.LOSS_AGG_MODES)
        _check(0 <= self.gamma <= 1, f"{prefix}.gamma", self.gamma, "must be in [0, 1]")
        _check(0 <= self.gae_lambda <= 1, f"{prefix}.gae_lambda", self.gae_lambda, "must be in [0, 1]")
        _check(self.clip_eps > 0, f"{prefix}.clip_eps", self.clip_eps, "must be positive (e.g. 0.2)")
        if self.clip_eps_high is not None:
            _check(self.clip_eps_high > 0, f"{prefix}.clip_eps_high", self.clip_eps_high, "must be positive (e.g. 0.28, DAPO) or null")
        _check(self.kl_coef >= 0, f"{prefix}.kl_coef", self.kl_coef, "must be >= 0")
        _check(self.kl_loss_coef >= 0, f"{prefix}.kl_loss_coef", self.kl_loss_coef, "must be >= 0 (e.g. 0.04, DeepSeekMath)")
        _check(self.ppo_epochs >= 1, f"{prefix}.ppo_epochs", self.ppo_epochs, "must be >= 1")
        if self.dual_clip is not None:
            _check(self.dual_clip > 1, f"{prefix}.dual_clip", self.dual_clip, "must be > 1 (e.g. 3.0) or null")
        if self.tis_cap is not None:
            _check(self.tis_cap >= 1, f"{prefix}.tis_cap", self.tis_cap, "must be >= 1 (e.g. 2.0) or null")
        _check(
            self.norm_by_std or self.advantage == "grpo",
            f"{prefix}.norm_by_std",
            self.norm_by_std,
            f"applies to advantage=grpo only (advantage={self.advantage} has no group std): remove it",
        )
        if not self.resolved_kl_in_reward:
            where = (
                f"{prefix}.kl_in_reward=false"
                if self.kl_in_reward is not None
                else f"{prefix}.kl_in_reward is false by default for advantage={self.advantage}"
            )
            fix = (
                f"the KL is not in the reward ({where}): set {prefix}.kl_coef=0 and put the KL in the loss with "
                f"{prefix}.kl_loss_coef (e.g. 0.04, DeepSeekMath), or set {prefix}.kl_in_reward=true"
            )
            _check(self.kl_coef == 0, f"{prefix}.kl_coef", self.kl_coef, fix)
            _check(self.kl_controller == "fixed", f"{prefix}.kl_controller", self.kl_controller, fix)


@dataclass(kw_only=True)
class DPOConfig:
    """The DPO stage's loss (formulas in :func:`aligner.algorithms.dpo_loss`)."""

    beta: float = 0.1  # KL-regularization strength: implicit reward = beta * (log pi - log pi_ref), nats
    loss_type: str = "sigmoid"  # sigmoid (DPO, Rafailov et al. 2023) | ipo (Azar et al. 2023, length-normalized as TRL)
    label_smoothing: float = 0.0  # sigmoid only: probability a preference label is flipped (conservative DPO), in [0, 0.5)
    rpo_alpha: float = 0.0  # weight of the chosen responses' NLL (token mean) added to the loss (RPO, Pang et al. 2024); 0 = off

    def validate(self, prefix: str = "dpo") -> None:
        _choice(f"{prefix}.loss_type", self.loss_type, alg.DPO_LOSS_TYPES)
        _check(self.beta > 0, f"{prefix}.beta", self.beta, "must be > 0 (e.g. 0.1)")
        _check(0 <= self.label_smoothing < 0.5, f"{prefix}.label_smoothing", self.label_smoothing, "must be in [0, 0.5) (e.g. 0.1)")
        _check(
            self.label_smoothing == 0 or self.loss_type == "sigmoid",
            f"{prefix}.label_smoothing",
            self.label_smoothing,
            f"applies to {prefix}.loss_type=sigmoid only (conservative DPO): set it to 0 with loss_type={self.loss_type}",
        )
        _check(self.rpo_alpha >= 0, f"{prefix}.rpo_alpha", self.rpo_alpha, "must be >= 0 (e.g. 1.0; 0 = off)")


@dataclass(kw_only=True)
class TrainerConfig:
    """The training loop: steps, batch sizes, seeds, logging and checkpoint cadence."""

    max_steps: int = 100  # optimizer steps (SFT/RM) or PPO steps
    seed: int = 42  # global seed (model init, data order, sampling)
    save_every: int = 0  # checkpoint every N steps; 0 = only at the end
    eval_every: int = 0  # evaluate every N steps; 0 = only at the end
    log_every: int = 1  # log metrics every N steps
    global_batch_size: int = 32  # SFT/RM: samples per optimizer step (over all dp ranks)
    micro_batch_size: int = 8  # samples per forward/backward per dp rank
    rollout_batch_size: int = 32  # PPO: prompts per step
    n_samples_per_prompt: int = 1  # PPO: responses per prompt (>= 2 for grpo, rloo, reinforce_pp_baseline)
    mini_batch_size: int = 32  # PPO: samples per optimizer step
    shared_prompt_pack_len: int = 4096  # PPO with n_samples_per_prompt > 1: the actor and reference run a prompt's samples as one packed row, the prompt's positions once (aligner.actor.shared_prompt), when the row has at most this many tokens; 0 = padded rows
    eval_batch_size: int = 64  # prompts per evaluation batch
    max_nonfinite: int = 3  # consecutive non-finite updates before the run stops
    num_threads: int = 0  # torch threads per CPU worker; 0 = follow the work: the workers busy in a phase share their node's cores (a role running alone gets them all)
    progress: bool = True  # show a progress bar
    preempt_grace_s: float = 25.0  # after SIGTERM: seconds to finish the step and checkpoint (below the scheduler's grace, 30 s by default)

    def validate(self, prefix: str = "trainer") -> None:
        for name in (
            "max_steps",
            "global_batch_size",
            "micro_batch_size",
            "rollout_batch_size",
            "n_samples_per_prompt",
            "mini_batch_size",
            "eval_batch_size",
            "max_nonfinite",
        ):
            _check(getattr(self, name) >= 1, f"{prefix}.{name}", getattr(self, name), "must be >= 1")
        for name in ("save_every", "eval_every", "num_threads", "shared_prompt_pack_len"):
            _check(getattr(self, name) >= 0, f"{prefix}.{name}", getattr(self, name), "must be >= 0")
        _check(
            self.preempt_grace_s > 0,
            f"{prefix}.preempt_grace_s",
            self.preempt_grace_s,
            "must be > 0 seconds (a few below the scheduler's grace period, e.g. 25)",
        )
        _check(
            self.global_batch_size % self.micro_batch_size == 0,
            f"{prefix}.global_batch_size",
            self.global_batch_size,
            f"must be a multiple of {prefix}.micro_batch_size={self.micro_batch_size}",
        )
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        _check(
            samples % self.mini_batch_size == 0,
            f"{prefix}.mini_batch_size",
            self.mini_batch_size,
            f"must divide rollout_batch_size * n_samples_per_prompt = {samples}",
        )


@dataclass(kw_only=True)
class ClusterConfig:
    """The cluster the run is placed on (and that plans are made for)."""

    address: str = ""  # Ray address; "" = RAY_ADDRESS or a new local instance, "auto" = existing cluster
    num_nodes: int = 1  # nodes
    gpus_per_node: int = 0  # GPUs per node (0 = CPU-only)
    gpu_mem_gb: float = 80.0  # memory per GPU, GB
    cpus_per_node: int = 0  # CPUs per node; 0 = detect
    placement: str = "split"  # split (each role its own node group) | colocated (roles share bundles)
    gpu_peak_tflops: float = 989.0  # dense bf16 peak per GPU, TFLOP/s (H100 SXM), for plans
    intra_node_gbps: float = 450.0  # NVLink bandwidth per GPU, GB/s, for plans
    inter_node_gbps: float = 50.0  # network bandwidth per GPU, GB/s, for plans
    hbm_gbps: float = 3350.0  # HBM bandwidth per GPU, GB/s (H100 SXM), for plans (decode is bandwidth bound)

    def validate(self, prefix: str = "cluster") -> None:
        _check(self.num_nodes >= 1, f"{prefix}.num_nodes", self.num_nodes, "must be >= 1")
        _check(self.gpus_per_node >= 0, f"{prefix}.gpus_per_node", self.gpus_per_node, "must be >= 0")
        _check(self.gpu_mem_gb > 0, f"{prefix}.gpu_mem_gb", self.gpu_mem_gb, "must be positive")
        _choice(f"{prefix}.placement", self.placement, ("split", "colocated"))


@dataclass(kw_only=True)
class AlignerConfig:
    """The whole run. Built from Hydra (`conf=PRESET` plus overrides) and validated once."""

    stage: str = "ppo"  # sft | rm | ppo | plan | dpo (set by the entry point)
    preset: str = "tiny"  # name of the preset the run started from
    output_dir: str = "outputs/tiny"  # checkpoints, metrics.jsonl, TensorBoard events, plots
    resume: bool = False  # continue from the latest complete checkpoint in output_dir
    # delete a previous run's outputs in output_dir first, then run fresh (without it, or resume=true,
    # a run refuses an output_dir that holds a previous run's files: see aligner/trainers/run_dir.py)
    overwrite: bool = False
    plan_only: bool = False  # print the placement/memory plan and exit 0
    model: ModelConfig = field(default_factory=ModelConfig)  # policy (and, by default, every role's) dimensions
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    actor: ActorRoleConfig = field(default_factory=ActorRoleConfig)  # policy (also the SFT model)
    critic: TrainableRoleConfig = field(default_factory=TrainableRoleConfig)  # value model
    reward: RewardRoleConfig = field(default_factory=RewardRoleConfig)  # reward model or rule (also the RM stage's model)
    ref: RefRoleConfig = field(default_factory=RefRoleConfig)  # frozen reference policy
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # generation engine
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)  # the DPO stage's loss
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        _choice("stage", self.stage, STAGES)
        _choice("conf", self.preset, PRESETS)
        _check(
            bool(self.output_dir.strip()),
            "output_dir",
            self.output_dir,
            "give a directory, e.g. output_dir=outputs/run1 (empty would write into the current directory)",
        )
        self.model.validate("model")
        self.data.validate("data")
        self.task.validate("task")
        self.trainer.validate("trainer")
        for role in ("actor", "critic", "reward", "ref"):
            getattr(self, role).validate(role, self.model)
        _check(
            not (self.ref_from_actor and self.ref.init and self.ref.init != self.actor.init),
            "ref.init",
            self.ref.init,
            "with actor.lora.rank > 0 the reference is the actor's frozen base (actor.init); leave ref.init empty",
        )
        self.rollout.validate("rollout", self.model)
        self.algorithm.validate("algorithm")
        self.dpo.validate("dpo")
        self.cluster.validate("cluster")
        _check(
            self.data.max_seq_len <= self.model.max_seq_len,
            "data.max_seq_len",
            self.data.max_seq_len,
            f"must not exceed model.max_seq_len={self.model.max_seq_len}",
        )
        self._validate_prompt_learning()
        if self.stage == "ppo":
            self._validate_rollout_lengths()
        self._validate_cluster_devices()
        if self.stage == "ppo" and self.rollout.backend == "trtllm":
            self._validate_trtllm()
        if self.stage == "ppo" and not self.algorithm.recompute_old_log_probs:
            self._validate_on_policy()
        if self.stage == "ppo" and self.algorithm.advantage in GROUP_ESTIMATORS:
            _check(
                self.trainer.n_samples_per_prompt >= 2,
                "trainer.n_samples_per_prompt",
                self.trainer.n_samples_per_prompt,
                f"algorithm.advantage={self.algorithm.advantage} needs >= 2 samples per prompt",
            )
            _check(
                self.rollout.sampling.temperature > 0,
                "rollout.sampling.temperature",
                self.rollout.sampling.temperature,
                f"greedy sampling gives every sample of a prompt the same response, so algorithm.advantage="
                f"{self.algorithm.advantage} (a per-prompt group baseline) has zero advantages and trains nothing: "
                "sample with temperature > 0 (e.g. 1.0)",
            )

    def _validate_on_policy(self) -> None:
        """algorithm.recompute_old_log_probs=false is exact only for an on-policy update: say what breaks it."""
        a, t = self.algorithm, self.trainer
        f, v = "algorithm.recompute_old_log_probs", a.recompute_old_log_probs
        need = "false skips the old-log-prob forward, which is exact only for an on-policy update, but"
        samples = t.rollout_batch_size * t.n_samples_per_prompt
        _check(a.ppo_epochs == 1, f, v, f"{need} algorithm.ppo_epochs={a.ppo_epochs} reuses the batch: set it to true")
        _check(
            t.mini_batch_size >= samples,
            f,
            v,
            f"{need} trainer.mini_batch_size={t.mini_batch_size} splits the {samples} samples of a step into several "
            f"optimizer steps: set it to true, or trainer.mini_batch_size={samples}",
        )
        _check(not a.reward_kl_coef_used, f, v, f"{need} the KL in the reward needs the old log-probs before the update: set it to true")
        _check(a.tis_cap is None, f, v, f"{need} algorithm.tis_cap weighs by exp(old - rollout): set it to true")

    def _validate_prompt_learning(self) -> None:
        """actor.prompt_learning: SFT only, on layouts the virtual tokens support, within the model's positions."""
        pl = prompt_learning_of(self)
        if pl is None or not pl.enabled:
            return
        f = "actor.prompt_learning.type"
        p = self.actor.parallel
        _check(
            p.pp_size == 1,
            "actor.parallel.pp_size",
            p.pp_size,
            f"{f}={pl.type} supports pp_size=1 only (the virtual tokens live on the first stage, not implemented)",
        )
        _check(
            not p.sequence_parallel, "actor.parallel.sequence_parallel", p.sequence_parallel, f"{f}={pl.type} needs sequence_parallel=false"
        )
        _check(p.dp_backend != "deepspeed", "actor.parallel.dp_backend", p.dp_backend, f"{f}={pl.type} supports fsdp2 or ddp")
        _check(
            not self.data.packing,
            "data.packing",
            self.data.packing,
            f"{f}={pl.type} prepends virtual tokens to each row: set data.packing=false",
        )
        _check(
            pl.num_virtual_tokens + self.data.max_seq_len <= self.model.max_seq_len,
            "actor.prompt_learning.num_virtual_tokens",
            pl.num_virtual_tokens,
            f"num_virtual_tokens + data.max_seq_len={self.data.max_seq_len} must not exceed model.max_seq_len={self.model.max_seq_len}",
        )
        _check(
            self.actor.lora.rank == 0,
            "actor.lora.rank",
            self.actor.lora.rank,
            f"LoRA and {f}={pl.type} together are not supported (each freezes the base for its own parameters): set one of them off",
        )
        _check(self.stage == "sft", f, pl.type, f"prompt learning is implemented for the SFT stage only (stage={self.stage}): set {f}=none")

    def _validate_rollout_lengths(self) -> None:
        """The longest prompt plus the response must fit the model (the engine's KV cache and RoPE positions)."""
        s, d, m = self.rollout.sampling, self.data, self.model
        _check(
            d.max_prompt_len + s.max_new_tokens <= m.max_seq_len,
            "rollout.sampling.max_new_tokens",
            s.max_new_tokens,
            f"data.max_prompt_len={d.max_prompt_len} + max_new_tokens must not exceed model.max_seq_len={m.max_seq_len}: "
            f"lower it to {max(1, m.max_seq_len - d.max_prompt_len)} or shorten data.max_prompt_len",
        )

    def _validate_cluster_devices(self) -> None:
        """Roles that ask for GPUs need a cluster with GPUs (plans for a GPU preset on 0 GPUs are meaningless)."""
        if self.cluster.gpus_per_node > 0:
            return
        for role in ("actor", "critic", "reward", "ref"):
            gpus = self.role(role).resources.gpus_per_node
            _check(
                gpus == 0,
                "cluster.gpus_per_node",
                self.cluster.gpus_per_node,
                f"conf={self.preset} runs its roles on GPUs ({role}.resources.gpus_per_node={gpus}): give the cluster's "
                "GPUs per node (e.g. cluster.gpus_per_node=8), or use conf=tiny for a CPU run",
            )

    def _validate_trtllm(self) -> None:
        """What ``rollout.backend=trtllm`` needs, checked before Ray starts (ppo stage only).

        In order: CUDA workers for the actor (the engine runs on the actor's GPUs), a 16-bit
        rollout dtype (TensorRT-LLM's kernels do not dispatch float32, NVIDIA/TensorRT-LLM#5260),
        engine replicas that fit one node (tp_size * pp_size divides actor.resources.gpus_per_node:
        a replica's workers are placed in the node bundle of its owner rank and read the trainer's
        weights through CUDA IPC, which is node-local), and last an importable ``tensorrt_llm``.
        """
        gpus, rp = self.actor.resources.gpus_per_node, self.rollout.parallel
        _check(
            gpus >= 1,
            "actor.resources.gpus_per_node",
            gpus,
            "rollout.backend=trtllm runs TensorRT-LLM on the actor's CUDA GPUs: give the actor GPUs "
            "(actor.resources.gpus_per_node >= 1 and cluster.gpus_per_node), or use rollout.backend=torch",
        )
        _check(
            self.rollout.dtype in ("bfloat16", "float16"),
            "rollout.dtype",
            self.rollout.dtype,
            "TensorRT-LLM's kernels do not run float32 (NVIDIA/TensorRT-LLM#5260): set rollout.dtype=bfloat16 "
            "(or float16) with rollout.backend=trtllm",
        )
        engine_gpus = rp.tp_size * rp.pp_size
        _check(
            gpus % engine_gpus == 0,
            "rollout.parallel.tp_size",
            rp.tp_size,
            f"rollout.parallel.tp_size x pp_size = {engine_gpus} must divide actor.resources.gpus_per_node={gpus}: "
            "a TensorRT-LLM engine replica lives on one node's GPUs",
        )
        _check(
            importlib.util.find_spec("tensorrt_llm") is not None,
            "rollout.backend",
            self.rollout.backend,
            f"tensorrt_llm is not importable by {sys.executable}: pip install 'aligner[trtllm]' "
            "(tensorrt-llm>=1.2,<2 from https://pypi.nvidia.com) on the CUDA machines, or use rollout.backend=torch",
        )

    def roles_used(self) -> tuple[str, ...]:
        """The role groups this run starts.

        sft and dpo: actor (DPO's reference lives in the actor's workers). rm: reward. ppo: actor always; critic for gae; reward when
        ``reward.type=model``; ref when a KL term needs it (:attr:`AlgorithmConfig.uses_reference`).
        plan: the PPO roles.
        """
        if self.stage in ("sft", "dpo"):
            return ("actor",)
        if self.stage == "rm":
            return ("reward",)
        roles = ["actor"]
        if self.algorithm.advantage == "gae":
            roles.append("critic")
        if self.reward.type == "model":
            roles.append("reward")
        if self.algorithm.uses_reference and not self.ref_from_actor:
            roles.append("ref")
        return tuple(roles)

    @property
    def ref_from_actor(self) -> bool:
        """PPO with a LoRA actor (actor.lora.rank > 0) and a KL term: the reference policy is the actor
        with its adapters disabled (its frozen base), so no ref worker group is started."""
        return self.stage in ("ppo", "plan") and self.algorithm.uses_reference and self.actor.lora.rank > 0

    def init_of(self, role: str) -> str:
        """The checkpoint `role` starts from: its own ``init``, else the critic starts from the
        reward model (``reward.init``, when ``reward.type=model``) and the reference from the
        policy (``actor.init``); "" = random weights."""
        return self.role(role).init or (self.role(fallback).init if (fallback := self._init_fallback(role)) else "")

    def init_field(self, role: str) -> str:
        """How to name where `role`'s init comes from in a message: "critic.init", or
        "reward.init (critic.init is empty)" when it falls back."""
        fallback = self._init_fallback(role)
        if self.role(role).init or not fallback or not self.role(fallback).init:
            return f"{role}.init"
        return f"{fallback}.init (the {role} starts from it: {role}.init is empty)"

    def _init_fallback(self, role: str) -> str:
        if role == "critic":
            return "reward" if self.reward.type == "model" else ""
        return "actor" if role == "ref" else ""

    def check_paths(self, roles: Optional[tuple[str, ...]] = None) -> None:
        """Check that every input path the run will read exists (after planning, before any work).

        Args:
            roles: the roles whose init checkpoints are read; None = :meth:`roles_used`.

        Raises ConfigError naming the field, the path and what to give instead.
        """
        for name in ("train_path", "eval_path"):
            path = getattr(self.data, name)
            if path and not os.path.exists(path):
                raise ConfigError(
                    f"data.{name}={path!r} does not exist: give an existing jsonl/json/parquet file or a saved HF dataset dir"
                )
        if self.tokenizer.path and not os.path.exists(self.tokenizer.path):
            raise ConfigError(
                f"tokenizer.path={self.tokenizer.path!r} does not exist: give an HF tokenizer dir, tokenizer.json or tokenizer.model"
            )
        roles = self.roles_used() if roles is None else roles
        for role in sorted(roles, key=lambda r: not self.role(r).init):  # a role's own init before a fallback
            path = self.init_of(role)
            if path and not os.path.exists(path):
                raise ConfigError(
                    f"{self.init_field(role)}={path!r} does not exist: give an aligner checkpoint dir or an HF model dir "
                    "(for conf=tiny, run `python -m aligner.sft` and `python -m aligner.rm` first, or `make demo`)"
                )

    def role(self, name: str) -> RoleConfig:
        """The config of role `name` (actor, critic, reward, ref): a :class:`RoleConfig`, whose subclass
        depends on the role (:func:`roles_with_field`); ValueError for other names."""
        if name not in ("actor", "critic", "reward", "ref"):
            raise ValueError(f"unknown role {name!r}: valid roles are actor, critic, reward, ref")
        return getattr(self, name)


def prompt_learning_of(cfg: AlignerConfig) -> Optional[PromptLearningConfig]:
    """cfg.actor.prompt_learning, or None when the actor config has none (a plain TrainableRoleConfig built in code)."""
    return getattr(cfg.actor, "prompt_learning", None)


def roles_with_field(name: str) -> tuple[str, ...]:
    """The model-hosting roles whose schema has the field `name`: ``"type"`` -> ``("reward",)``,
    ``"optim"`` -> ``("actor", "critic", "reward")``, ``"init"`` -> all four; ``()`` for no role's field."""
    schemas = get_type_hints(AlignerConfig)
    return tuple(r for r in MODEL_ROLES if name in {f.name for f in fields(schemas[r])})


def config_yaml(cfg: AlignerConfig) -> str:
    """The config as YAML text (saved beside checkpoints and printed by --cfg)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
