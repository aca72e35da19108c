"""The rollout engine's KV caches: :class:`StaticKVCache` (static scheduler) and :class:`SlotKVCache`
(continuous scheduler).

Both implement the interface the model's attention calls (:class:`aligner.model.llama.KVCache`):
``update(layer, k, v, positions) -> (k, v)`` once per layer and forward, and optionally
``attend(layer, q, k, v, cos, sin)``. Keys are layer indices of this pipeline stage's own layers
(a pipeline stage's cache holds its local layers only); k/v are [rows, kv_heads_local, max_len, head_dim]
(kv heads divided by tp under tensor parallelism).
"""

from __future__ import annotations

from typing import Optional

import torch

from aligner.rollout.torch_engine.cpu_kernels import check_decode_lengths, decode_attention


class StaticKVCache:
    """The static scheduler's KV cache: per local layer k, v [B, kv_heads_local, max_len, hd], zeros.

    Rows are left-padded by the engine, so one slot index along max_len holds the same column for
    every row: writes go to `positions` (slots) and attention reads slots [0, ``length``), which
    the engine sets before each forward.
    """

    def __init__(self, layers: list[int], batch: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.max_len = max_len
        self.length = 0  # slots in use; attention reads [0, length)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v: [B, kvh, Tq, hd] at slots `positions` [Tq]; return the valid cache prefix."""
        self.k[layer].index_copy_(2, positions, k)
        self.v[layer].index_copy_(2, positions, v)
        return self.k[layer][:, :, : self.length], self.v[layer][:, :, : self.length]


class SlotKVCache:
    """The continuous scheduler's KV cache: per local layer k, v [slots, kv_heads_local, max_len, hd].

    Row r holds one request at cache positions [0, its length) (no padding, position = slot).
    The engine sets what the next forward writes, then the model's attention calls
    :meth:`update` once per layer (the ``cache_positions`` it passes are ignored):
    - :meth:`plan_prefill` (rows [U]): write the new prompts' k/v [U, kvh, T, hd] at positions
      [0, T) of those rows; attention uses the prompts' own k/v (causal, right padding).
    - :meth:`plan_decode` (start, positions [n], length): write each row's one new k/v at its own
      position in rows [start, start + n); attention reads those rows' positions [0, length).
    - :meth:`plan_extend` (rows [U], offsets [U], lengths [U]): an episode's continuation after an
      observation: row u's new k/v [T (right-padded), ...] are written at positions
      [offset_u, offset_u + length_u) and attention reads its positions [0, max(offset + length))
      under the engine's mask (each query sees its row's keys up to its own position).
    Unwritten slots are zeros (finite), so masked keys never turn into NaN (with ``varlen`` they
    are left uninitialized: nothing reads them).
    varlen: a decode step runs :func:`aligner.rollout.torch_engine.cpu_kernels.decode_attention` (:meth:`attend`),
    which rotates q and k, stores k and v and reads each row's keys up to its own position only,
    instead of RoPE, :meth:`update` and SDPA over [0, length) with the engine's mask (fp32 CPU
    caches only).
    """

    def __init__(
        self,
        layers: list[int],
        slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype,
        device,
        varlen: bool = False,
        zeroed: bool = False,
    ):
        shape = (slots, kv_heads, max_len, head_dim)
        self.varlen = varlen and dtype == torch.float32 and torch.device(device).type == "cpu"
        # varlen decode reads written positions only; an extension's attention reads [0, the longest row's
        # end) of every row it extends, so with episodes (zeroed) unwritten slots must be finite zeros
        alloc = torch.empty if self.varlen and not zeroed else torch.zeros
        self.k = {i: alloc(shape, dtype=dtype, device=device) for i in layers}
        self.v = {i: alloc(shape, dtype=dtype, device=device) for i in layers}
        self.slots, self.max_len = slots, max_len
        self._decode = False
        self._extend = False
        self._rows = self._flat = self._lengths = self._valid = None
        self._start = self._end = self._length = 0

    def plan_prefill(self, rows: torch.Tensor) -> None:
        self._decode, self._extend, self._rows = False, False, rows

    def plan_extend(self, rows: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor) -> int:
        """Rows [U] take new k/v at [offsets_u, offsets_u + lengths_u) (int64 [U] each); returns the
        key length the attention reads, max(offsets + lengths)."""
        self._decode, self._extend, self._rows = False, True, rows
        t = int(lengths.max())
        kvh = next(iter(self.k.values())).shape[1]
        j = torch.arange(t, device=rows.device)
        self._valid = j.unsqueeze(0) < lengths.unsqueeze(1)  # [U, T]: the real (unpadded) new tokens
        # each real token's place in the cache seen as [slots * kvh * max_len, hd], for every kv head: [N, kvh]
        pos = (offsets.unsqueeze(1) + j)[self._valid]  # [N]
        row = rows.unsqueeze(1).expand(-1, t)[self._valid]
        self._flat = ((row.unsqueeze(1) * kvh + torch.arange(kvh, device=rows.device)) * self.max_len + pos.unsqueeze(1)).reshape(-1)
        self._length = int((offsets + lengths).max())
        return self._length

    def plan_decode(self, start: int, positions: torch.Tensor, length: int) -> None:
        n = positions.shape[0]
        self._extend = False
        self._decode, self._start, self._end, self._length = True, start, start + n, length
        if self.varlen:  # the kernel writes the new k/v itself, at lengths - 1
            self._lengths = (positions + 1).to(torch.int64).contiguous()
            check_decode_lengths(self._lengths, length)
            return
        kvh = next(iter(self.k.values())).shape[1]
        # each new k/v row's place in the cache seen as [slots * kvh * max_len, hd]: one index_copy_
        # per layer instead of advanced indexing over dims 0 and 2 (measured 99 us -> a few us a call)
        rows = torch.arange(start, start + n, device=positions.device).unsqueeze(1) * kvh + torch.arange(kvh, device=positions.device)
        self._flat = (rows * self.max_len + positions.unsqueeze(1)).reshape(-1)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, _positions=None) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [rows, kvh, T, hd] -> the keys and values attention reads (see the class docstring).
        A decode step with ``varlen`` never gets here: :meth:`attend` stores its k, v."""
        ck, cv = self.k[layer], self.v[layer]
        if self._extend:
            hd = k.shape[-1]
            new_k = k.transpose(1, 2)[self._valid]  # [N, kvh, hd]: the real tokens' keys, row-major
            new_v = v.transpose(1, 2)[self._valid]
            ck.view(-1, hd).index_copy_(0, self._flat, new_k.reshape(-1, hd))
            cv.view(-1, hd).index_copy_(0, self._flat, new_v.reshape(-1, hd))
            return ck[self._rows, :, : self._length], cv[self._rows, :, : self._length]
        if not self._decode:
            t = k.shape[2]
            ck[self._rows, :, :t] = k
            cv[self._rows, :, :t] = v
            return k, v
        hd = k.shape[-1]
        ck.view(-1, hd).index_copy_(0, self._flat, k.reshape(-1, hd))
        cv.view(-1, hd).index_copy_(0, self._flat, v.reshape(-1, hd))
        return ck[self._start : self._end, :, : self._length], cv[self._start : self._end, :, : self._length]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """A decode step with ``varlen`` (:class:`aligner.model.llama.KVCache`'s hook): the un-rotated
        q [n, 1, h, hd], k, v [n, 1, kvh, hd] and RoPE tables cos, sin [n, 1, hd] -> [n, 1, h, hd].
        One kernel call (:func:`aligner.rollout.torch_engine.cpu_kernels.decode_attention`) rotates q and k,
        writes k and v at each row's position and attends to its positions [0, position]. None
        otherwise (prefill, or varlen off: the model rotates, calls :meth:`update` and runs SDPA
        with the engine's mask)."""
        if not (self._decode and self.varlen):
            return None
        n, _, h, hd = q.shape
        kvh = k.shape[2]
        out = decode_attention(
            q.view(n, kvh, h // kvh, hd),
            self.k[layer][self._start : self._end, :, : self._length],
            self.v[layer][self._start : self._end, :, : self._length],
            self._lengths, hd**-0.5, checked=True, k_new=k[:, 0], v_new=v[:, 0], cos=cos[:, 0], sin=sin[:, 0],
        )  # fmt: skip
        return out.view(n, 1, h, hd)

    def copy(self, src: int, dst: int, length: int) -> None:
        """Row dst's positions [0, length) := row src's, in every local layer."""
        for ck, cv in zip(self.k.values(), self.v.values()):
            ck[dst, :, :length] = ck[src, :, :length]
            cv[dst, :, :length] = cv[src, :, :length]
