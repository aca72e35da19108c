"""Config fields renamed or removed in this release.

A renamed field's old name still works on the command line for one release: an override of it
(``actor.parallel.OLD=4``) sets the new field and logs one line naming the new name; a YAML file that still has
the old name is refused by the composition with the new name in the error (:func:`renamed_hint`). A removed
field is refused wherever it is set, the error saying what to set instead.
"""

from __future__ import annotations

import re
from typing import Callable, Optional, Sequence

# old field name -> new field name (the last part of a dotted key, in every section that has the field)
RENAMED: dict[str, str] = {}

# removed field name (the last part of a dotted key) -> what to set instead
_MICRO_BATCH_COUNT = (
    "the micro-batches follow from the batch: each dp rank's share in micro-batches of trainer.micro_batch_size rows "
    "(or trainer.micro_batch_tokens tokens); set trainer.micro_batch_size"
)
REMOVED = {
    "num_micro_batches": _MICRO_BATCH_COUNT,  # parallel.num_micro_batches: read by nothing (it never set the count)
    "num_microbatches": _MICRO_BATCH_COUNT,  # its earlier spelling
}


def renamed_overrides(overrides: Sequence[str], warn: Optional[Callable[[str], None]] = None) -> list[str]:
    """`overrides` (Hydra ``key=value`` strings) with every renamed field's old name replaced by its new one.

    `warn`, when given, is called once per replaced override with the one-line deprecation message:
    ``actor.parallel.OLD is deprecated: it is now actor.parallel.NEW (the old name is accepted until the next
    release)``. Overrides that set no renamed field come back unchanged, in order."""
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
    """``"; OLD is now NEW"`` when the error `message` names a renamed field's old name (a YAML file that sets
    it), ``"; F was removed: <what to set instead>"`` when it names a removed field F, else ""."""
    named = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", message))
    renamed = "".join(f"; {old} is now {new}" for old, new in RENAMED.items() if old in named)
    return renamed + "".join(f"; {old} was removed: {fix}" for old, fix in REMOVED.items() if old in named)
