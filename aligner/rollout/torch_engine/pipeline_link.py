"""The pipeline link of the continuous scheduler: step plans and hidden states down the pipeline stages, tokens back.

With pp > 1 pp rank 0 schedules (:class:`aligner.rollout.torch_engine.scheduler.SlotScheduler`), runs its
layers on a step and sends the step's plan (:class:`PlanMeta`) with the hidden states to pp rank
1, and so on; the last pipeline stage samples and sends the tokens and log-probs back to pp rank 0
(:class:`PipelineLink`). The slot pool is split into ``micro_batches`` blocks and pp rank 0 keeps
one block's step in flight per pipeline stage: while pp rank 1 runs block 0, pp rank 0 runs block 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from aligner.nn import comm
from aligner.rollout.torch_engine.scheduler import StepPlan


@dataclass
class PlanMeta:
    """A StepPlan as tensors (what later pipeline stages need): int64 prefill_rows [U], copies and
    moves [k, 3] (src, dst, length), positions / requests / steps [n]; prefill_len T."""

    start: int
    prefill_len: int
    prefill_rows: torch.Tensor
    copies: torch.Tensor
    moves: torch.Tensor
    positions: torch.Tensor
    requests: torch.Tensor
    steps: torch.Tensor

    def encode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(header int64 [8], body int64 [...]) for the wire."""
        u, c, m, n = self.prefill_rows.numel(), self.copies.shape[0], self.moves.shape[0], self.positions.numel()
        header = torch.tensor([1, self.start, self.prefill_len, u, c, m, n, 0], dtype=torch.long)
        body = torch.cat([self.prefill_rows, self.copies.flatten(), self.moves.flatten(), self.positions, self.requests, self.steps])
        return header, body

    @staticmethod
    def decode(header: torch.Tensor, body: torch.Tensor) -> PlanMeta:
        _, start, t, u, c, m, n, _ = header.tolist()
        parts = body.split([u, 3 * c, 3 * m, n, n, n])
        return PlanMeta(start, t, parts[0], parts[1].view(c, 3), parts[2].view(m, 3), parts[3], parts[4], parts[5])


def plan_meta(plan: StepPlan, prefill_len: int) -> PlanMeta:
    """`plan` as tensors on the CPU; prefill_len: T, the padded length its prefill rows run at."""

    def triples(x):
        return torch.tensor(x, dtype=torch.long).view(-1, 3)

    return PlanMeta(
        plan.start,
        prefill_len,
        torch.tensor(plan.prefill_rows, dtype=torch.long),
        triples(plan.copies),
        triples(plan.moves),
        torch.tensor(plan.positions, dtype=torch.long),
        torch.tensor(plan.requests, dtype=torch.long),
        torch.tensor(plan.steps, dtype=torch.long),
    )


class PipelineLink:
    """Point-to-point messages of the pipelined continuous engine over the pp group.

    Plans flow pp rank s -> s + 1 as (header [8], body, prefill hidden [U, T, H] when U > 0,
    decode hidden [n, 1, H]); the last pipeline stage sends (tokens [n] int64, log_probs [n] fp32) back
    to pp rank 0. Sends are non-blocking; a pipeline stage waits for its previous message before sending
    the next (so at most one message per link is unreceived, and no send cycle can deadlock).
    A header of zeros ends the call.

    Args:
        pp_group: the engine's pipeline group (this pipeline stage's index = its rank in it).
        device: where the messages' tensors live. dtype, hidden: the hidden states' dtype and size H.
    """

    def __init__(self, pp_group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, hidden: int):
        self.group, self.dev = pp_group, device
        self.dtype, self.hidden = dtype, hidden
        rank, size = comm.group_rank(pp_group), comm.group_size(pp_group)
        self.prev = dist.get_global_rank(self.group, rank - 1) if rank > 0 else None
        self.next = dist.get_global_rank(self.group, rank + 1) if rank < size - 1 else None
        self.first, self.last = dist.get_global_rank(self.group, 0), dist.get_global_rank(self.group, size - 1)
        self._sent: list = []

    def wait(self) -> None:
        """Block until this pipeline stage's last message has been sent."""
        for work, _ in self._sent:
            work.wait()
        self._sent = []

    def _send(self, tensors: list[torch.Tensor], dst: int) -> None:
        self.wait()
        self._sent = [(dist.isend(t.contiguous(), dst=dst, group=self.group), t) for t in tensors]

    def _recv(self, shape, dtype, src: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.dev)
        dist.recv(t, src=src, group=self.group)
        return t

    def send_plan(self, meta: PlanMeta, prefill_h: Optional[torch.Tensor], decode_h: torch.Tensor) -> None:
        """To the next pipeline stage: the plan, its prefill hidden states [U, T, H] (None when U = 0) and decode ones [n, 1, H]."""
        header, body = meta.encode()
        self._send([header.to(self.dev), body.to(self.dev)] + ([prefill_h] if prefill_h is not None else []) + [decode_h], self.next)

    def recv_plan(self):
        """(meta, prefill hidden or None, decode hidden) from the previous pipeline stage, or None at the end."""
        header = self._recv((8,), torch.long, self.prev).cpu()
        if int(header[0]) == 0:
            return None
        u, c, m, n = (int(x) for x in header[3:7])
        body = self._recv((u + 3 * c + 3 * m + 3 * n,), torch.long, self.prev).cpu()
        meta = PlanMeta.decode(header, body)
        prefill_h = self._recv((u, meta.prefill_len, self.hidden), self.dtype, self.prev) if u else None
        return meta, prefill_h, self._recv((n, 1, self.hidden), self.dtype, self.prev)

    def send_tokens(self, tok: torch.Tensor, lp: torch.Tensor) -> None:
        """Last pipeline stage to pp rank 0: a step's tokens [n] int64 and log-probs [n] (sent as fp32)."""
        self._send([tok, lp.float()], self.first)

    def recv_tokens(self, n: int) -> tuple[list[int], list[float]]:
        """pp rank 0: the last pipeline stage's tokens and log-probs of a step of n rows."""
        tok = self._recv((n,), torch.long, self.last)
        lp = self._recv((n,), torch.float32, self.last)
        return tok.tolist(), lp.tolist()

    def send_stop(self) -> None:
        """End the call on the next pipeline stage (a header of zeros); no-op on the last one."""
        if self.next is not None:
            self._send([torch.zeros(8, dtype=torch.long, device=self.dev)], self.next)
