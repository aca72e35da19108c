"""Rollout: the RolloutEngine interface, its three backends, the weight path and the agent endpoint.

The tree, named as vLLM, SGLang and verl name the same parts::

    rollout/
      base.py           RolloutEngine (generate, update_weights / finish_weight_update), Generation
      torch_engine/     the ``torch`` backend: engine, schedulers, KV caches, sampling, CUDA graphs,
                        CPU kernels (csrc/: C sources, as vLLM's csrc/) and their per-machine tuning
      trtllm_engine.py  the ``trtllm`` backend (TensorRT-LLM)
      vllm_engine.py    the ``vllm`` backend
      weight_sync/      the weight path into the engines: refit in place (colocated), broadcast
                        across worker groups (split placement), staging between decode steps
      agent/            the OpenAI-compatible agent endpoint, its token records, the agent runner

Why these names: each backend is one unit ``<backend>_engine`` named after its
``rollout.backend`` value, side by side as verl's ``workers/rollout/`` keeps its vLLM, SGLang and
HF rollouts; inside the torch engine ``scheduler``, ``kv_cache`` and ``sampling`` are the words
vLLM (``v1/core/sched/scheduler.py``, ``kv_cache_manager.py``, ``v1/sample/``) and SGLang
(``managers/scheduler.py``, ``mem_cache/``, ``sampling/``) use; ``weight_sync`` is SGLang's
(``srt/weight_sync/``) and verl's / OpenRLHF's word for moving trainer weights into engines, and
``refit`` NeMo-RL's for the colocated case; ``agent`` holds what vLLM and SGLang keep under
``entrypoints/openai/`` plus the recording RL needs. Each sub-package's ``__init__`` imports
nothing, so a process loads only the parts it uses.

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
    from aligner.rollout.torch_engine.engine import TorchEngine

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
