"""Responses that pass format verifiers without content: loops, placeholders, template filler.

IFEval's verifiers (Zhou et al. 2023, arXiv 2311.07911) check the form of a response only: "*This is the
first section*" repeated, "[Company]" on every line or an empty bulleted list passes "highlight at least 2
sections" or "wrap the response in double quotes" as well as an answer does. A policy selected or rewarded on
those verifiers alone learns such text (rejection sampling keeps it as its best sample). This module names
the cases a rule can see; the rejection-sampling stage (``rs.reject_degenerate``) never keeps them and ranks
them with the rejected side of its pairs. It is a filter of degenerate text, not a judge of whether a
response answers its request: a fluent, off-topic answer passes it.

Checks, in order (the first that applies is the reason):

    repetition    a loop: at least 4 non-empty lines of which fewer than half are distinct, or at least 20
                  words of which fewer than half of the word 4-grams are distinct
    placeholder   at least 2 bracketed fill-ins such as "[Your Name]" (a bracket holding a letter, not a
                  markdown link), unless the prompt's constraints ask for placeholders (IFEval's
                  ``detectable_content:number_placeholders``); or template filler such as "This is the first
                  section" or "highlighted section part 1"
    no content    fewer than 3 words, unless the constraints allow a short answer (IFEval's
                  ``detectable_format:constrained_response``, or ``length_constraints:number_words`` with
                  relation "less than")
"""

from __future__ import annotations

import itertools
import re
from typing import Optional

from aligner.data.ifeval import ID_FIELD, KWARGS_FIELD

PLACEHOLDER_IDS = ("detectable_content:number_placeholders",)
SHORT_IDS = ("detectable_format:constrained_response",)
_BRACKET = re.compile(r"\[[^\[\]\n]*[A-Za-z][^\[\]\n]*\](?!\()")
_ORDINAL = r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|next|last|\d+(?:st|nd|rd|th)?)"
_FILLER = re.compile(
    rf"\bthis is the {_ORDINAL} (?:section|paragraph|part|point|bullet|item)\b"
    r"|\bhighlighted section(?: part)? \d+\b"
    r"|\bcontent of (?:section|paragraph|part) \d+\b",
    re.IGNORECASE,
)
_WORD = re.compile(r"[^\W_]+(?:['’-][^\W_]+)*")


def degenerate_reason(response: str, metadata: Optional[dict] = None) -> str:
    """Why `response` is degenerate ("repetition", "placeholder" or "no content"), or "" if it is not (the
    checks: module docstring). metadata: the prompt row's metadata; its IFEval fields ``instruction_id_list``
    and ``kwargs`` exempt prompts that ask for placeholders or allow a short answer (absent: no exemption).
    Pure; raises nothing on any str response and any dict metadata."""
    lines = [ln.strip() for ln in response.splitlines() if ln.strip()]
    if len(lines) >= 4 and len(set(lines)) * 2 < len(lines):
        return "repetition"
    words = [w.lower() for w in _WORD.findall(response)]
    grams = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
    if len(words) >= 20 and len(set(grams)) * 2 < len(grams):
        return "repetition"
    ids = (metadata or {}).get(ID_FIELD) or ()
    if not any(i in PLACEHOLDER_IDS for i in ids) and len(_BRACKET.findall(response)) >= 2:
        return "placeholder"
    if _FILLER.search(response):
        return "placeholder"
    if len(words) < 3 and not _short_allowed(ids, (metadata or {}).get(KWARGS_FIELD) or ()):
        return "no content"
    return ""


def _short_allowed(ids, kwargs) -> bool:
    """Whether the constraints allow an answer of a few words."""
    for i, kw in itertools.zip_longest(ids, kwargs):
        if i in SHORT_IDS:
            return True
        if i == "length_constraints:number_words" and isinstance(kw, dict) and kw.get("relation") == "less than":
            return True
    return False
