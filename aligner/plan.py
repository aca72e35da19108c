"""`python -m aligner.plan`: print the placement/memory plan for a preset and cluster.

Owns: turning an AlignerConfig into printed plan text and an exit code. The Hydra layer
(aligner.cli) composes the config and calls :func:`aligner.planner.print_plan`, where the
planning lives.
"""

from __future__ import annotations

import sys

from aligner.planner import print_plan


def main(argv=None) -> int:
    """`python -m aligner.plan [conf=PRESET] [cluster.num_nodes=N ...]`: Hydra overrides -> exit code."""
    from aligner.cli import run  # Hydra is imported only by the command line

    return run("plan", print_plan, argv)


if __name__ == "__main__":
    sys.exit(main())
