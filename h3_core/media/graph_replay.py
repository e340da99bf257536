"""A function of one CUDA tensor replayed from CUDA graphs, one graph per input shape.

The video decoder runs the same few hundred kernels for every batch of tiles in a clip; captured once and
replayed, a batch costs no launches and no guard checks of the compiled functions between them
(``bench/results/decoder_paths.md``). The graphs of one ``GraphReplay`` share one memory pool and live as
long as it does (a decode's), so nothing stays reserved after the decode.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

__all__ = ["GraphReplay"]

log = logging.getLogger(__name__)


class GraphReplay:
    """``fn(x)`` for CUDA tensors ``x``, from a CUDA graph captured on the second call with ``x``'s shape (the
    first runs ``fn`` as written, which compiles and warms what it calls). At most ``shapes`` graphs are kept;
    other shapes, CPU tensors and every call after a capture failed run ``fn`` as written.

    A replayed result is the graph's own output tensor: the next call with the same shape overwrites it, so
    the caller reads (or copies) it before calling again. ``fn`` must not synchronise with the host or change
    its kernels between calls with the same shape."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], shapes: int = 2):
        self.fn, self.shapes = fn, shapes
        self.seen: set = set()
        self.graphs: dict = {}
        self.pool = None
        self.failed = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.failed or not x.is_cuda:
            return self.fn(x)
        try:
            return self._run(x)
        except torch.OutOfMemoryError:
            # the caller retries smaller: the graphs' pool must not hold memory it needs
            self.release()
            raise

    def release(self) -> None:
        """Drop the graphs and their pool; every later call runs ``fn`` as written."""
        self.failed = True
        self.graphs.clear()
        self.pool = None
        torch.cuda.empty_cache()

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        key = (tuple(x.shape), x.dtype, x.device)
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.seen or len(self.graphs) >= self.shapes:
                self.seen.add(key)
                return self.fn(x)
            entry = self._capture(x)
            if entry is None:
                return self.fn(x)
            self.graphs[key] = entry
        graph, static_in, static_out = entry
        static_in.copy_(x)
        graph.replay()
        return static_out

    def _capture(self, x: torch.Tensor):
        static_in = x.clone()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread's CUDA calls (the host's, an encoder's) do not break this capture
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                static_out = self.fn(static_in)
        except Exception as exc:  # out of memory, or an operation a graph cannot hold: run as written from now on
            self.release()
            log.warning("capturing a CUDA graph failed (%s: %s); running without graphs", type(exc).__name__, exc)
            return None
        self.pool = graph.pool()
        return graph, static_in, static_out
