"""`python -m aligner.rm`: a Bradley-Terry reward model on preference pairs (the reward role).

The command line only: Hydra composes the config (:mod:`aligner.cli`) and
:class:`aligner.trainers.rm.RMTrainer` runs it on the training loop (:mod:`aligner.trainers.loop`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from aligner import cli
from aligner.trainers.rm import run_rm


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m aligner.rm [conf=PRESET] [key=value ...]` -> exit code (2 for config/user errors)."""
    return cli.run("rm", run_rm, argv)


if __name__ == "__main__":
    raise SystemExit(main())
