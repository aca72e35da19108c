"""Collation of encoded examples (aligner.data.encode) into padded tensors, and SFT packing.

Owns: right-padding collators for SFT, preference pairs and RL prompts, and greedy
sequence packing with per-document ``segment_ids`` and restarting ``position_ids`` (the
inputs :func:`aligner.model.llama.build_attention_mask` / ``default_position_ids`` consume).

Conventions: T is the longest sequence in the batch (dynamic padding), never a fixed length.
``loss_mask[b, t] = 1`` where ``input_ids[b, t]`` is a response token to be predicted: the
trainer compares logits at t-1 with the token at t, so the first token of every document
(a prompt token) is never a target and packed documents never predict across a boundary.

Packing: first-fit in order, rows of at most ``max_seq_len`` tokens; deterministic.
"""

from __future__ import annotations

import torch


def _pad(seqs: list[list[int]], value, dtype: torch.dtype, length: int | None = None) -> torch.Tensor:
    t = length if length is not None else max(len(s) for s in seqs)
    out = torch.full((len(seqs), t), value, dtype=dtype)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=dtype)
    return out


def _lengths_mask(lengths: list[int], t: int) -> torch.Tensor:
    return (torch.arange(t).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()


def collate_sft(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """SFT examples -> input_ids [B, T] int64 (right padded with pad_id), attention_mask [B, T] int64
    (1 = real token), loss_mask [B, T] float32 (1.0 = response token)."""
    if not examples:
        raise ValueError("collate_sft: empty batch")
    ids = _pad([e["input_ids"] for e in examples], pad_id, torch.int64)
    t = ids.shape[1]
    return {
        "input_ids": ids,
        "attention_mask": _lengths_mask([len(e["input_ids"]) for e in examples], t),
        "loss_mask": _pad([e["loss_mask"] for e in examples], 0, torch.float32, t),
    }


def collate_pairs(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Pair examples -> chosen_input_ids, rejected_input_ids [B, T] int64 and their attention masks
    [B, T] int64; both sides padded to the same T (so the RM can run them as one [2B, T] batch);
    plus prompt_lens [B] int64 (the prompt tokens both sides share, which DPO's response
    log-probs start after) when the examples carry ``prompt_len``."""
    if not examples:
        raise ValueError("collate_pairs: empty batch")
    t = max(max(len(e["chosen_ids"]), len(e["rejected_ids"])) for e in examples)
    out = {}
    for side in ("chosen", "rejected"):
        seqs = [e[f"{side}_ids"] for e in examples]
        out[f"{side}_input_ids"] = _pad(seqs, pad_id, torch.int64, t)
        out[f"{side}_attention_mask"] = _lengths_mask([len(s) for s in seqs], t)
    if all("prompt_len" in e for e in examples):
        out["prompt_lens"] = torch.tensor([e["prompt_len"] for e in examples], dtype=torch.int64)
    return out


def collate_prompts(examples: list[dict]) -> dict[str, list]:
    """RL prompt examples -> {"prompt_ids": list[list[int]] (ragged, for the rollout engine),
    "prompts": list[str], "metadata": list[dict] (rule-reward references, e.g. "answer")}."""
    return {
        "prompt_ids": [list(e["prompt_ids"]) for e in examples],
        "prompts": [e["prompt"] for e in examples],
        "metadata": [dict(e["metadata"]) for e in examples],
    }


def pack_sft(examples: list[dict], max_seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Greedy (first-fit, in order) packing of SFT examples into rows of <= max_seq_len tokens.

    Returns input_ids [B, T] int64, loss_mask [B, T] float32, segment_ids [B, T] int64
    (1, 2, 3, ... per document within a row; 0 = padding), position_ids [B, T] int64
    (restarting at 0 per document; 0 on padding) and attention_mask [B, T] int64 (1 = real).
    Raises ValueError for an example longer than max_seq_len (truncate it first).
    """
    rows: list[list[int]] = []  # example indices per row
    used: list[int] = []
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        if n > max_seq_len:
            raise ValueError(f"{e.get('source', i)}: example has {n} tokens > max_seq_len={max_seq_len}: truncate it before packing")
        for r, u in enumerate(used):
            if u + n <= max_seq_len:
                rows[r].append(i)
                used[r] += n
                break
        else:
            rows.append([i])
            used.append(n)
    ids, mask, seg, pos = [], [], [], []
    for row in rows:
        ids.append([t for i in row for t in examples[i]["input_ids"]])
        mask.append([m for i in row for m in examples[i]["loss_mask"]])
        seg.append([k + 1 for k, i in enumerate(row) for _ in examples[i]["input_ids"]])
        pos.append([p for i in row for p in range(len(examples[i]["input_ids"]))])
    t = max(used)
    return {
        "input_ids": _pad(ids, pad_id, torch.int64, t),
        "loss_mask": _pad(mask, 0, torch.float32, t),
        "segment_ids": _pad(seg, 0, torch.int64, t),
        "position_ids": _pad(pos, 0, torch.int64, t),
        "attention_mask": _lengths_mask(used, t),
    }
