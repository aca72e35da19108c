"""`python -m aligner.dpo`: direct preference optimization of the policy (the actor role).

The command line only: Hydra composes the config (:mod:`aligner.cli`) and
:class:`aligner.trainers.dpo.DPOTrainer` runs it on the training loop (:mod:`aligner.trainers.loop`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from aligner import cli
from aligner.trainers.dpo import run_dpo


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m aligner.dpo [conf=PRESET] [key=value ...]` -> exit code (2 for config/user errors)."""
    return cli.run("dpo", run_dpo, argv)


if __name__ == "__main__":
    raise SystemExit(main())
