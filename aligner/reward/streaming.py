"""Rewards requested while an engine generates (``reward.stream``): the bookkeeping both streamed
scorers share (:class:`aligner.reward.remote.StreamedScores` for an HTTP endpoint,
:class:`aligner.workers.reward.StreamedJudge` for the judges of the reward group).

The engine's ``on_finish(index, token_ids)`` callback (:meth:`StreamedResponses.finished`) queues each
response as its row ends; once ``chunk`` are queued the subclass's ``_send`` ships them (an HTTP
request, a judge call) while the engine decodes the rest. After the engine returns, the scorer's
``attach(gens)`` queues what was never reported (:meth:`StreamedResponses.queue_unreported`: a rank
whose engine did not run the scheduler), sends it and waits.
"""

from __future__ import annotations

from typing import Sequence


class StreamedResponses:
    """The queue of finished responses of one generate call; ``chunk`` (>= 1) responses per send.

    Attributes: ``responses`` {index: token ids}, ``queued`` (indices not sent yet), ``early`` (the
    indices sent before the engine returned: the overlap). Subclasses implement ``_send()``, which
    ships ``self.queued`` and empties it."""

    def __init__(self, chunk: int) -> None:
        if chunk < 1:
            raise ValueError(f"chunk={chunk} is invalid: a streamed send holds >= 1 response")
        self.chunk = int(chunk)
        self.responses: dict[int, list[int]] = {}
        self.queued: list[int] = []
        self.early: set[int] = set()

    def finished(self, index: int, token_ids: Sequence[int]) -> None:
        """The engine's on_finish: request `index` ended with `token_ids`; sends when `chunk` are queued."""
        self.responses[index] = [int(t) for t in token_ids]
        self.queued.append(index)
        if len(self.queued) >= self.chunk:
            self.early.update(self.queued)
            self._send()

    def queue_unreported(self, gens: Sequence) -> None:
        """After the engine returned its Generations: queue the ones on_finish never reported and send
        everything still queued."""
        for i, g in enumerate(gens):
            if i not in self.responses:
                self.responses[i] = [int(t) for t in g.token_ids]
                self.queued.append(i)
        if self.queued:
            self._send()

    def _send(self) -> None:
        raise NotImplementedError
