"""`python -m aligner.spin`: SPIN (Chen et al. 2024): self-play fine-tuning of the policy (the actor role) on SFT data.

The command line only: Hydra composes the config (:mod:`aligner.cli`) and
:class:`aligner.trainers.spin.SPINTrainer` runs it on the training loop (:mod:`aligner.trainers.loop`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from aligner import cli
from aligner.trainers.spin import run_spin


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m aligner.spin [conf=PRESET] [key=value ...]` -> exit code (2 for config/user errors)."""
    return cli.run("spin", run_spin, argv)


if __name__ == "__main__":
    raise SystemExit(main())
