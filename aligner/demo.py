"""`python -m aligner.demo`: the embedded default, SFT -> RM -> PPO on the built-in task (CPU, minutes).

Runs the three stage entry points in order with conf=tiny, each writing to
``<root>/{sft,rm,ppo}`` (root: outputs/tiny, or the first argument ``output_dir=DIR``),
wires each stage's output into the next (RM and critic from the SFT policy / RM, reference
from the SFT policy), and ends with the PPO run's table: held-out accuracy of the SFT and
PPO policies, mean RM score, KL to the reference. Extra ``key=value`` arguments go to
every stage (e.g. ``trainer.progress=false``). The stages share one Ray instance, started here
(or the cluster that ``cluster.address`` / RAY_ADDRESS names), as a stage run joins one already up.

Every stage gets ``overwrite=true``, so running the demo again (a second ``make demo``)
deletes the previous demo's outputs under <root>/{sft,rm,ppo} and starts over, where a plain
stage run refuses an output_dir that holds a previous run (aligner.run_ops.run_dir). Pass
``overwrite=false`` (refuse instead) or ``resume=true`` (continue each stage) to change that.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence


def _start_ray(overrides: list[str]):
    """One Ray instance for the three stages (each stage joins it and leaves it running, as a stage
    run joins any Ray instance already up): a local instance costs seconds to start and stop.
    Returns its RayInfo, or None when the overrides do not load (the SFT stage, run first, reports why)."""
    from aligner.cli import load_config
    from aligner.errors import ConfigError, UserError
    from aligner.workers.ray_runtime import init_ray

    try:
        cfg = load_config("sft", ["conf=tiny", *overrides])
    except (ConfigError, UserError):
        return None
    return init_ray(cfg.cluster)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from aligner import ppo, rm, sft

    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(
            "usage: python -m aligner.demo [output_dir=DIR] [key=value ...]\n"
            "SFT -> RM -> PPO with conf=tiny on the built-in task, into DIR/{sft,rm,ppo} (default outputs/tiny);\n"
            "each key=value goes to every stage (see python -m aligner.sft --cfg job for the fields)"
        )
        return 0
    root = Path("outputs/tiny")
    rest = []
    for a in args:
        if a.startswith("output_dir="):
            root = Path(a.split("=", 1)[1])
        else:
            rest.append(a)
    if not any(a.startswith(("overwrite=", "resume=")) for a in rest):
        rest.insert(0, "overwrite=true")  # a second demo replaces the first (see the module docstring)
    stages = [
        ("sft", sft.main, [f"output_dir={root / 'sft'}"]),
        ("rm", rm.main, [f"output_dir={root / 'rm'}", f"reward.init={root / 'sft'}"]),
        ("ppo", ppo.main, [f"output_dir={root / 'ppo'}", f"actor.init={root / 'sft'}", f"reward.init={root / 'rm'}"]),
    ]
    times = {}
    ray_info = _start_ray(rest)
    try:
        for name, fn, extra in stages:
            print(f"\n=== aligner demo: {name} ===", flush=True)
            t0 = time.perf_counter()
            code = fn(["conf=tiny", *extra, *rest])
            times[name] = time.perf_counter() - t0
            if code != 0:
                print(f"aligner demo: stage {name} failed with exit code {code}", file=sys.stderr)
                return code
    finally:
        if ray_info is not None and ray_info.started:
            from aligner.workers.ray_runtime import shutdown_ray

            shutdown_ray()
    summary = json.loads((root / "ppo" / "summary.json").read_text())
    print("\n=== aligner demo: results (conf=tiny, built-in addition task) ===")
    print(ppo.summary_table(summary))
    print(
        "stage wall times: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in times.items()) + f"; total {sum(times.values()) / 60:.1f} min"
    )
    print(f"reports: {root / 'ppo' / 'ppo_report.png'}, metrics: {root}/*/metrics.jsonl")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
