"""`python -m aligner.rs`: rejection sampling (best-of-N responses by the reward, fine-tuned with the SFT loss).

The command line only: Hydra composes the config (:mod:`aligner.cli`) and
:class:`aligner.trainers.rs.RSTrainer` runs it on the training loop (:mod:`aligner.trainers.loop`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from aligner import cli
from aligner.trainers.rs import run_rs


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m aligner.rs [conf=PRESET] [key=value ...]` -> exit code (2 for config/user errors)."""
    return cli.run("rs", run_rs, argv)


if __name__ == "__main__":
    raise SystemExit(main())
