"""A deterministic, resumable sampler over a list of examples (used by the SFT, RM and PPO trainers).

Owns: :class:`DataIterator`: seeded per-epoch shuffling, batches that run across epoch
boundaries, and an (epoch, position) state_dict that resumes to the exact next example.

Epoch e's order is ``torch.randperm(n)`` under a generator seeded with ``seed + e`` (so
any epoch's order is recomputable without replaying earlier ones). Sharding across dp
ranks is the caller's job (the single-controller driver splits each batch).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


class DataIterator:
    """Endless, seeded, resumable iteration over `examples`.

    examples: any sequence (records, encoded examples); seed: int; shuffle: False keeps the
    file order every epoch.
    """

    def __init__(self, examples: Sequence[Any], seed: int = 0, shuffle: bool = True):
        if len(examples) == 0:
            raise ValueError("DataIterator: no examples (the dataset is empty after filtering)")
        self.examples = examples
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # index into this epoch's order of the next example
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self.examples)

    def _epoch_order(self, epoch: int) -> list[int]:
        n = len(self.examples)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=g).tolist()

    def next_batch(self, n: int) -> list[Any]:
        """The next `n` examples (crossing into the next epoch, reshuffled, when this one ends)."""
        if n < 1:
            raise ValueError(f"DataIterator.next_batch: n={n} must be >= 1")
        out = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(n - len(out), len(self._order) - self.position)
            out.extend(self.examples[i] for i in self._order[self.position : self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict:
        """{"epoch", "position", "seed", "shuffle", "num_examples"}: plain ints/bools, JSON-safe."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_examples": len(self.examples),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`; ValueError when the dataset size differs (different data)."""
        if state["num_examples"] != len(self.examples):
            raise ValueError(
                f"DataIterator: checkpoint was taken over {state['num_examples']} examples, this dataset has "
                f"{len(self.examples)}: resume with the same data.* settings and files"
            )
        if not 0 <= state["position"] <= state["num_examples"]:
            raise ValueError(f"DataIterator: position={state['position']} is outside [0, {state['num_examples']}]")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)
