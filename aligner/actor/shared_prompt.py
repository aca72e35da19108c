"""Shared-prompt packing: the G samples of one prompt in one row, the prompt's positions computed once.

GRPO, RLOO and any run with ``trainer.n_samples_per_prompt`` = G > 1 train on G responses to
each prompt. In the padded [B, T] layout every forward and backward runs the prompt's positions
G times. Packed, one row holds the prompt once and its G responses after it::

    [p_0 .. p_{P-1} | r1_0 .. r1_{L1-1} | r2_0 .. r2_{L2-1} | ... | rG_0 .. rG_{LG-1} | pad]

Response k's token j keeps its RoPE position P + j (as in its own padded row) and attends to the
prompt and to its own earlier tokens only (a block mask [T, T]: causal, and key segment = prompt
or = the query's segment). Every position therefore sees exactly the keys and values it sees in
the padded row, so its hidden states, the response log-probs, the losses and the gradients are
the padded layout's up to GEMM rounding; the prompt positions' gradient is the sum over the G
samples, as it is over G padded rows. Trailing padding after each response's last unmasked token
is dropped too. The same construction is the shared-prefix forward of Prefix Grouper (Liu et al.
2025, "Prefix Grouper: Efficient GRPO Training through Shared-Prefix Forward").

Cost and limits: a dense boolean mask of T x T per row of a micro-batch (T = P + sum of the
response lengths; the model builds it from ``prompt_segments``) and SDPA's masked kernel instead
of its causal one, so rows are packed only up to a length limit
(``trainer.shared_prompt_pack_len``); groups are detected from the data (consecutive rows with
the same prompt ids), and a batch whose rows do not form equal groups of G > 1 stays padded.
"""

from __future__ import annotations

from typing import Optional

import torch

from aligner.protocol import response_index


def prompt_groups(input_ids: torch.Tensor, prompt_lens: torch.Tensor) -> int:
    """G when the B rows are B / G consecutive groups of G > 1 rows sharing one prompt, else 1.

    input_ids: [B, T] int64 with each row's prompt at positions 0..prompt_lens[b]-1;
    prompt_lens: [B] int64. Rows share a prompt when their prompt lengths and prompt ids are equal.
    Two neighbouring groups with the same prompt make one run of 2G: the runs are then unequal
    (unless every group has a twin) and the batch stays padded.
    """
    b = input_ids.shape[0]
    if b < 2:
        return 1
    lens = prompt_lens.tolist()
    runs, n = [], 1
    for i in range(1, b):
        if lens[i] == lens[i - 1] and torch.equal(input_ids[i, : lens[i]], input_ids[i - 1, : lens[i]]):
            n += 1
        else:
            runs.append(n)
            n = 1
    runs.append(n)
    g = runs[0]
    return g if g > 1 and all(r == g for r in runs) else 1


def response_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    """[B, R] -> [B] int64: one past each row's last unmasked response token (0 for none). Tokens
    after it are padding; masked tokens before it stay in the packed row (they are context)."""
    r = response_mask.shape[1]
    idx = torch.arange(1, r + 1, device=response_mask.device).expand_as(response_mask)
    return torch.where(response_mask > 0, idx, torch.zeros_like(idx)).amax(dim=1)


def pack_shared_prompts(
    batch: dict[str, torch.Tensor], g: int, sample_keys: tuple[str, ...], multiple: int = 1, max_len: int = 0
) -> Optional[dict[str, torch.Tensor]]:
    """The packed model inputs of `batch`, or None when a packed row would exceed `max_len` (> 0).

    batch: input_ids [B, T] int64, prompt_lens [B], response_mask [B, R], and the per-sample
    [B, R] tensors named in `sample_keys` (response_mask among them if wanted), in groups of `g`
    consecutive rows sharing a prompt (:func:`prompt_groups`). n = B / g packed rows of length
    T' (the longest packed row, rounded up to `multiple`: sequence parallelism's tp).

    Returns input_ids [n, T'], position_ids [n, T'], prompt_segments [n, T'] int64 (0 prompt, k + 1
    sample k's response, -1 padding: the model builds each micro-batch's block mask from it,
    :func:`aligner.model.llama.shared_prompt_mask`), head_index [n, g R] int64 (the positions whose logits predict response token j of sample k, at
    k R + j; masked tokens point at the last prompt position), labels [n, g R] (those tokens), and
    each of `sample_keys` as [n, g, R]. Undo with :func:`unpack_output` / :func:`unpack_micro`.
    """
    ids, pl, mask = batch["input_ids"], batch["prompt_lens"].long(), batch["response_mask"]
    b, r = mask.shape
    n = b // g
    lens = response_lengths(mask)
    plen = pl.view(n, g)[:, 0]
    row_len = plen + lens.view(n, g).sum(1)
    t = int(row_len.max())
    t += (-t) % max(1, multiple)
    if max_len > 0 and t > max_len:
        return None
    labels = ids.gather(1, response_index(pl, r, ids.shape[1] - 1) + 1)
    out_ids = torch.zeros(n, t, dtype=ids.dtype)
    pos = torch.zeros(n, t, dtype=torch.long)
    seg = torch.full((n, t), -1, dtype=torch.long)
    head = torch.empty(n, g * r, dtype=torch.long)
    for i in range(n):
        p = int(plen[i])
        out_ids[i, :p] = ids[i * g, :p]
        pos[i, :p] = torch.arange(p)
        seg[i, :p] = 0
        off = p
        for k in range(g):
            row, length = i * g + k, int(lens[i * g + k])
            out_ids[i, off : off + length] = ids[row, p : p + length]
            pos[i, off : off + length] = torch.arange(p, p + length)
            seg[i, off : off + length] = k + 1
            h = torch.full((r,), p - 1, dtype=torch.long)
            if length > 1:
                h[1:length] = torch.arange(off, off + length - 1)  # token j is predicted at token j-1's position
            head[i, k * r : (k + 1) * r] = h
            off += length
        pos[i, off:] = torch.arange(t - off)
    out = {
        "input_ids": out_ids,
        "position_ids": pos,
        "prompt_segments": seg,
        "head_index": head,
        "labels": labels.reshape(n, g * r),
    }
    for k in sample_keys:
        out[k] = batch[k].reshape(n, g, r)
    return out


def unpack_output(output, r: int):
    """A packed micro-batch's model output -> the padded layout's: (log_probs, entropy) [n, g R]
    -> [n g, R] each, or logits [n, g R, V] -> [n g, R, V]."""
    if isinstance(output, tuple):
        return tuple(o.reshape(-1, r) for o in output)
    return output.reshape(-1, r, output.shape[-1])


def unpack_micro(mb: dict, sample_keys: tuple[str, ...], r: int) -> dict:
    """A packed micro-batch -> its per-sample view: `sample_keys` [n, g, R] -> [n g, R], labels
    [n, g R] -> [n g, R] (what the padded layout's loss functions read)."""
    out = dict(mb)
    for k in sample_keys:
        if k in out:
            out[k] = out[k].flatten(0, 1)
    out["labels"] = out["labels"].reshape(-1, r)
    return out
