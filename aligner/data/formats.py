"""Dataset formats: reading files, validating rows, detecting the format, normalizing records.

Owns: the format table (:data:`FORMATS`), auto-detection, per-row validation with
``file:line`` errors, ``skip_invalid`` accounting, and the normalized record every later
stage consumes (:func:`load_records`).

Files: ``.jsonl`` is parsed here line by line (so every error names the exact line: invalid
JSON, non-UTF-8 bytes, a row that is not an object); ``.json`` (a list of rows, or an
object holding one list), ``.parquet`` and saved HF dataset dirs (``save_to_disk``) are read
through HF ``datasets``; their rows are named ``file:N`` with N the 1-based row number.

Formats (``data.format``; "auto" takes the format whose fields a row has, the most specific
when several match, then the one able to supply the stage's kind). They cover TRL's dataset
types. A field marked ``text|msgs`` holds a string (TRL's standard form) or a list of
{"role", "content"} messages (its conversational form), decided per row; the fields of one
row must agree (all strings or all lists, except the pairs string prompt below).

==================  ===================================  ============================  ====================
format              fields                               TRL type                      kinds
==================  ===================================  ============================  ====================
text                text: str                            language modeling             sft
chat                messages: msgs                       language modeling (conv.)     sft, prompt
prompt              prompt: text|msgs                    prompt-only                   prompt
prompt_completion   prompt, completion: text|msgs        prompt-completion             sft, prompt
sft                 prompt, response: text|msgs          prompt-completion             sft, prompt
pairs               prompt, chosen, rejected: text|msgs  preference, explicit prompt   pairs, sft, prompt
hh                  chosen, rejected: text|msgs          preference, implicit prompt   pairs, sft, prompt
unpaired            prompt, completion: text|msgs,       unpaired preference           prompt
                    label: bool
gsm8k               question, answer: str                (GSM8K)                       sft, prompt
==================  ===================================  ============================  ====================

Conversational rows: a prompt must end with a non-assistant turn; an answer (completion,
response, chosen, rejected) holds the turns after the prompt and must start with an assistant
turn; an answer that repeats the prompt messages first (a full conversation) has them
removed. ``pairs`` also takes a string prompt with message-list answers (UltraFeedback-
binarized): full conversations whose shared leading messages are the prompt (their last user
turn must be the ``prompt`` text), or assistant turns only (the prompt becomes one user turn).
``hh`` (implicit prompt): message lists share their leading messages, which are the prompt;
strings are HH dialogues, split at the last "\\n\\nAssistant:" (both sides must share that
prompt), or any other text, whose prompt is the longest common prefix cut back to its last
whitespace (TRL's rule, kept at a word boundary).

A normalized record is a dict:

- ``source``: "file:line" of the row (used in every later error message);
- ``prompt``: str ("" for ``text``), or ``messages``: list of {"role", "content"}, never both.
  ``messages`` is the prompt conversation, except for ``chat`` rows, where it is the whole
  dialogue (SFT trains every assistant turn; the RL prompt drops a trailing assistant turn);
- ``response``: the SFT target or None: str for string rows, the answer's messages (list) for
  conversational rows, the last assistant turn's text for ``chat`` rows;
- ``chosen`` / ``rejected``: str or messages (list) | None (pairs: the answers after the prompt);
- ``completion`` and ``label`` (``unpaired`` rows only): str or messages, and bool (desirable);
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

from aligner.errors import RowError

log = logging.getLogger("aligner.data")

# format name -> required fields (see the module docstring for their types). Extra fields are kept as metadata.
FORMATS: dict[str, tuple[str, ...]] = {
    "prompt": ("prompt",),
    "sft": ("prompt", "response"),
    "chat": ("messages",),
    "pairs": ("prompt", "chosen", "rejected"),
    "hh": ("chosen", "rejected"),
    "gsm8k": ("question", "answer"),
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "unpaired": ("prompt", "completion", "label"),
}
# which record kinds each format can supply: sft (prompt + response), pairs, prompt (RL)
KINDS: dict[str, tuple[str, ...]] = {
    "prompt": ("prompt",),
    "sft": ("sft", "prompt"),
    "chat": ("sft", "prompt"),
    "pairs": ("pairs", "sft", "prompt"),
    "hh": ("pairs", "sft", "prompt"),
    "gsm8k": ("sft", "prompt"),
    "text": ("sft",),
    "prompt_completion": ("sft", "prompt"),
    "unpaired": ("prompt",),
}
ROLES = ("system", "user", "assistant")
_HH_ASSISTANT = "\n\nAssistant:"
_HH_HUMAN = "\n\nHuman:"
_MAX_REASONS = 5


@dataclass
class LoadResult:
    """Records of one file plus what was skipped (``skip_invalid``) and the detected format."""

    records: list[dict]
    format: str
    path: str
    num_skipped: int = 0
    reasons: list[str] = field(default_factory=list)  # the first few skip reasons, "file:line: ..."
    num_tied: int = 0  # preference pairs skipped because chosen == rejected


def formats_help() -> str:
    """One line per format: its name and required fields (used in error messages)."""
    return "; ".join(f"{name}: {{{', '.join(repr(f) for f in fields)}}}" for name, fields in FORMATS.items())


def detect_format(keys: set, where: str, kind: Optional[str] = None) -> str:
    """The format whose required fields are all in `keys`, preferring the most specific.

    When several unrelated formats match and `kind` ("sft", "pairs" or "prompt") is given,
    only those that can supply `kind` are kept (a row with both "messages" and preference
    fields, as in UltraFeedback-binarized, is "pairs" for the reward model). Raises
    ValueError naming `where` when no format or more than one matches.
    """
    cands = [f for f, req in FORMATS.items() if set(req) <= keys]
    cands = [f for f in cands if not any(set(FORMATS[f]) < set(FORMATS[g]) for g in cands)]
    if len(cands) > 1 and kind is not None:
        cands = [f for f in cands if kind in KINDS[f]] or cands
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
        if not _is_saved_dataset(path):
            for file in _hub_data_files(path):
                yield from _iter_rows(file)
            return
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


def _is_saved_dataset(path: str) -> bool:
    """Whether `path` is a dir written by HF ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _hub_data_files(path: str) -> list[str]:
    """The data files of a dataset repository laid out as on the HF hub (e.g. ``data/train-00000-of-00001.parquet``):
    its .parquet files, else its .jsonl files, those with "train" in their name when there are such.

    Raises ValueError when the directory holds neither a saved dataset nor data files.
    """
    for ext in (".parquet", ".jsonl"):
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names if f.endswith(ext))
        train = [f for f in files if "train" in os.path.relpath(f, path)]
        if files:
            log.info("data: %s is a dataset repository: reading %d %s file(s)", path, len(train or files), ext)
            return train or files
    raise ValueError(
        f"{path}: a directory that is neither a saved HF dataset (save_to_disk: dataset_info.json or "
        "dataset_dict.json) nor a dataset repository with .parquet or .jsonl files: point data.*_path "
        "at a data file or at such a directory"
    )


def _field(row: dict, name: str, where: str) -> Any:
    if name not in row or row[name] is None:
        raise RowError(f"{where}: field {name!r} is missing: every row of this format needs {name!r}")
    return row[name]


def _text(row: dict, name: str, where: str) -> str:
    v = _field(row, name, where)
    if not isinstance(v, str):
        raise RowError(f"{where}: field {name!r} must be a string, got {type(v).__name__} {v!r:.40}: quote the value")
    if not v.strip():
        raise RowError(f"{where}: field {name!r} is empty: give non-empty text or drop the row")
    return v


def _messages(row: dict, name: str, where: str) -> list[dict]:
    """Field `name` of `row` as a validated non-empty list of {"role", "content"} messages."""
    msgs = _field(row, name, where)
    if not isinstance(msgs, list) or not msgs:
        raise RowError(f"{where}: field {name!r} must be a non-empty list of {{'role', 'content'}} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RowError(f"{where}: field '{name}[{i}].role' must be one of {', '.join(ROLES)}, got {m!r:.60}")
        out.append({"role": m["role"], "content": _text(m, "content", f"{where}: {name}[{i}]")})
    return out


def _is_chat(row: dict, names: tuple[str, ...], where: str) -> bool:
    """True when the fields `names` hold message lists, False when strings; RowError when one is missing or they mix."""
    lists = [n for n in names if isinstance(_field(row, n, where), list)]
    if lists and len(lists) < len(names):
        bad, other = lists[0], next(n for n in names if n not in lists)
        raise RowError(
            f"{where}: field {bad!r} must be a string like {other!r}, got list {row[bad]!r:.40}: give "
            f"{' and '.join(repr(n) for n in names)} all as strings or all as lists of {{'role', 'content'}} messages"
        )
    return bool(lists)


def _prompt_messages(row: dict, where: str) -> list[dict]:
    """Field 'prompt' as messages; RowError when it ends with an assistant turn (the answer goes elsewhere)."""
    msgs = _messages(row, "prompt", where)
    if msgs[-1]["role"] == "assistant":
        raise RowError(f"{where}: field 'prompt' ends with an assistant turn: end the prompt with the turn the answer replies to")
    return msgs


def _answer_turns(msgs: list[dict], name: str, where: str, prompt: list[dict]) -> list[dict]:
    """The turns of answer `name` after `prompt` (dropping a repeated prompt); RowError unless they start with an assistant turn."""
    if msgs[: len(prompt)] == prompt:
        msgs = msgs[len(prompt) :]
    if not msgs:
        raise RowError(f"{where}: field {name!r} has no turns after the prompt: give the assistant's answer")
    if msgs[0]["role"] != "assistant":
        raise RowError(
            f"{where}: field {name!r} must start with an assistant turn after the prompt, got role {msgs[0]['role']!r}: "
            f"put the conversation before the answer in the prompt and the assistant's answer in {name!r}"
        )
    return msgs


def _prompt_and_answer(row: dict, answer: str, where: str) -> dict:
    """{"prompt": str, "response": str} or {"messages": prompt turns, "response": answer turns}."""
    if not _is_chat(row, ("prompt", answer), where):
        return {"prompt": _text(row, "prompt", where), "response": _text(row, answer, where)}
    prompt = _prompt_messages(row, where)
    return {"messages": prompt, "response": _answer_turns(_messages(row, answer, where), answer, where, prompt)}


def _shared_turns(chosen: list[dict], rejected: list[dict], where: str) -> list[dict]:
    """The leading messages `chosen` and `rejected` share (the implicit prompt)."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == 0:
        raise RowError(
            f"{where}: fields 'chosen' and 'rejected' do not start with the same prompt messages: in the "
            "implicit-prompt form both conversations repeat the prompt turns before their answers"
        )
    if chosen[n - 1]["role"] == "assistant":
        raise RowError(
            f"{where}: fields 'chosen' and 'rejected' share their first {n} messages, which end with an assistant turn: "
            "in the implicit-prompt form they share the prompt turns (ending with the user's turn) and differ from the answer on"
        )
    return chosen[:n]


def _chat_pair_prompt(row: dict, chosen: list[dict], rejected: list[dict], where: str, explicit: bool) -> list[dict]:
    """Prompt turns of a conversational pair: 'prompt' messages, a string prompt, or (implicit) the shared leading turns."""
    if not explicit:
        return _shared_turns(chosen, rejected, where)
    if isinstance(row["prompt"], list):
        return _prompt_messages(row, where)
    text = _text(row, "prompt", where)
    if chosen[0]["role"] == rejected[0]["role"] == "assistant":  # answers only: the prompt is one user turn
        return [{"role": "user", "content": text}]
    shared = _shared_turns(chosen, rejected, where)
    last_user = next((m["content"] for m in reversed(shared) if m["role"] == "user"), None)
    if last_user is None or last_user.strip() != text.strip():
        raise RowError(
            f"{where}: field 'prompt' is not the last user turn of the messages shared by 'chosen' and 'rejected': "
            "make 'prompt' that turn's text, or give 'chosen' and 'rejected' as the assistant's answers only"
        )
    return shared


def _chat_pair(row: dict, where: str, explicit: bool) -> dict:
    """Conversational pair -> {"messages": prompt turns, "chosen", "rejected": answer turns}; `explicit`: a 'prompt' field is given."""
    chosen, rejected = _messages(row, "chosen", where), _messages(row, "rejected", where)
    prompt = _chat_pair_prompt(row, chosen, rejected, where, explicit)
    return {
        "messages": prompt,
        "chosen": _answer_turns(chosen, "chosen", where, prompt),
        "rejected": _answer_turns(rejected, "rejected", where, prompt),
    }


def split_hh(text: str, where: str, name: str) -> tuple[str, str]:
    """(prompt ending in "\\n\\nAssistant:", final assistant response) of an HH dialogue."""
    cut = text.rfind(_HH_ASSISTANT)
    if cut < 0 or _HH_HUMAN not in text[:cut]:
        raise RowError(f"{where}: field {name!r} has no '\\n\\nHuman:' ... '\\n\\nAssistant:' turns: not an Anthropic HH row")
    prompt, response = text[: cut + len(_HH_ASSISTANT)], text[cut + len(_HH_ASSISTANT) :]
    return prompt, response


def _hh_pair(chosen_text: str, rejected_text: str, where: str) -> dict:
    pc, chosen = split_hh(chosen_text, where, "chosen")
    pr, rejected = split_hh(rejected_text, where, "rejected")
    if pc != pr:
        raise RowError(f"{where}: fields 'chosen' and 'rejected' do not share the dialogue before the last assistant turn")
    if not chosen.strip() or not rejected.strip():
        raise RowError(
            f"{where}: field {'chosen' if not chosen.strip() else 'rejected'!r} has an empty final assistant turn: "
            "a pair needs two replies; remove the row or set data.skip_invalid=true to skip and count such rows"
        )
    return {"prompt": pc, "chosen": chosen, "rejected": rejected}


def _prefix_pair(chosen_text: str, rejected_text: str, where: str) -> dict:
    """Plain-text implicit prompt: the common prefix up to its last whitespace; the answers keep that space."""
    shared = os.path.commonprefix([chosen_text, rejected_text])
    cut = max((i for i, c in enumerate(shared) if c.isspace()), default=0)
    prompt, chosen, rejected = chosen_text[:cut], chosen_text[cut:], rejected_text[cut:]
    if not prompt.strip():
        raise RowError(
            f"{where}: field 'chosen' is not an Anthropic HH row (no '\\n\\nHuman:' ... '\\n\\nAssistant:' turns) and shares "
            "no leading words with 'rejected' to take as the prompt: give a 'prompt' field (pairs format)"
        )
    for name, text in (("chosen", chosen), ("rejected", rejected)):
        if not text.strip():
            raise RowError(f"{where}: field {name!r} has no text after the prompt it shares with the other answer")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def gsm8k_final_answer(answer: str) -> Optional[str]:
    """The final answer after "####" with commas and spaces removed, or None if absent."""
    if "####" not in answer:
        return None
    return answer.rsplit("####", 1)[1].strip().replace(",", "").replace(" ", "")


def _norm_prompt(row: dict, where: str, meta: dict) -> dict:
    if isinstance(row.get("prompt"), list):
        return {"messages": _prompt_messages(row, where)}
    return {"prompt": _text(row, "prompt", where)}


def _norm_sft(row: dict, where: str, meta: dict) -> dict:
    return _prompt_and_answer(row, "response", where)


def _norm_prompt_completion(row: dict, where: str, meta: dict) -> dict:
    return _prompt_and_answer(row, "completion", where)


def _norm_unpaired(row: dict, where: str, meta: dict) -> dict:
    rec = _prompt_and_answer(row, "completion", where)
    label = _field(row, "label", where)
    if not isinstance(label, bool):
        raise RowError(f"{where}: field 'label' must be true or false, got {type(label).__name__} {label!r:.40}: write a JSON boolean")
    rec["completion"], rec["label"], rec["response"] = rec["response"], label, None
    return rec


def _norm_text(row: dict, where: str, meta: dict) -> dict:
    return {"prompt": "", "response": _text(row, "text", where)}


def _norm_chat(row: dict, where: str, meta: dict) -> dict:
    msgs = _messages(row, "messages", where)
    return {"messages": msgs, "response": msgs[-1]["content"] if msgs[-1]["role"] == "assistant" else None}


def _norm_pairs(row: dict, where: str, meta: dict) -> dict:
    _field(row, "prompt", where)
    if _is_chat(row, ("chosen", "rejected"), where):
        rec = _chat_pair(row, where, explicit=True)
    elif isinstance(row["prompt"], list):
        raise RowError(
            f"{where}: field 'chosen' must be a list of messages like 'prompt', got {type(row['chosen']).__name__}: "
            "give the answers as messages too"
        )
    else:
        rec = {"prompt": _text(row, "prompt", where), "chosen": _text(row, "chosen", where), "rejected": _text(row, "rejected", where)}
    return {**rec, "response": rec["chosen"]}  # pairs can train SFT on the chosen answer


def _norm_hh(row: dict, where: str, meta: dict) -> dict:
    if _is_chat(row, ("chosen", "rejected"), where):
        rec = _chat_pair(row, where, explicit=False)
    else:
        chosen, rejected = _text(row, "chosen", where), _text(row, "rejected", where)
        is_hh = any(_HH_HUMAN in t and _HH_ASSISTANT in t for t in (chosen, rejected))
        rec = (_hh_pair if is_hh else _prefix_pair)(chosen, rejected, where)
    return {**rec, "response": rec["chosen"]}


def _norm_gsm8k(row: dict, where: str, meta: dict) -> dict:
    rec = {"prompt": _text(row, "question", where), "response": _text(row, "answer", where)}
    final = gsm8k_final_answer(rec["response"])
    if not final:
        raise RowError(f"{where}: field 'answer' has no final answer after '####': end the answer with '#### <number>'")
    meta["answer"] = final
    return rec


# format name -> (row, where, metadata) -> the record's prompt/answer fields; keys as in FORMATS
_NORMALIZERS = {
    "prompt": _norm_prompt,
    "sft": _norm_sft,
    "chat": _norm_chat,
    "pairs": _norm_pairs,
    "hh": _norm_hh,
    "gsm8k": _norm_gsm8k,
    "text": _norm_text,
    "prompt_completion": _norm_prompt_completion,
    "unpaired": _norm_unpaired,
}


def normalize_row(fmt: str, row: Any, where: str) -> dict:
    """One raw row of format `fmt` -> a normalized record (see module docstring); RowError if invalid."""
    if not isinstance(row, dict):
        raise RowError(f"{where}: row must be a JSON object, got {type(row).__name__}: write one object per line")
    meta = {k: v for k, v in row.items() if k not in FORMATS[fmt]}
    rec: dict = {"source": where, "response": None, "chosen": None, "rejected": None}
    rec.update(_NORMALIZERS[fmt](row, where, meta))
    rec["metadata"] = meta
    return rec


def load_records(path: str, fmt: str = "auto", kind: Optional[str] = None, skip_invalid: bool = False) -> LoadResult:
    """Read, validate and normalize every row of `path`.

    fmt: a name in :data:`FORMATS` or "auto" (detected from the first valid row's fields, see
        :func:`detect_format`, and logged on the "aligner.data" logger). Whether a row is
        standard (strings) or conversational (message lists) is decided per row.
    kind: when given ("sft", "pairs" or "prompt"), the format must be able to supply it
        (ValueError otherwise) and rows unusable for it (e.g. a chat row with no assistant
        turn for sft) are invalid.
    skip_invalid: skip invalid rows, counting them (``num_skipped``) and keeping the first
        few reasons; otherwise the first invalid row raises ValueError "file:line: ...".
        Preference pairs whose chosen equals rejected are always skipped, counted in
        ``num_tied`` and logged: they carry no preference.

    Raises FileNotFoundError for a missing path; ValueError for unknown/ambiguous formats,
    invalid rows (unless skipped) and files with no valid rows.
    """
    if fmt != "auto" and fmt not in FORMATS:
        raise ValueError(f"data.format={fmt!r} is unknown: valid formats are auto, {', '.join(FORMATS)}")
    if fmt != "auto":
        _check_kind(fmt, kind, path)
    records: list[dict] = []
    reasons: list[str] = []
    tied: list[str] = []  # pairs whose chosen equals rejected: no preference to learn, always skipped
    skipped = 0
    for where, row in _iter_rows(path):
        try:
            if isinstance(row, RowError):
                raise row
            if fmt == "auto":
                if not isinstance(row, dict):
                    raise RowError(f"{where}: row must be a JSON object, got {type(row).__name__}")
                fmt = detect_format(set(row), where, kind)
                log.info("data: %s detected as format %r (fields %s)", path, fmt, ", ".join(FORMATS[fmt]))
                _check_kind(fmt, kind, path)
            rec = normalize_row(fmt, row, where)
            if kind == "sft" and rec["response"] is None:
                raise RowError(f"{where}: the row has no response (chat: no final assistant turn) to train SFT on")
            if kind == "pairs" and rec["chosen"] == rec["rejected"]:
                tied.append(where)
                continue
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
    if tied:
        log.warning(
            "data: skipped %d pairs of %s whose chosen equals rejected (no preference to learn); first: %s",
            len(tied),
            path,
            ", ".join(tied[:_MAX_REASONS]),
        )
    if not records:
        raise ValueError(
            f"{path}: no valid rows ({skipped} skipped, {len(tied)} pairs with chosen == rejected; "
            f"first reasons: {' | '.join(reasons)}): fix the file"
        )
    return LoadResult(records=records, format=fmt, path=path, num_skipped=skipped, reasons=reasons, num_tied=len(tied))


def _check_kind(fmt: str, kind: Optional[str], path: str) -> None:
    if kind is not None and kind not in KINDS[fmt]:
        able = [f for f, ks in KINDS.items() if kind in ks]
        raise ValueError(f"{path}: format {fmt!r} cannot supply {kind} data: use a file in one of the formats {', '.join(able)}")
