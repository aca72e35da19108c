"""Rollout engines (the RolloutEngine interface, TorchEngine, TrtllmEngine) and refit.

Owns the backend registry: :func:`build_engine` maps ``rollout.backend`` to an engine
class. ``trtllm`` is imported lazily (TensorRT-LLM is a GPU-only optional extra); an
unknown backend raises ValueError listing the valid ones.
"""

from __future__ import annotations

import importlib
from typing import Any

from aligner.rollout.base import Generation, RolloutEngine, mismatch_metrics

# backend name -> (module, class, install hint when the import fails)
_ENGINE_REGISTRY: dict[str, tuple[str, str, str]] = {
    "torch": ("aligner.rollout.torch_engine", "TorchEngine", ""),
    "trtllm": (
        "aligner.rollout.trtllm_engine",
        "TrtllmEngine",
        "TensorRT-LLM is not installed: `pip install aligner[trtllm]` (tensorrt-llm>=1.2,<2 from "
        "NVIDIA's index: pip install tensorrt-llm --extra-index-url https://pypi.nvidia.com) on a CUDA machine",
    ),
}


def engine_class(backend: str) -> type:
    """The engine class registered as `backend` ("torch" | "trtllm"); ValueError for other names."""
    if backend not in _ENGINE_REGISTRY:
        raise ValueError(f"rollout.backend={backend!r} is unknown: valid backends are {', '.join(sorted(_ENGINE_REGISTRY))}")
    module, cls, _ = _ENGINE_REGISTRY[backend]
    return getattr(importlib.import_module(module), cls)


def build_engine(backend: str, *args: Any, **kwargs: Any) -> RolloutEngine:
    """Construct the engine registered as `backend` with the engine's own arguments.

    torch: ``build_engine("torch", model, eos_token_id=..., tp_group=..., pp_group=...)``.
    trtllm: ``build_engine("trtllm", model_dir, rollout_cfg, ...)``; ImportError with the
    install command when tensorrt_llm is missing.
    """
    engine = engine_class(backend)
    return engine(*args, **kwargs)


__all__ = ["Generation", "RolloutEngine", "build_engine", "engine_class", "mismatch_metrics"]
