"""Instruction-following RL prompts in IFEval's schema, built from any prompt file: never IFEval's own.

``python -m aligner.data.ifeval_prompts --requests FILE [FILE ...] --out OUT.jsonl --n N --seed S``

Each output row is a base request with 1 to 3 verifiable constraints appended (as Tülu 3's RLVR
instruction-following data, Lambert et al. 2024, and IFEval itself, Zhou et al. 2023):

    {"prompt": "<request>\\n\\n<constraint text>\\n<constraint text>",
     "instruction_id_list": ["punctuation:no_comma", ...],  # IFEval ids
     "kwargs": [{}, ...],                                   # each checker's arguments
     "request_source": "<file>:<line>"}

a ``prompt`` row that the loader reads as prompt-only data, its other fields kept as the row's
metadata (:mod:`aligner.data.formats`), which reaches the rule reward (``reward.rule=ifeval``).

Base requests (:func:`read_requests`): the prompt of every row of each file, in any format the
loader reads that supplies prompts (GSM8K questions, HH dialogues, plain prompts, chat
messages); an HH dialogue or a conversation is used only when it has a single user turn (its
text), and requests shorter than ``--min-chars`` or longer than ``--max-chars`` are dropped;
duplicates are dropped. A row the loader refuses stops the command (file:line), unless
``--skip-invalid`` (the HH file has pairs with an empty answer). ``--exclude FILE`` drops every request that equals, contains or is
contained in a prompt of FILE (e.g. IFEval's input_data.jsonl), compared case- and
whitespace-insensitively.

Constraints (:func:`draw_constraints`): the number k is uniform in [--min-constraints,
--max-constraints]; ids are drawn uniformly from IFEval's 25 (or ``--ids``) without a pair IFEval
marks as conflicting (``INSTRUCTION_CONFLICTS``); arguments are drawn by this module's own seeded
generator (:data:`ARGUMENTS`, ranges sized for short responses), and the text is the checker's
own description (``build_description``): IFEval's wording. Every row is checked by
:func:`aligner.data.ifeval.check_row` before it is written.

Determinism: everything is a function of (the files' contents in order, --n, --seed and the
options): ``random.Random(seed)`` shuffles the pooled requests and then draws every row's
constraints in order.

Bad input (a missing or malformed request file, too few requests, an unknown ``--ids`` id): one
line naming the file (``file:line`` for a bad row) and the fix, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import string
import sys
from typing import Callable, Optional, Sequence

from aligner.data.formats import load_records
from aligner.data.ifeval import build_checker, check_row, conflicts, registry

_HUMAN, _ASSISTANT = "\n\nHuman:", "\n\nAssistant:"
_RELATIONS = ("less than", "at least")


def _words() -> list[str]:
    from if_verifiable.ifeval.instructions_util import WORD_LIST

    return list(WORD_LIST)


def _request_words(request: str) -> list[str]:
    """Distinct lowercase words of 5+ letters in the request, in order (forbidden-word candidates)."""
    seen: dict[str, None] = {}
    for w in re.findall(r"[A-Za-z]{5,}", request):
        seen.setdefault(w.lower(), None)
    return list(seen)


def _languages() -> list[str]:
    from if_verifiable.ifeval.instructions_util import LANGUAGE_CODES

    return sorted(LANGUAGE_CODES)


def _endings() -> list[str]:
    from if_verifiable.ifeval.instructions import _ENDING_OPTIONS

    return list(_ENDING_OPTIONS)


# IFEval id -> (rng, request) -> that checker's kwargs. Ranges are IFEval's (instructions.py constants)
# narrowed to what a response of a few hundred tokens can satisfy (e.g. 20-200 words, not 100-500).
ARGUMENTS: dict[str, Callable[[random.Random, str], dict]] = {
    "keywords:existence": lambda r, q: {"keywords": r.sample(_words(), r.randint(1, 2))},
    "keywords:frequency": lambda r, q: {"keyword": r.choice(_words()), "frequency": r.randint(1, 3), "relation": r.choice(_RELATIONS)},
    "keywords:forbidden_words": lambda r, q: {
        "forbidden_words": r.sample(_request_words(q) or _words(), min(2, len(_request_words(q)) or 2))
    },
    "keywords:letter_frequency": lambda r, q: {
        "letter": r.choice(string.ascii_lowercase),
        "let_frequency": r.randint(1, 10),
        "let_relation": r.choice(_RELATIONS),
    },
    "language:response_language": lambda r, q: {"language": r.choice(_languages())},
    "length_constraints:number_sentences": lambda r, q: {"num_sentences": r.randint(1, 10), "relation": r.choice(_RELATIONS)},
    "length_constraints:number_paragraphs": lambda r, q: {"num_paragraphs": r.randint(2, 5)},
    "length_constraints:number_words": lambda r, q: {"num_words": r.randrange(20, 210, 10), "relation": r.choice(_RELATIONS)},
    "length_constraints:nth_paragraph_first_word": lambda r, q: _nth_paragraph(r),
    "detectable_content:number_placeholders": lambda r, q: {"num_placeholders": r.randint(1, 4)},
    "detectable_content:postscript": lambda r, q: {"postscript_marker": r.choice(("P.S.", "P.P.S"))},
    "detectable_format:number_bullet_lists": lambda r, q: {"num_bullets": r.randint(1, 5)},
    "detectable_format:constrained_response": lambda r, q: {},
    "detectable_format:number_highlighted_sections": lambda r, q: {"num_highlights": r.randint(1, 4)},
    "detectable_format:multiple_sections": lambda r, q: {
        "section_spliter": r.choice(("Section", "SECTION")),
        "num_sections": r.randint(2, 5),
    },
    "detectable_format:json_format": lambda r, q: {},
    "detectable_format:title": lambda r, q: {},
    "combination:two_responses": lambda r, q: {},
    "combination:repeat_prompt": lambda r, q: {"prompt_to_repeat": q},
    "startend:end_checker": lambda r, q: {"end_phrase": r.choice(_endings())},
    "change_case:capital_word_frequency": lambda r, q: {"capital_frequency": r.randint(2, 10), "capital_relation": r.choice(_RELATIONS)},
    "change_case:english_capital": lambda r, q: {},
    "change_case:english_lowercase": lambda r, q: {},
    "punctuation:no_comma": lambda r, q: {},
    "startend:quotation": lambda r, q: {},
}


def _nth_paragraph(r: random.Random) -> dict:
    n = r.randint(2, 4)
    return {"num_paragraphs": n, "nth_paragraph": r.randint(1, n), "first_word": r.choice(_words())}


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _request_of(rec: dict) -> Optional[str]:
    """The single user request of a normalized prompt record, or None (several user turns, no text)."""
    if "messages" in rec:
        users = [m["content"] for m in rec["messages"] if m["role"] == "user"]
        return users[0] if len(users) == 1 and rec["messages"][-1]["role"] == "user" else None
    text = rec.get("prompt") or ""
    if _HUMAN in text:  # an HH dialogue prompt: "\n\nHuman: ...\n\nAssistant:"
        if text.count(_HUMAN) != 1:
            return None
        text = text.split(_HUMAN, 1)[1].rsplit(_ASSISTANT, 1)[0]
    return text.strip() or None


def read_requests(paths: Sequence[str], min_chars: int = 20, max_chars: int = 600, skip_invalid: bool = False) -> list[tuple[str, str]]:
    """(request text, "file:line") of every usable row of `paths`, in file order, duplicates dropped.

    skip_invalid: skip rows the loader refuses (counted on stderr), as ``data.skip_invalid``.
    Raises FileNotFoundError / ValueError ("file:line: ...") for a missing file or a malformed row.
    """
    out, seen = [], set()
    for path in paths:
        res = load_records(path, "auto", kind="prompt", skip_invalid=skip_invalid)
        if res.num_skipped:
            print(f"{path}: skipped {res.num_skipped} invalid rows (--skip-invalid); first: {res.reasons[0]}", file=sys.stderr)
        for rec in res.records:
            req = _request_of(rec)
            if req is None or not min_chars <= len(req) <= max_chars or _norm(req) in seen:
                continue
            seen.add(_norm(req))
            out.append((req, rec["source"]))
    return out


def read_prompts(path: str) -> list[str]:
    """The ``prompt`` texts of a jsonl file of prompt rows (e.g. IFEval's input_data.jsonl); ValueError naming file:line."""
    return [rec["prompt"] for rec in load_records(path, "prompt", kind="prompt").records]


def overlaps(request: str, banned: Sequence[str]) -> bool:
    """True when `request` equals, contains or is contained in one of `banned` (case and whitespace ignored)."""
    r = _norm(request)
    return any(r in b or b in r for b in map(_norm, banned))


def draw_constraints(rng: random.Random, request: str, k: int, ids: Sequence[str]) -> tuple[list[str], list[dict]]:
    """k constraint ids from `ids` (no two conflicting, IFEval's table) and their kwargs for `request`."""
    clash = conflicts()
    chosen: list[str] = []
    for _ in range(k):
        free = [i for i in ids if i not in chosen and not any(i in clash.get(c, ()) or c in clash.get(i, ()) for c in chosen)]
        if not free:
            break
        chosen.append(rng.choice(free))
    return chosen, [ARGUMENTS[i](rng, request) for i in chosen]


def render(request: str, ids: Sequence[str], kwargs: Sequence[dict]) -> str:
    """The prompt: the request, a blank line, then each constraint's IFEval description on its own line, in order."""
    texts = [build_checker(i, kw, request).build_description(**kw) for i, kw in zip(ids, kwargs)]
    return request.rstrip() + "\n\n" + "\n".join(t.strip() for t in texts)


def build(
    requests: Sequence[tuple[str, str]],
    n: int,
    seed: int,
    min_constraints: int = 1,
    max_constraints: int = 3,
    ids: Optional[Sequence[str]] = None,
) -> list[dict]:
    """n prompt rows (see the module docstring) from `requests` [(text, source)], a function of `seed`.

    Raises ValueError when there are fewer than n requests or the constraint range is empty.
    """
    if not 1 <= min_constraints <= max_constraints:
        raise ValueError(f"--min-constraints {min_constraints} / --max-constraints {max_constraints}: need 1 <= min <= max")
    if len(requests) < n:
        raise ValueError(f"only {len(requests)} usable requests for --n {n}: give more request files or a smaller --n")
    ids = sorted(ids or registry())
    rng = random.Random(seed)
    order = list(range(len(requests)))
    rng.shuffle(order)
    rows = []
    for j in order[:n]:
        request, source = requests[j]
        cids, kwargs = draw_constraints(rng, request, rng.randint(min_constraints, max_constraints), ids)
        row = {"prompt": render(request, cids, kwargs), "instruction_id_list": cids, "kwargs": kwargs, "request_source": source}
        check_row(row, f"built row {len(rows) + 1} ({source})")
        rows.append(row)
    return rows


def write_jsonl(rows: Sequence[dict], path: str) -> None:
    """Write rows as jsonl atomically (a temporary file renamed into place)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line (module docstring); returns the exit code: 0, or 2 for bad input."""
    ap = argparse.ArgumentParser(prog="python -m aligner.data.ifeval_prompts", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", nargs="+", required=True, help="prompt files (jsonl/json/parquet, any prompt-supplying format)")
    ap.add_argument("--out", required=True, help="output jsonl")
    ap.add_argument("--n", type=int, required=True, help="rows to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-constraints", type=int, default=1)
    ap.add_argument("--max-constraints", type=int, default=3)
    ap.add_argument("--ids", default="", help="comma-separated IFEval ids to draw from (default: all 25)")
    ap.add_argument("--exclude", nargs="*", default=[], help="prompt files whose prompts no request may overlap (e.g. IFEval's)")
    ap.add_argument("--skip-invalid", action="store_true", help="skip rows the loader refuses (e.g. HH pairs with an empty answer)")
    ap.add_argument("--min-chars", type=int, default=20)
    ap.add_argument("--max-chars", type=int, default=600)
    args = ap.parse_args(argv)
    try:
        known = registry()
        ids = [i.strip() for i in args.ids.split(",") if i.strip()]
        bad = [i for i in ids if i not in known]
        if bad:
            raise ValueError(f"--ids: {', '.join(bad)} not IFEval constraint ids: use some of {', '.join(sorted(known))}")
        requests = read_requests(args.requests, args.min_chars, args.max_chars, args.skip_invalid)
        banned = [p for path in args.exclude for p in read_prompts(path)]
        if banned:
            normed = [_norm(b) for b in banned]
            requests = [r for r in requests if not overlaps(r[0], normed)]
        rows = build(requests, args.n, args.seed, args.min_constraints, args.max_constraints, ids or None)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"aligner ifeval_prompts: error: {e}", file=sys.stderr)
        return 2
    write_jsonl(rows, args.out)
    print(f"wrote {len(rows)} prompts ({sum(len(r['instruction_id_list']) for r in rows)} constraints) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
