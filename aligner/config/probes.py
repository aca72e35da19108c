"""Package probes, run where the config is validated (before Ray starts): whether the packages a
chosen backend needs are importable here, next to the other checks of that backend."""

from __future__ import annotations

import importlib.util
import sys
from typing import TYPE_CHECKING

from aligner.config.common import LOGGER_PACKAGES, _check

if TYPE_CHECKING:
    from aligner.config.run import AlignerConfig


def check_trtllm(cfg: AlignerConfig) -> None:
    """What ``rollout.backend=trtllm`` needs, checked before Ray starts (ppo stage only).

    In order: CUDA workers for the group that runs the engines (the actor's; with
    ``rollout.placement=split`` the rollout group's, ``rollout.resources``), a 16-bit rollout dtype
    (TensorRT-LLM's kernels do not dispatch float32, NVIDIA/TensorRT-LLM#5260), the continuous scheduler
    (TensorRT-LLM batches in flight; ``rollout.scheduler=static`` is aligner's engine's), engine replicas that
    fit one node (tp_size * pp_size divides that group's gpus_per_node: a replica's workers are placed
    in the node bundle of its owner rank and read the weights through CUDA IPC, which is node-local),
    and last an importable ``tensorrt_llm``.
    """
    split = cfg.rollout.placement == "split"
    where, res = ("rollout.resources", cfg.rollout.resources) if split else ("actor.resources", cfg.actor.resources)
    group = "the rollout group's" if split else "the actor's"
    gpus, rp = res.gpus_per_node, cfg.rollout.parallel
    _check(
        gpus >= 1,
        f"{where}.gpus_per_node",
        gpus,
        f"rollout.backend=trtllm runs TensorRT-LLM on {group} CUDA GPUs: give it GPUs "
        f"({where}.gpus_per_node >= 1 and cluster.gpus_per_node), or use rollout.backend=torch",
    )
    _check(
        cfg.rollout.dtype in ("bfloat16", "float16"),
        "rollout.dtype",
        cfg.rollout.dtype,
        "TensorRT-LLM's kernels do not run float32 (NVIDIA/TensorRT-LLM#5260): set rollout.dtype=bfloat16 "
        "(or float16) with rollout.backend=trtllm",
    )
    _check(
        cfg.rollout.scheduler == "continuous",
        "rollout.scheduler",
        cfg.rollout.scheduler,
        "TensorRT-LLM batches every request in flight (rollout.backend=trtllm): aligner's static scheduler is its "
        "own engine's; set rollout.scheduler=continuous (rollout.max_batch_size caps the requests in flight)",
    )
    engine_gpus = rp.tp_size * rp.pp_size
    _check(
        gpus % engine_gpus == 0,
        "rollout.parallel.tp_size",
        rp.tp_size,
        f"rollout.parallel.tp_size x pp_size = {engine_gpus} must divide {where}.gpus_per_node={gpus}: "
        "a TensorRT-LLM engine replica lives on one node's GPUs",
    )
    _check(
        importlib.util.find_spec("tensorrt_llm") is not None,
        "rollout.backend",
        cfg.rollout.backend,
        f"tensorrt_llm is not importable by {sys.executable}: pip install 'aligner[trtllm]' "
        "(tensorrt-llm>=1.2,<2 from https://pypi.nvidia.com) on the CUDA machines, or use rollout.backend=torch",
    )


def check_loggers(cfg: AlignerConfig) -> None:
    """The package of each logger in ``trainer.loggers`` (tensorboard, wandb, mlflow) is importable
    here, checked with ``importlib.util.find_spec`` (nothing is imported) before Ray starts. The
    names themselves are checked by :meth:`aligner.config.run.TrainerConfig.validate`."""
    for name in cfg.trainer.loggers:
        module, dist = LOGGER_PACKAGES.get(name, (None, None))
        _check(
            module is None or importlib.util.find_spec(module) is not None,
            "trainer.loggers",
            list(cfg.trainer.loggers),
            f"{name} needs the {module} package, which is not importable by {sys.executable}: "
            f"pip install {dist} (or pip install 'aligner[loggers]'), or remove {name} from trainer.loggers",
        )
