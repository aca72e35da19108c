"""References for the rollout engines' output."""

from __future__ import annotations

import torch


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens after `prompt` by a full forward of the whole sequence per token (no KV cache)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]
