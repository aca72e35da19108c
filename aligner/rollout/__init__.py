"""Rollout engines (the RolloutEngine interface, TorchEngine, TrtllmEngine, VllmEngine) and refit.

Owns the backend registry: :func:`build_engine` maps ``rollout.backend`` to an engine
class. Each backend's module is imported by an import statement inside its factory, so it
loads only when that backend is asked for (``trtllm``: TensorRT-LLM is a GPU-only optional
extra) and static tools (the layering test, IDEs, type checkers) still see the edge; an unknown
backend raises ValueError listing the valid ones.
"""

from __future__ import annotations

from typing import Any, Callable

from aligner.rollout.base import Generation, RolloutEngine, mismatch_metrics


def _torch_engine() -> type:
    from aligner.rollout.torch_engine import TorchEngine

    return TorchEngine


def _trtllm_engine() -> type:
    # importable without tensorrt_llm: the engine imports it when built, and raises ImportError
    # with the install command when it is missing
    from aligner.rollout.trtllm_engine import TrtllmEngine

    return TrtllmEngine


def _vllm_engine() -> type:
    # importable without vllm: the engine imports it when built, and raises ImportError naming the extra
    from aligner.rollout.vllm_engine import VllmEngine

    return VllmEngine


# backend name -> the function that imports and returns its engine class
_ENGINE_REGISTRY: dict[str, Callable[[], type]] = {"torch": _torch_engine, "trtllm": _trtllm_engine, "vllm": _vllm_engine}


def engine_class(backend: str) -> type:
    """The engine class registered as `backend` ("torch" | "trtllm" | "vllm"); ValueError for other names."""
    if backend not in _ENGINE_REGISTRY:
        raise ValueError(f"rollout.backend={backend!r} is unknown: valid backends are {', '.join(sorted(_ENGINE_REGISTRY))}")
    return _ENGINE_REGISTRY[backend]()


def build_engine(backend: str, *args: Any, **kwargs: Any) -> RolloutEngine:
    """Construct the engine registered as `backend` with the engine's own arguments.

    torch: ``build_engine("torch", model, eos_token_id=..., tp_group=..., pp_group=...)``.
    trtllm: ``build_engine("trtllm", model_dir, rollout_cfg, ...)``; ImportError with the
    install command when tensorrt_llm is missing.
    vllm: ``build_engine("vllm", model_dir, max_seq_len=..., ...)``; ImportError naming the extra when vllm is missing.
    """
    engine = engine_class(backend)
    return engine(*args, **kwargs)


__all__ = ["Generation", "RolloutEngine", "build_engine", "engine_class", "mismatch_metrics"]
