"""`python -m aligner.kto`: KTO (Ethayarajh et al. 2024) of the policy (the actor role) on unpaired labelled completions.

The command line only: Hydra composes the config (:mod:`aligner.cli`) and
:class:`aligner.trainers.kto.KTOTrainer` runs it on the training loop (:mod:`aligner.trainers.loop`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from aligner import cli
from aligner.trainers.kto import run_kto


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m aligner.kto [conf=PRESET] [key=value ...]` -> exit code (2 for config/user errors)."""
    return cli.run("kto", run_kto, argv)


if __name__ == "__main__":
    raise SystemExit(main())
