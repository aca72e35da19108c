"""Config fields renamed in this release: their old names still work on the command line for one release.

A command-line override of an old name (``parallel.num_microbatches=4``, ``actor.parallel.num_microbatches=4``)
sets the new field and logs one line naming the new name; a YAML file that still has the old name is refused by
the composition with the new name in the error (:func:`renamed_hint`).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

# old field name -> new field name (the last part of a dotted key, in every section that has the field)
RENAMED = {
    "num_microbatches": "num_micro_batches",  # one spelling of micro-batch across the config (micro_batch_size, ...)
}


def renamed_overrides(overrides: Sequence[str], warn: Optional[Callable[[str], None]] = None) -> list[str]:
    """`overrides` (Hydra ``key=value`` strings) with every renamed field's old name replaced by its new one.

    `warn`, when given, is called once per replaced override with the one-line deprecation message:
    ``parallel.num_microbatches is deprecated: it is now parallel.num_micro_batches (the old name is accepted until
    the next release)``. Overrides that set no renamed field come back unchanged, in order."""
    out = []
    for o in overrides:
        key, eq, value = o.partition("=")
        head, dot, last = key.rpartition(".")
        if eq and last in RENAMED:
            new_key = f"{head}{dot}{RENAMED[last]}"
            if warn is not None:
                warn(f"{key} is deprecated: it is now {new_key} (the old name is accepted until the next release)")
            o = f"{new_key}={value}"
        out.append(o)
    return out


def renamed_hint(message: str) -> str:
    """``"; num_microbatches is now num_micro_batches"`` when the error `message` names a renamed field's old name
    (a YAML file that sets it), else ""."""
    return "".join(f"; {old} is now {new}" for old, new in RENAMED.items() if old in message)
