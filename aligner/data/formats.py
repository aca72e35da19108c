"""Dataset formats: reading files, validating rows, detecting the format, normalizing records.

Owns: the format table (:data:`FORMATS`), auto-detection, per-row validation with
``file:line`` errors, ``skip_invalid`` accounting, and the normalized record every later
stage consumes (:func:`load_records`).

Files: ``.jsonl`` is parsed here line by line (so every error names the exact line: invalid
JSON, non-UTF-8 bytes, a row that is not an object); ``.json`` (a list of rows, or an
object holding one list), ``.parquet`` and saved HF dataset dirs (``save_to_disk``) are read
through HF ``datasets``; their rows are named ``file:N`` with N the 1-based row number.

A normalized record is a dict:

- ``source``: "file:line" of the row (used in every later error message);
- ``prompt``: str, or ``messages``: list of {"role", "content"} (chat), never both;
- ``response``: str | None (the SFT target; None for RL-only rows);
- ``chosen`` / ``rejected``: str | None (pairs; for chat-less formats the text after the prompt);
- ``metadata``: dict: extra row fields (e.g. the task's "answer") and format-derived ones
  (gsm8k: "answer" = the final answer after ####), passed to rule rewards.

Simplification: HH dialogues are split at the last "\\n\\nAssistant:" of each side; the two
sides must share that prompt (rows where they do not are invalid). The HH prompt keeps the
raw "\\n\\nHuman: ... \\n\\nAssistant:" text (no chat template), as in the HH papers.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

log = logging.getLogger("aligner.data")

# format name -> required fields (str-valued unless noted). Extra fields are kept as metadata.
FORMATS: dict[str, tuple[str, ...]] = {
    "prompt": ("prompt",),
    "sft": ("prompt", "response"),
    "chat": ("messages",),
    "pairs": ("prompt", "chosen", "rejected"),
    "hh": ("chosen", "rejected"),
    "gsm8k": ("question", "answer"),
}
# which record kinds each format can supply: sft (prompt + response), pairs, prompt (RL)
KINDS: dict[str, tuple[str, ...]] = {
    "prompt": ("prompt",),
    "sft": ("sft", "prompt"),
    "chat": ("sft", "prompt"),
    "pairs": ("pairs", "sft", "prompt"),
    "hh": ("pairs", "sft", "prompt"),
    "gsm8k": ("sft", "prompt"),
}
ROLES = ("system", "user", "assistant")
_HH_ASSISTANT = "\n\nAssistant:"
_HH_HUMAN = "\n\nHuman:"
_MAX_REASONS = 5


class RowError(ValueError):
    """One invalid row; the message is "<file>:<line>: <what>: <fix>"."""


@dataclass
class LoadResult:
    """Records of one file plus what was skipped (``skip_invalid``) and the detected format."""

    records: list[dict]
    format: str
    path: str
    num_skipped: int = 0
    reasons: list[str] = field(default_factory=list)  # the first few skip reasons, "file:line: ..."


def formats_help() -> str:
    """One line per format: its name and required fields (used in error messages)."""
    return "; ".join(f"{name}: {{{', '.join(repr(f) for f in fields)}}}" for name, fields in FORMATS.items())


def detect_format(keys: set, where: str) -> str:
    """The format whose required fields are all in `keys`, preferring the most specific.

    Raises ValueError naming `where` when no format or more than one unrelated format matches.
    """
    cands = [f for f, req in FORMATS.items() if set(req) <= keys]
    cands = [f for f in cands if not any(set(FORMATS[f]) < set(FORMATS[g]) for g in cands)]
    if len(cands) == 1:
        return cands[0]
    what = "is ambiguous between " + ", ".join(cands) if cands else "matches no format"
    raise ValueError(
        f"{where}: fields {sorted(keys)} {what}: set data.format to one of "
        f"{', '.join(FORMATS)} (formats and their fields: {formats_help()})"
    )


def _iter_jsonl(path: str) -> Iterator[tuple[str, Any]]:
    """(source "file:line", parsed row or a RowError) for each non-blank line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, RowError(f"{where}: line is not valid UTF-8 ({e.reason} at byte {e.start}): re-encode the file as UTF-8")
                continue
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                yield where, RowError(f"{where}: invalid JSON ({e.msg} at column {e.colno}): write one JSON object per line")
                continue
            yield where, row


def _iter_rows(path: str) -> Iterator[tuple[str, Any]]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"data file {path!r} does not exist: give a jsonl/json/parquet file or a saved HF dataset dir")
    if os.path.isdir(path):
        import datasets

        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ValueError(f"{path}: dataset dict has splits {list(ds)} but no 'train': point data.*_path at one split's dir")
            ds = ds["train"]
        rows: Any = ds
    elif path.endswith(".jsonl"):
        yield from _iter_jsonl(path)
        return
    elif path.endswith(".json"):
        import datasets

        with open(path, "rb") as f:
            head = f.read(4096).lstrip()
        if head[:1] == b"{":  # a dict holding the rows under one key ({"data": [...]})
            with open(path, encoding="utf-8") as f:
                obj = json.load(f)
            lists = [v for v in obj.values() if isinstance(v, list)]
            if len(lists) != 1:
                raise ValueError(f"{path}: a .json file must hold a list of rows (or an object with one list): use jsonl instead")
            rows = lists[0]
        else:
            rows = datasets.Dataset.from_json(path)
    elif path.endswith(".parquet"):
        import datasets

        rows = datasets.Dataset.from_parquet(path)
    else:
        raise ValueError(f"{path}: unknown data file type: use .jsonl, .json, .parquet or a saved HF dataset dir")
    for i, row in enumerate(rows, start=1):
        yield f"{path}:{i}", row


def _text(row: dict, name: str, where: str, allow_empty: bool = False) -> str:
    if name not in row or row[name] is None:
        raise RowError(f"{where}: field {name!r} is missing: every row of this format needs {name!r}")
    v = row[name]
    if not isinstance(v, str):
        raise RowError(f"{where}: field {name!r} must be a string, got {type(v).__name__} {v!r:.40}: quote the value")
    if not allow_empty and not v.strip():
        raise RowError(f"{where}: field {name!r} is empty: give non-empty text or drop the row")
    return v


def _messages(row: dict, where: str) -> list[dict]:
    msgs = row.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RowError(f"{where}: field 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RowError(f"{where}: field 'messages[{i}].role' must be one of {', '.join(ROLES)}, got {m!r:.60}")
        out.append({"role": m["role"], "content": _text(m, "content", f"{where}: messages[{i}]")})
    return out


def split_hh(text: str, where: str, name: str) -> tuple[str, str]:
    """(prompt ending in "\\n\\nAssistant:", final assistant response) of an HH dialogue."""
    cut = text.rfind(_HH_ASSISTANT)
    if cut < 0 or _HH_HUMAN not in text[:cut]:
        raise RowError(f"{where}: field {name!r} has no '\\n\\nHuman:' ... '\\n\\nAssistant:' turns: not an Anthropic HH row")
    prompt, response = text[: cut + len(_HH_ASSISTANT)], text[cut + len(_HH_ASSISTANT) :]
    return prompt, response


def gsm8k_final_answer(answer: str) -> Optional[str]:
    """The final answer after "####" with commas and spaces removed, or None if absent."""
    if "####" not in answer:
        return None
    return answer.rsplit("####", 1)[1].strip().replace(",", "").replace(" ", "")


def normalize_row(fmt: str, row: Any, where: str) -> dict:
    """One raw row of format `fmt` -> a normalized record (see module docstring); RowError if invalid."""
    if not isinstance(row, dict):
        raise RowError(f"{where}: row must be a JSON object, got {type(row).__name__}: write one object per line")
    rec: dict = {"source": where, "response": None, "chosen": None, "rejected": None}
    required = FORMATS[fmt]
    meta = {k: v for k, v in row.items() if k not in required}
    if fmt in ("prompt", "sft", "pairs"):
        rec["prompt"] = _text(row, "prompt", where)
        if fmt == "sft":
            rec["response"] = _text(row, "response", where)
        if fmt == "pairs":
            rec["chosen"], rec["rejected"] = _text(row, "chosen", where), _text(row, "rejected", where)
    elif fmt == "chat":
        msgs = _messages(row, where)
        if msgs[-1]["role"] == "assistant":
            rec["messages"], rec["response"] = msgs, msgs[-1]["content"]
        else:
            rec["messages"] = msgs
    elif fmt == "hh":
        pc, chosen = split_hh(_text(row, "chosen", where), where, "chosen")
        pr, rejected = split_hh(_text(row, "rejected", where), where, "rejected")
        if pc != pr:
            raise RowError(f"{where}: fields 'chosen' and 'rejected' do not share the dialogue before the last assistant turn")
        if not chosen.strip() or not rejected.strip():
            raise RowError(f"{where}: field {'chosen' if not chosen.strip() else 'rejected'!r} has an empty final assistant turn")
        rec.update(prompt=pc, chosen=chosen, rejected=rejected, response=chosen)
    elif fmt == "gsm8k":
        rec["prompt"] = _text(row, "question", where)
        rec["response"] = _text(row, "answer", where)
        final = gsm8k_final_answer(rec["response"])
        if not final:
            raise RowError(f"{where}: field 'answer' has no final answer after '####': end the answer with '#### <number>'")
        meta["answer"] = final
    else:  # pragma: no cover - FORMATS and this function are edited together
        raise AssertionError(fmt)
    if fmt == "pairs":  # pairs can train SFT on the chosen answer
        rec["response"] = rec["chosen"]
    rec["metadata"] = meta
    return rec


def load_records(path: str, fmt: str = "auto", kind: Optional[str] = None, skip_invalid: bool = False) -> LoadResult:
    """Read, validate and normalize every row of `path`.

    fmt: a name in :data:`FORMATS` or "auto" (detected from the first valid row's fields and
        logged on the "aligner.data" logger).
    kind: when given ("sft", "pairs" or "prompt"), the format must be able to supply it
        (ValueError otherwise) and rows unusable for it (e.g. a chat row with no assistant
        turn for sft) are invalid.
    skip_invalid: skip invalid rows, counting them (``num_skipped``) and keeping the first
        few reasons; otherwise the first invalid row raises ValueError "file:line: ...".

    Raises FileNotFoundError for a missing path; ValueError for unknown/ambiguous formats,
    invalid rows (unless skipped) and files with no valid rows.
    """
    if fmt != "auto" and fmt not in FORMATS:
        raise ValueError(f"data.format={fmt!r} is unknown: valid formats are auto, {', '.join(FORMATS)}")
    if fmt != "auto":
        _check_kind(fmt, kind, path)
    records: list[dict] = []
    reasons: list[str] = []
    skipped = 0
    for where, row in _iter_rows(path):
        try:
            if isinstance(row, RowError):
                raise row
            if fmt == "auto":
                if not isinstance(row, dict):
                    raise RowError(f"{where}: row must be a JSON object, got {type(row).__name__}")
                fmt = detect_format(set(row), where)
                log.info("data: %s detected as format %r (fields %s)", path, fmt, ", ".join(FORMATS[fmt]))
                _check_kind(fmt, kind, path)
            rec = normalize_row(fmt, row, where)
            if kind == "sft" and rec["response"] is None:
                raise RowError(f"{where}: the row has no response (chat: no final assistant turn) to train SFT on")
            records.append(rec)
        except RowError as e:
            if not skip_invalid:
                raise
            skipped += 1
            if len(reasons) < _MAX_REASONS:
                reasons.append(str(e))
    if fmt == "auto":
        raise ValueError(f"{path}: no valid rows to detect the format from: check the file (or set data.format)")
    _check_kind(fmt, kind, path)
    if skipped:
        log.warning("data: skipped %d invalid rows of %s (data.skip_invalid=true); first: %s", skipped, path, " | ".join(reasons))
    if not records:
        raise ValueError(f"{path}: no valid rows ({skipped} skipped; first reasons: {' | '.join(reasons)}): fix the file")
    return LoadResult(records=records, format=fmt, path=path, num_skipped=skipped, reasons=reasons)


def _check_kind(fmt: str, kind: Optional[str], path: str) -> None:
    if kind is not None and kind not in KINDS[fmt]:
        able = [f for f, ks in KINDS.items() if kind in ks]
        raise ValueError(f"{path}: format {fmt!r} cannot supply {kind} data: use a file in one of the formats {', '.join(able)}")
