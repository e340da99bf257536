"""The decode's finished rows, copied from the decoder's device into host frames without stalling the device or the
thread that issues its work.

From CUDA into pinned memory, each frame's rows (contiguous in ``out``) are copied asynchronously on the decoding
stream. Into pageable memory (the host frames the nodes hand on), the rows go asynchronously to a pinned staging
tensor, and a copier thread of the sink's own waits for them and writes them into ``out``: the host's copy (and the
first touch of each page of ``out``) then never runs on the thread that launches the next tile's kernels, which
is the thread the device waits on. At most ``MAX_STAGED`` such copies are in flight (pinned memory is bounded).
Anything else (CPU decoding, or ``out`` on the decoder's device) is a plain copy.

``when_written`` runs a callback once the rows put so far are in ``out``, on the calling thread, at a later
``put`` or at ``close``, so handing finished frames on never waits for the device or the copier."""

from __future__ import annotations

import collections
import queue
import threading
from typing import Callable

import torch

from .mp4 import pixels_uint8

__all__ = ["HostSink", "MAX_STAGED"]

MAX_STAGED = 2  # staged copies in flight: one being written into out, one arriving from the device


class _Staged:
    """One put's rows in pinned staging tensors, with the event after their copies off the device."""

    def __init__(self, event, pairs, frame0: int, top: int, stop: int):
        self.event, self.pairs, self.frame0, self.top, self.stop = event, pairs, frame0, top, stop
        self.written = threading.Event()


class HostSink:
    """Copies finished rows ``[f, stop - top, W, 3]`` from ``device`` into ``out`` (and, as 8-bit values, into
    ``pixels`` when given): see the module's docstring. ``close`` waits for every copy and stops the copier;
    ``stop`` does so without waiting for anything still to arrive (after a failure or a cancel)."""

    def __init__(self, out: torch.Tensor, device: torch.device, pixels: torch.Tensor | None = None):
        self.out, self.pixels = out, pixels
        self.mode = "plain"
        if device.type == "cuda" and out.device.type == "cpu":
            self.mode = "pinned" if out.is_pinned() and (pixels is None or pixels.is_pinned()) else "staged"
        self.waiting: list = []  # (marker, callback), run in order once the rows put before them arrived
        self._staged: collections.deque[_Staged] = collections.deque()  # handed to the copier, oldest first
        self._jobs = None  # the copier's queue (staged mode, started at the first put)
        self._copier: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._inference = torch.is_inference_mode_enabled()  # the copier writes out as the decode's thread would

    # -- the copier (staged mode)
    def _start_copier(self) -> None:
        self._jobs = queue.SimpleQueue()
        self._copier = threading.Thread(target=self._copy_arrivals, name="h3-decode-copy-out", daemon=True)
        self._copier.start()

    def _copy_arrivals(self) -> None:
        with torch.inference_mode(self._inference):
            self._copy_each()

    def _copy_each(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if self._failure is None:
                    job.event.synchronize()
                    for target, pinned in job.pairs:
                        target[job.frame0 : job.frame0 + pinned.shape[0], job.top : job.stop] = pinned
            except BaseException as exc:  # raised on the decode's thread by its next put or close
                self._failure = exc
            finally:
                job.pairs = None  # the staging tensors go back to the pinned allocator's cache
                job.written.set()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    # -- the decode's side
    def when_written(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once every row put so far is in ``out`` (and ``pixels``)."""
        if self.mode == "plain" or (self.mode == "staged" and not self._staged and not self.waiting):
            callback()
            return
        if self.mode == "pinned":
            marker = torch.cuda.Event()
            marker.record()
        else:
            marker = self._staged[-1].written if self._staged else None
        self.waiting.append((marker, callback))

    def _arrived(self, marker) -> bool:
        if marker is None:
            return True
        return marker.is_set() if isinstance(marker, threading.Event) else marker.query()

    def _run_arrived(self, everything: bool = False) -> None:
        while self._staged and self._staged[0].written.is_set():
            self._staged.popleft()
        while self.waiting:
            marker, callback = self.waiting[0]
            if not everything and not self._arrived(marker):
                return
            self.waiting.pop(0)
            callback()

    def put(self, frame0: int, top: int, stop: int, rows: torch.Tensor) -> None:
        """``rows`` ``[f, stop - top, W, 3]`` on the decoder's device, already in ``out``'s dtype."""
        pairs = [(self.out, rows)]
        if self.pixels is not None:
            pairs.append((self.pixels, pixels_uint8(rows)))
        if self.mode == "plain":
            for target, values in pairs:
                target[frame0 : frame0 + values.shape[0], top:stop] = values.to(target.device)
        elif self.mode == "pinned":
            for target, values in pairs:
                for i, frame in enumerate(values):
                    target[frame0 + i, top:stop].copy_(frame, non_blocking=True)
        else:
            self._raise_failure()
            if self._copier is None:
                self._start_copier()
            staged = []
            for target, values in pairs:
                pinned = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                pinned.copy_(values, non_blocking=True)
                staged.append((target, pinned))
            event = torch.cuda.Event()
            event.record()
            while len(self._staged) >= MAX_STAGED:  # bound the pinned memory in flight
                self._staged[0].written.wait()
                self._run_arrived()
            self._staged.append(_Staged(event, staged, frame0, top, stop))
            self._jobs.put(self._staged[-1])
        self._run_arrived()

    def _stop_copier(self) -> None:
        if self._copier is not None:
            self._jobs.put(None)
            self._copier.join()
            self._copier = None

    def close(self) -> torch.Tensor:
        """Wait until every row put so far is in ``out`` (and ``pixels``), run the callbacks still waiting."""
        self._stop_copier()
        self._raise_failure()
        if self.mode == "pinned":
            torch.cuda.current_stream().synchronize()
        self._run_arrived(everything=True)
        return self.out

    def stop(self) -> None:
        """Stop the copier after a failure or a cancel: nothing more is written, no callback runs."""
        if self._copier is not None:
            self._failure = self._failure or InterruptedError("the decode stopped")
            self._stop_copier()
        self.waiting.clear()
