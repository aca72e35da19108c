"""`python -m aligner.plan`: print the placement/memory plan for a preset and cluster.

Owns: turning an AlignerConfig into printed plan text and an exit code. The Hydra layer
(aligner.cli) composes the config and calls :func:`main_from_config`; the planning itself
lives in aligner.planner.
"""

from __future__ import annotations

import sys

from aligner.config import AlignerConfig
from aligner.planner import PlanError, format_plan, make_plan


def main_from_config(cfg: AlignerConfig) -> int:
    """Print the plan for cfg (stdout) and return 0, or print why nothing fits and the smallest
    cluster that would (stderr) and return 1."""
    try:
        plan = make_plan(cfg)
    except PlanError as err:
        print(f"aligner.plan: {err}", file=sys.stderr)
        return 1
    print(format_plan(plan))
    return 0


def main(argv=None) -> int:
    """`python -m aligner.plan [conf=PRESET] [cluster.num_nodes=N ...]`: Hydra overrides -> exit code."""
    from aligner.cli import run  # Hydra is imported only by the command line

    return run("plan", main_from_config, argv)


if __name__ == "__main__":
    sys.exit(main())
