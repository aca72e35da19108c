"""Tokenization of normalized records (aligner.data.formats) into token-id examples.

Owns: prompt/response tokenization with a response-only loss mask, chat rendering with loss
on assistant turns only, the truncation policy (``data.truncation``), and the counters
that make every deviation visible (skipped, truncated, boundary mismatches, unknown tokens).

Conventions. Plain (non-chat) rows: ``[bos] + prompt + response + [eos]`` (bos only when the
tokenizer has one). The prompt/response boundary is found by tokenizing the prompt alone
and prompt+response together: when the first is a prefix of the second, the split is exact;
otherwise (a token merges across the boundary) the parts are tokenized separately and
concatenated, which is what generation sees (prompt ids, then sampled ids), and the row is
counted in ``num_boundary_mismatch`` and logged. Chat rows are rendered with the tokenizer's
chat template (which adds bos/eos itself). Their prompt is the prompt messages rendered with
the generation prompt; an answer given as messages (chosen, rejected, a completion) is the
text the template renders after that prompt: the rendering of prompt + answer minus the
prompt's, tokenized with the same boundary rule (no eos appended: the template ends the turn).
For SFT a chat row is tokenized once with character offsets, and a token is a loss token when
it starts inside the span of a trained assistant turn: every assistant turn of a ``chat``
dialogue, those of the answer of a prompt + answer row. The spans come from rendering
``messages[:i]`` with the generation prompt and ``messages[:i+1]``. A template where those
renderings are not prefixes of the full one is rejected with the row's file:line (RowError,
counted in ``num_invalid`` and skipped under ``data.skip_invalid``).

Truncation (``data.truncation``): a prompt longer than ``max_prompt_len`` raises (error),
loses its oldest tokens after bos (left), its newest tokens (right), or drops the row (skip);
a sequence longer than ``max_seq_len`` raises (error), drops the row (skip), or loses the
end of its response (left/right: the response is always cut at its end, losing eos).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from aligner.config import DataConfig
from aligner.data.formats import RowError

log = logging.getLogger("aligner.data")


@dataclass
class EncodeResult:
    """Encoded examples plus counters (rows dropped by truncation=skip or as invalid, truncated, boundary mismatches)."""

    examples: list[dict]
    num_skipped: int = 0
    num_invalid: int = 0  # rows the chat template cannot split (RowError), skipped under data.skip_invalid
    num_truncated: int = 0
    num_boundary_mismatch: int = 0
    num_unk: int = 0  # examples containing the tokenizer's unk id (text the vocabulary cannot represent)
    reasons: list[str] = field(default_factory=list)  # first few "file:line: ..." skip reasons


class _Skip(Exception):
    pass


def _encode_text(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _bos(tok) -> list[int]:
    return [tok.bos_token_id] if tok.bos_token_id is not None else []


def _n_bos(ids: list[int], tok) -> int:
    return int(tok.bos_token_id is not None and bool(ids) and ids[0] == tok.bos_token_id)


def _render(tok, messages: list[dict], generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def prompt_ids(record: dict, tok) -> list[int]:
    """Token ids of the record's prompt as the policy sees it before generating.

    Chat records: the template rendering of the messages (a trailing assistant turn of a
    ``chat`` dialogue dropped) with the generation prompt; others: ``[bos] + tokens(prompt)``.
    """
    if "messages" in record:
        msgs = record["messages"]
        if msgs and msgs[-1]["role"] == "assistant":
            msgs = msgs[:-1]
        return _encode_text(tok, _render(tok, msgs, True))
    return _bos(tok) + _encode_text(tok, record["prompt"])


def _chat_answer_text(tok, record: dict, answer: list[dict]) -> tuple[str, str]:
    """(rendered prompt with the generation prompt, the text the template renders after it for `answer`)."""
    prompt_text = _render(tok, record["messages"], True)
    full_text = _render(tok, record["messages"] + answer, False)
    if not full_text.startswith(prompt_text):
        raise RowError(
            f"{record['source']}: the chat template does not render the prompt (with the generation prompt) as a prefix "
            "of the prompt followed by its answer, so the answer cannot be cut out: use a prefix-stable template "
            "(tokenizer.chat_template)"
        )
    return prompt_text, full_text[len(prompt_text) :]


def _response_ids(tok, record: dict, p_ids: list[int], response, stats: EncodeResult) -> list[int]:
    """Ids of `response` (str, or answer messages for a chat record) that follow `p_ids` (see module docstring)."""
    if isinstance(response, list):
        prompt_text, answer_text = _chat_answer_text(tok, record, response)
        full, end = _encode_text(tok, prompt_text + answer_text), []
    else:
        answer_text, end = response, [tok.eos_token_id]
        full = _bos(tok) + _encode_text(tok, record["prompt"] + response)
    if full[: len(p_ids)] == p_ids:
        r = full[len(p_ids) :]
    else:
        stats.num_boundary_mismatch += 1
        if stats.num_boundary_mismatch == 1:
            log.warning("%s: prompt and response tokens merge at the boundary: tokenizing them separately", record["source"])
        r = _encode_text(tok, answer_text)
    return r + end


def _chat_turns(record: dict) -> tuple[list[dict], int]:
    """(all turns, index of the first trained turn): a prompt + answer row trains its answer, a dialogue every turn."""
    answer = record.get("response")
    if isinstance(answer, list):
        return record["messages"] + answer, len(record["messages"])
    return record["messages"], 0


def _chat_ids_and_mask(tok, record: dict) -> tuple[list[int], list[int]]:
    msgs, first = _chat_turns(record)
    full = _render(tok, msgs, False)
    spans = []
    for i, m in enumerate(msgs[first:], start=first):
        if m["role"] != "assistant":
            continue
        start_text, end_text = _render(tok, msgs[:i], True), _render(tok, msgs[: i + 1], False)
        if not (end_text.startswith(start_text) and full.startswith(end_text)):
            raise RowError(
                f"{record['source']}: the chat template does not render turn {i} as a prefix of the whole dialogue, "
                "so assistant tokens cannot be masked: use a prefix-stable template (tokenizer.chat_template)"
            )
        spans.append((len(start_text), len(end_text)))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, mask = list(enc["input_ids"]), []
    for s, _e in enc["offset_mapping"]:
        mask.append(int(any(a <= s < b for a, b in spans)))
    return ids, mask


def _truncate(ids: list[int], mask: list[int], p_len: int, cfg: DataConfig, source: str, n_bos: int) -> tuple[list[int], list[int], bool]:
    """Apply data.truncation to a sequence whose first `p_len` tokens are the prompt."""
    truncated = False
    if p_len > cfg.max_prompt_len:
        if cfg.truncation == "error":
            raise ValueError(
                f"{source}: prompt has {p_len} tokens > data.max_prompt_len={cfg.max_prompt_len}: raise data.max_prompt_len "
                "or set data.truncation=left|right|skip"
            )
        if cfg.truncation == "skip":
            raise _Skip(f"{source}: prompt has {p_len} tokens > data.max_prompt_len={cfg.max_prompt_len}")
        keep = cfg.max_prompt_len
        if cfg.truncation == "left":
            cut = list(range(n_bos)) + list(range(p_len - (keep - n_bos), len(ids)))
        else:
            cut = list(range(keep)) + list(range(p_len, len(ids)))
        ids, mask = [ids[i] for i in cut], [mask[i] for i in cut]
        truncated = True
    if len(ids) > cfg.max_seq_len:
        if cfg.truncation == "error":
            raise ValueError(
                f"{source}: prompt + response have {len(ids)} tokens > data.max_seq_len={cfg.max_seq_len}: raise "
                "data.max_seq_len or set data.truncation=left|right|skip"
            )
        if cfg.truncation == "skip":
            raise _Skip(f"{source}: prompt + response have {len(ids)} tokens > data.max_seq_len={cfg.max_seq_len}")
        ids, mask = ids[: cfg.max_seq_len], mask[: cfg.max_seq_len]
        truncated = True
    return ids, mask, truncated


def _first_loss(mask: list[int]) -> int:
    return next((i for i, m in enumerate(mask) if m), len(mask))


def encode_sft(record: dict, tok, cfg: DataConfig, stats: EncodeResult) -> dict:
    """{"input_ids": list[int], "loss_mask": list[int] (1 = response token to predict), "source"}."""
    if "messages" in record:
        ids, mask = _chat_ids_and_mask(tok, record)
    else:
        p = prompt_ids(record, tok)
        r = _response_ids(tok, record, p, record["response"], stats)
        ids, mask = p + r, [0] * len(p) + [1] * len(r)
    ids, mask, truncated = _truncate(ids, mask, _first_loss(mask), cfg, record["source"], _n_bos(ids, tok))
    stats.num_truncated += truncated
    if not any(mask):
        raise _Skip(f"{record['source']}: no response tokens left after truncation")
    return {"input_ids": ids, "loss_mask": mask, "source": record["source"]}


def encode_pair(record: dict, tok, cfg: DataConfig, stats: EncodeResult) -> dict:
    """{"chosen_ids", "rejected_ids": list[int] (prompt + answer + eos), "prompt_len": int, "source"}."""
    if record.get("chosen") is None:
        raise ValueError(f"{record['source']}: row has no chosen/rejected answers: give a pairs or hh file for reward-model data")
    p = prompt_ids(record, tok)
    out = {"source": record["source"]}
    for name in ("chosen", "rejected"):
        r = _response_ids(tok, record, p, record[name], stats)
        ids, mask, truncated = _truncate(p + r, [0] * len(p) + [1] * len(r), len(p), cfg, record["source"], _n_bos(p, tok))
        stats.num_truncated += truncated
        out[f"{name}_ids"] = ids
        out["prompt_len"] = _first_loss(mask)
    return out


def encode_prompt(record: dict, tok, cfg: DataConfig, stats: EncodeResult) -> dict:
    """{"prompt_ids": list[int], "prompt": str (text as given, or the rendered chat), "metadata": dict, "source"}."""
    p = prompt_ids(record, tok)
    ids, _, truncated = _truncate(p, [0] * len(p), len(p), cfg, record["source"], _n_bos(p, tok))
    stats.num_truncated += truncated
    text = record["prompt"] if "prompt" in record else tok.decode(ids, skip_special_tokens=False)
    meta = dict(record.get("metadata") or {})
    if "messages" not in record and record.get("response") is not None:
        meta.setdefault("reference", record["response"])
    return {"prompt_ids": ids, "prompt": text, "metadata": meta, "source": record["source"]}


_ID_KEYS = ("input_ids", "chosen_ids", "rejected_ids", "prompt_ids")
ENCODERS = {"sft": encode_sft, "pairs": encode_pair, "prompt": encode_prompt}


def encode_records(records: list[dict], tok, cfg: DataConfig, kind: str) -> EncodeResult:
    """Encode every record for `kind` (sft | pairs | prompt); see the encoders for the example keys.

    Rows dropped by truncation=skip are counted in ``num_skipped``; rows the chat template
    cannot split raise RowError ("file:line: ..."), or under ``cfg.skip_invalid`` are counted
    in ``num_invalid``. Raises ValueError for an unknown kind and when no example is left.
    """
    if kind not in ENCODERS:
        raise ValueError(f"kind={kind!r} is unknown: valid kinds are {', '.join(ENCODERS)}")
    stats = EncodeResult(examples=[])
    for rec in records:
        try:
            ex = ENCODERS[kind](rec, tok, cfg, stats)
        except (_Skip, RowError) as e:
            if isinstance(e, RowError) and not cfg.skip_invalid:
                raise
            if isinstance(e, RowError):
                stats.num_invalid += 1
            else:
                stats.num_skipped += 1
            if len(stats.reasons) < 5:
                stats.reasons.append(str(e))
            continue
        stats.examples.append(ex)
        if tok.unk_token_id is not None and any(tok.unk_token_id in ex.get(k, ()) for k in _ID_KEYS):
            stats.num_unk += 1
            if stats.num_unk == 1:
                log.warning("%s: text maps to the unknown token %r: the tokenizer cannot represent it", rec["source"], tok.unk_token)
    if stats.num_skipped or stats.num_truncated or stats.num_invalid:
        log.info(
            "data: %d rows skipped, %d truncated (data.truncation=%s), %d invalid skipped (data.skip_invalid)",
            stats.num_skipped,
            stats.num_truncated,
            cfg.truncation,
            stats.num_invalid,
        )
    if not stats.examples:
        raise ValueError(
            f"no {kind} examples left after tokenization ({stats.num_skipped} too long, {stats.num_invalid} invalid: "
            f"{stats.reasons}): raise data.max_seq_len or fix the rows"
        )
    return stats
