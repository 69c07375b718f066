"""Captured CUDA graphs of the batched backend's forward, one per shape, replayed instead of launched kernel by kernel.

A small model's decode step on a GPU is bound by launching hundreds of
kernels from Python; a replayed graph launches them at once. A graph is
recorded per (rows, tokens per row, cache width, logits kept) the first time
that shape runs, so the set of batch sizes and k in use gets captured as it
appears. A graph reads and writes the exact cache buffers it was recorded
with, so any reallocation (a row joins or leaves, the cache grows) drops
them all; every other tensor it reads must be one of its inputs, copied into
its static inputs before each replay (a tensor made anew at each step would
be read from memory freed since the capture). Only used on CUDA; on a CPU the backend never creates this.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch

Inputs = dict[str, torch.Tensor]


class Replayable(Protocol):
    def replay(self) -> None: ...


class CudaGraphs:
    def __init__(self) -> None:
        self.graphs: dict[tuple[int, ...], tuple[Replayable, Inputs, torch.Tensor]] = {}
        self.failed = False
        self.replays = 0  # steps run through a graph (checks and benchmarks read it)

    def clear(self) -> None:
        self.graphs.clear()

    def run(
        self, shape: tuple[int, ...], inputs: Inputs, forward: Callable[[Inputs], torch.Tensor]
    ) -> torch.Tensor | None:
        """The forward's output through the graph of ``shape`` (recorded now if new); None if graphs cannot be used."""
        if self.failed:
            return None
        entry = self.graphs.get(shape)
        if entry is None:
            entry = self._record(inputs, forward)
            if entry is None:
                return None
            self.graphs[shape] = entry
        graph, static, output = entry
        for name, tensor in inputs.items():
            static[name].copy_(tensor)
        graph.replay()
        self.replays += 1
        return output.clone()  # the next replay overwrites the graph's output buffer

    def _record(
        self, inputs: Inputs, forward: Callable[[Inputs], torch.Tensor]
    ) -> tuple[Replayable, Inputs, torch.Tensor] | None:
        # The graph reads only these static copies (refreshed in place before each replay) and buffers that outlive it.
        static = {name: tensor.clone() for name, tensor in inputs.items()}
        try:
            graph, output = self.capture(partial(forward, static))
        except RuntimeError as exc:  # an operation that cannot be captured (a host sync in the model's code)
            self.failed = True
            warnings.warn(
                f"CUDA graph capture failed ({exc}); the batched backend runs without graphs",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        return graph, static, output

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Replayable, torch.Tensor]:
        """Record ``step`` into a CUDA graph; return the graph and the output buffer its replays write."""
        # Warm up on a side stream (allocator and library workspaces), as graph capture requires; the warm-up
        # writes the same cache states the replay will write, so it changes nothing.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = step()
        return graph, output
