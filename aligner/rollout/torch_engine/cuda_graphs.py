"""CUDA-graph capture of a decode step, shared by both schedulers.

Each scheduler keeps its own captured step (static shapes, its own caches):
:class:`aligner.rollout.torch_engine.static_batching.DecodeGraph` per (batch, cache length) and
:class:`aligner.rollout.torch_engine.continuous_batching.SlotDecodeGraph` per (slots, cache
length); both capture with :func:`capture_cuda_graph`. Weights are copied in place by refit, so a
captured graph reads the new weights at its next replay.
"""

from __future__ import annotations

import torch


def capture_cuda_graph(step, warmups: int = 2) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Run `step` (a no-argument callable returning a tensor, every input a static tensor it reads)
    `warmups` times on a side stream, then capture it: (the graph, its static output tensor).
    The pattern of PyTorch's CUDA-graph notes (warm-up on a side stream so that lazy
    initialization and autotuning happen outside the capture); cuda only."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
