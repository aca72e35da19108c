"""`python -m aligner.sft`: supervised fine-tuning of the policy (the actor role).

The command line only: Hydra composes the config (:mod:`aligner.cli`) and
:class:`aligner.trainers.sft.SFTTrainer` runs it on the training loop (:mod:`aligner.trainers.loop`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from aligner import cli
from aligner.trainers.sft import run_sft


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m aligner.sft [conf=PRESET] [key=value ...]` -> exit code (2 for config/user errors)."""
    return cli.run("sft", run_sft, argv)


if __name__ == "__main__":
    raise SystemExit(main())
