"""Byte ranges of files read before they are asked for: a ``StagedReader`` told the ranges a load will read, in
the order it will read them, fills a ring of staging slabs with them from a background thread while the load
does its own work (building modules, converting layers) between reads.

Ranges are packed back to back into the slabs (a scale of a few bytes shares a slab with the next layer's
codes), each range split where a slab ends. A slab goes back to the ring once every piece in it has been
copied out and the filler has moved past it; before refilling it the filler waits for those copies.

The consumer takes ranges in order. Asking for a range further on passes over the ones before it (their slabs
are released, they are no longer filled); asking for a range that is not expected at all, or was passed over,
gets ``None`` and the caller reads it as if nothing were expected. Nothing is ever waited for that the filler
will not produce, so a wrong plan costs speed, never a hang.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

__all__ = ["ReadAhead", "Span"]

Span = tuple[Path, int, int]  # (file, first byte, byte count)
PIECE_BYTES = 8 << 20  # one pread call's share of a slab piece, so several threads fill a big range at once


@dataclass(eq=False)
class _Slab:
    buffer: torch.Tensor
    view: memoryview
    copies: list = field(default_factory=list)  # events recorded after each copy out of it
    pieces: int = 0  # pieces placed in it and not yet copied out
    sealed: bool = False  # the filler has moved on to another slab


@dataclass(eq=False)
class _Piece:
    slab: _Slab
    start: int  # first byte in the slab
    count: int
    reads: list[Future]


class ReadAhead:
    """Fills ``slabs`` staging buffers of ``slab_bytes`` (pinned when ``pinned``) with ``spans`` in order, the
    reads spread over ``pool``; ``fds`` maps each span's file to what ``read_piece`` reads it by (an open
    descriptor, or the path where each thread opens its own: ``staged_read``). ``take(span)`` yields the
    span's pieces (slab tensor slice, then ``done(event)`` once its copy is queued) or returns None."""

    def __init__(
        self,
        spans: list[Span],
        fds: dict[Path, int | Path],
        pool: ThreadPoolExecutor,
        read_piece: Callable,
        *,
        slab_bytes: int,
        slabs: int,
        pinned: bool,
    ):
        if slab_bytes <= 0 or slabs < 2:
            raise ValueError(f"the read-ahead needs at least 2 slabs of positive size, got {slabs} of {slab_bytes}")
        self.spans, self._fds, self._pool, self._read_piece = spans, fds, pool, read_piece
        self.slab_bytes = slab_bytes
        self._where: dict[Span, deque[int]] = {}
        for position, span in enumerate(spans):
            self._where.setdefault(span, deque()).append(position)
        self._slabs = []
        for _ in range(slabs):
            buffer = torch.empty(slab_bytes, dtype=torch.uint8, pin_memory=pinned)
            self._slabs.append(_Slab(buffer, memoryview(buffer.numpy())))
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for slab in self._slabs:
            self._free.put(slab)
        self._pieces: dict[int, list[_Piece]] = {}  # position -> its pieces filled (or being filled), not taken
        self._cursor = 0  # the position last claimed: the filler skips every earlier one
        self.taken = 0  # ranges handed out from the slabs
        self._lock = threading.Condition()
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._fill_all, name="h3-read-ahead", daemon=True)
        self._thread.start()

    # ---- the filler ------------------------------------------------------------------------------------

    def _fill_all(self) -> None:
        slab, used = None, 0
        try:
            for position, (path, offset, nbytes) in enumerate(self.spans):
                done = 0
                while done < nbytes:
                    if slab is None or used == self.slab_bytes:
                        if slab is not None:
                            self._seal(slab)
                        slab, used = self._next_slab(), 0
                        if slab is None:
                            return
                    with self._lock:
                        if self._stopped:
                            return
                        if position < self._cursor:
                            break  # passed over: not filled
                    count = min(nbytes - done, self.slab_bytes - used)
                    # read_piece(fd, view, start, count, base, path): view[start:start + count] <- file[base + start:]
                    base = offset + done - used
                    reads = [
                        self._pool.submit(self._read_piece, self._fds[path], slab.view, used + s, n, base, path)
                        for s, n in _split(count, PIECE_BYTES)
                    ]
                    with self._lock:
                        placed = position >= self._cursor and not self._stopped
                        if placed:
                            slab.pieces += 1
                            self._pieces.setdefault(position, []).append(_Piece(slab, used, count, reads))
                            self._lock.notify_all()
                    if not placed:  # passed over while it was being read: the bytes are not wanted
                        for read in reads:
                            read.exception()
                        break
                    used += count
                    done += count
            if slab is not None:
                self._seal(slab)
        except BaseException as exc:  # handed to the consumer, which raises it
            with self._lock:
                self._error = exc
                self._lock.notify_all()

    def _next_slab(self) -> _Slab | None:
        slab = self._free.get()
        if slab is None:
            return None
        for event in slab.copies:
            event.synchronize()
        slab.copies.clear()
        slab.sealed = False
        return slab

    def _seal(self, slab: _Slab) -> None:
        with self._lock:
            slab.sealed = True
            free = slab.pieces == 0
        if free:
            self._free.put(slab)

    def _release(self, piece: _Piece, event) -> None:
        if event is not None:
            piece.slab.copies.append(event)
        with self._lock:
            piece.slab.pieces -= 1
            free = piece.slab.pieces == 0 and piece.slab.sealed
        if free:
            self._free.put(piece.slab)

    # ---- the consumer ----------------------------------------------------------------------------------

    def take(self, span: Span) -> Iterator[tuple[torch.Tensor, int, Callable]] | None:
        """The pieces of ``span`` as ``(staging bytes, first byte of the span they hold, done)``, in order, to be
        copied out and then ``done(event)`` (the event recorded after the copy, None on the CPU); None if
        ``span`` is not among the ranges still ahead."""
        with self._lock:
            positions = self._where.get(span)
            while positions and positions[0] < self._cursor:
                positions.popleft()
            if not positions or self._stopped:
                return None
            position = positions.popleft()
            self.taken += 1
            dropped = [piece for p in range(self._cursor, position) for piece in self._pieces.pop(p, [])]
            self._cursor = position
        for piece in dropped:
            for read in piece.reads:
                read.exception()  # let the read finish before its slab is reused; its error no longer matters
            self._release(piece, None)
        return self._pieces_of(position, span[2])

    def _pieces_of(self, position: int, nbytes: int) -> Iterator[tuple[torch.Tensor, int, Callable]]:
        taken = 0
        while taken < nbytes:
            with self._lock:
                while True:
                    if self._error is not None:
                        raise self._error
                    have = self._pieces.get(position, [])
                    if have:
                        piece = have.pop(0)
                        break
                    if self._stopped:
                        raise RuntimeError("the read-ahead was stopped while a range was being taken")
                    self._lock.wait()
            for read in piece.reads:
                read.result()
            yield (
                piece.slab.buffer[piece.start : piece.start + piece.count],
                taken,
                lambda e, p=piece: self._release(p, e),
            )
            taken += piece.count
        with self._lock:
            self._pieces.pop(position, None)

    def stop(self) -> None:
        """Stop filling, wait for the reads in flight and for every copy out of the slabs, then let the slabs go.
        Stopping again does nothing."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            left = [piece for pieces in self._pieces.values() for piece in pieces]
            self._pieces.clear()
            self._lock.notify_all()
        self._free.put(None)  # wakes a filler waiting for a slab
        self._thread.join()
        for piece in left:
            for read in piece.reads:
                read.exception()
        for slab in self._slabs:
            for event in slab.copies:
                event.synchronize()
        self._slabs = []  # their staging memory goes with the last references: this list's and the free queue's
        self._free = queue.SimpleQueue()


def _split(count: int, piece: int) -> list[tuple[int, int]]:
    """``count`` bytes as (start, length) pieces of at most ``piece`` bytes."""
    return [(start, min(piece, count - start)) for start in range(0, count, piece)]
