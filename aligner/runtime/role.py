"""RoleModel: the Ray-free base of every model-hosting role (policy, reference, critic, reward).

Owns: resolving a role's initial weights (an HF model dir, or an aligner run dir whose
``hf/`` export is used), building its TrainRuntime on the role's layout, the ModelRunner
over it, the global loss normalizer across dp, HF export of the gathered weights (with LoRA: the
merged HF checkpoint, plus the PEFT-format adapter in ``<hf dir>/adapter``), and
checkpoint save/load of model + optimizer (resharding, via the runtime).

The model dimensions come from the init checkpoint's config.json when there is one
(a critic or RM may differ from the policy), else from ``cfg.model``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

import torch

from aligner.config import ConfigError, LoraConfig, ModelConfig, OptimConfig, ParallelConfig
from aligner.data.tokenizer import load_tokenizer
from aligner.model.hf import load_hf_model, read_hf_config, save_hf
from aligner.model.llama import build_model
from aligner.nn.lora import is_adapter_key, merged_state_dict, peft_adapter_config, save_peft_adapter
from aligner.parallel.dims import ParallelDims
from aligner.parallel.tensor_parallel import vocab_start
from aligner.runtime.runner import ModelRunner, dp_sum, global_normalizer
from aligner.runtime.train_runtime import TrainRuntime

log = logging.getLogger("aligner")


def resolve_init(path: str) -> Optional[Path]:
    """The HF dir to initialize from: `path` itself if it has config.json, else `path`/hf. None for ""."""
    if not path:
        return None
    p = Path(path)
    for cand in (p, p / "hf"):
        if (cand / "config.json").is_file():
            return cand
    raise ValueError(
        f"init={path!r} is neither an HF model dir (config.json + safetensors) nor an aligner run dir with hf/ inside; "
        "point it at the output_dir of an SFT/RM run or at an HF model dir"
    )


def check_tokenizer_fits(n_tokens: int, init: str, model_cfg: ModelConfig, role: str) -> None:
    """The tokenizer's `n_tokens` must fit the role's vocabulary: the init checkpoint's config.json
    vocab_size when `init` is given, else model.vocab_size. Raises ConfigError naming the field and the fix."""

    hf_dir = resolve_init(init)
    vocab = int(read_hf_config(hf_dir)["vocab_size"]) if hf_dir else model_cfg.vocab_size
    field = f"{role}.init={init!r} (config.json vocab_size)" if hf_dir else "model.vocab_size"
    if n_tokens > vocab:
        raise ConfigError(
            f"{field}={vocab} is smaller than the tokenizer's {n_tokens} tokens: set model.vocab_size="
            f"{n_tokens} or more, or use the tokenizer the model was trained with"
        )


def load_initial_model(init: str, model_cfg: ModelConfig, kind: str, seed: int):
    """(full unsharded model, ModelConfig) from `init`, or a seeded random model of `model_cfg`."""

    hf_dir = resolve_init(init)
    if hf_dir is None:
        return build_model(model_cfg, kind=kind, seed=seed), model_cfg
    model, cfg = load_hf_model(hf_dir, kind=kind)
    return model, cfg


class RoleModel:
    """A role's model on its TP x PP x DP layout with an optimizer (unused by frozen roles).

    Subclasses set ``kind``: "lm" (Policy) or "score" (Critic, RewardModel).

    Args:
        model_cfg: dimensions used when `init` is empty.
        parallel: the role's layout. optim: AdamW + schedule. dims: built ParallelDims.
        total_steps: optimizer steps of the run (LR schedule length). init: HF/run dir or "".
        seed: init seed for random weights.
        lora: LoRA adapters on the role's linears (rank 0 / None: full fine-tuning; see aligner.nn.lora).
        micro_batch_tokens: ``trainer.micro_batch_tokens`` (0: row-count micro-batches; > 0: micro-batches
            by that token budget, :class:`aligner.runtime.runner.ModelRunner`).
    """

    kind: str = ""

    def __init__(
        self,
        model_cfg: ModelConfig,
        parallel: ParallelConfig,
        optim: OptimConfig,
        dims: ParallelDims,
        total_steps: int = 1,
        init: str = "",
        seed: int = 0,
        lora: Optional[LoraConfig] = None,
        micro_batch_tokens: int = 0,
    ):
        kind = self.kind
        if kind not in ("lm", "score"):
            raise TypeError(f"{type(self).__name__}.kind={kind!r}: a RoleModel subclass sets kind to 'lm' or 'score'")
        full, self.model_cfg = load_initial_model(init, model_cfg, kind, seed)
        self.dims, self.parallel = dims, parallel
        full = self.prepare_model(full, seed)
        self.init = init
        self.runtime = TrainRuntime(self.model_cfg, kind, parallel, optim, dims, max(1, total_steps), seed=seed, model=full, lora=lora)
        self.lora = self.runtime.lora
        self.runner = ModelRunner(self.runtime, dims, micro_batch_tokens)
        self.vocab_start = vocab_start(self.runtime.module) if kind == "lm" else 0

    def prepare_model(self, full: torch.nn.Module, seed: int) -> torch.nn.Module:
        """Hook on the full model before it is parallelized (the optimizer takes its requires_grad
        parameters); the default returns it unchanged."""
        return full

    @property
    def tp_group(self):
        return self.dims.tp_group

    def normalizer(self, local_count: float | torch.Tensor) -> float:
        """Per-rank loss divisor: global count over dp / dp_size (see aligner.runtime.runner)."""
        return global_normalizer(local_count, self.dims)

    def dp_mean(self, local_sum: float, local_count: float) -> float:
        """Global mean of a quantity summed per rank: dp_sum(sum) / dp_sum(count)."""
        return dp_sum(local_sum, self.dims) / max(dp_sum(local_count, self.dims), 1e-12)

    # ---- weights ------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every HF-named full tensor (collective over the role; same result on every rank)."""
        return self.runtime.full_state_dict()

    def export_hf(self, out_dir: str, tokenizer_path: str = "", extra_files: Optional[dict[str, dict]] = None) -> Optional[str]:
        """Write the gathered weights as an HF dir (rank 0 writes; collective), with the tokenizer at
        `tokenizer_path` saved beside them when given. Returns the path on rank 0, None elsewhere."""

        sd = {k: v for k, v in self.full_state_dict().items() if not k.startswith("model.prompt.")}  # base weights only
        if self.dims.rank != 0:
            return None
        tok = None
        if tokenizer_path:
            tok = load_tokenizer(tokenizer_path)
        path = save_hf(self._merged(sd), self.model_cfg, out_dir, kind=self.kind, tokenizer=tok)
        if self.lora is not None:
            self._export_adapter(sd, Path(path) / "adapter")
        for name, obj in (extra_files or {}).items():
            tmp = Path(path) / f".{name}.tmp"
            tmp.write_text(json.dumps(obj, indent=2))
            os.replace(tmp, Path(path) / name)
        return str(path)

    def _merged(self, full_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`full_sd` with LoRA adapters folded into their weights (unchanged without LoRA)."""
        return full_sd if self.lora is None else merged_state_dict(full_sd, self.lora.alpha / self.lora.rank)

    def _export_adapter(self, full_sd: dict[str, torch.Tensor], out: Path) -> None:
        """PEFT-format adapter into `out` (adapter_config.json + adapter_model.safetensors). Its base is
        the role's init HF dir; with random init weights the base is written to `out`/base first."""
        base = resolve_init(self.init)
        if base is None:
            base = save_hf({k: v for k, v in full_sd.items() if not is_adapter_key(k)}, self.model_cfg, out / "base", kind=self.kind)
        lo = self.lora
        cfg = peft_adapter_config(lo.rank, lo.alpha, lo.dropout, lo.target_modules, str(Path(base).resolve()), kind=self.kind)
        save_peft_adapter(full_sd, str(out), cfg)

    def save(self, role_dir: str) -> None:
        """This role's checkpoint (model + optimizer + schedule) into `role_dir` (collective)."""
        self.runtime.save(role_dir)

    def load(self, role_dir: str) -> None:
        """Restore what :meth:`save` wrote (any source layout)."""
        self.runtime.load(role_dir)
