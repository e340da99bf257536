"""Tensors of a file read straight onto a device: the file's bytes go, in chunks, into one of two staging
buffers (pinned host memory when the device is a GPU) by several threads at once, and each filled buffer is
copied to the device asynchronously while the next chunk is read into the other.

A memory-mapped tensor moved with ``.to(device)`` is copied from pageable memory (the driver bounces it
through its own pinned buffers) after each page of the mapping is faulted in; reading with ``pread`` into
pinned memory skips both. ``read_eager`` is the plain form every staged read must equal, byte for byte.

The reads are positional, so the threads share a file: ``os.preadv`` on one descriptor where the platform has it
(Linux, the BSDs, macOS 11+). Where it has not (Windows), each thread reads through an unbuffered file object of
its own, ``seek`` then ``readinto`` the same staging buffer (``_ThreadFiles``): the same bytes in the same place,
no copy in between.

Told the ranges a load will ask for (``expect``), the reader fills further slabs with them ahead of the asking
(``read_ahead``), so the reads go on while the load builds its modules.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .read_ahead import ReadAhead

__all__ = ["StagedReader", "pin_staging_buffers", "give_back_pinned", "read_eager", "reader_for"]

CHUNK_BYTES = 64 << 20
READ_THREADS = 8
AHEAD_SLABS = 8  # slabs of CHUNK_BYTES the read-ahead may fill before their bytes are asked for


def pin_staging_buffers(chunk_bytes: int | None = None) -> None:
    """Allocate, then free, the page-locked buffers a reader for a GPU holds (its two and the read-ahead's slabs,
    ``chunk_bytes`` each). A process's first page-locked allocation of a size asks the driver to lock the pages;
    freed, PyTorch's host allocator keeps the blocks, so the next reader gets them at once (and gives them back to
    the system when it closes)."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2 + AHEAD_SLABS)]
    del buffers


def give_back_pinned() -> None:
    """Return the page-locked blocks PyTorch's host allocator keeps after they are freed to the system (those still
    in use stay)."""
    accelerator = getattr(torch, "accelerator", None)
    empty = getattr(accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def read_eager(path: Path, offset: int, nbytes: int, dtype: torch.dtype, shape, device) -> torch.Tensor:
    """The tensor stored at ``offset`` (``nbytes`` bytes) of ``path``, read whole into host memory and moved."""
    with open(path, "rb") as handle:
        handle.seek(offset)
        data = bytearray(handle.read(nbytes))
    raw = torch.frombuffer(data, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape).to(device)


class StagedReader:
    """Reads byte ranges of files into tensors on ``device`` through two staging buffers of ``chunk_bytes``
    (pinned when ``device`` is CUDA), ``threads`` ``pread`` calls filling each chunk. Copies are queued on the
    device's current stream; a buffer is refilled only once its last copy has finished. ``close()`` (or the
    ``with`` block's end) releases the buffers, the threads and the open files. How the threads read (``os.preadv``
    or a file object each, module docstring) is chosen when the reader is made."""

    def __init__(
        self, device, chunk_bytes: int | None = None, threads: int | None = None, ahead_slabs: int | None = None
    ):
        # the module's constants read here, not at import, so a bench can set them for a variant
        chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        threads = READ_THREADS if threads is None else threads
        ahead_slabs = AHEAD_SLABS if ahead_slabs is None else ahead_slabs
        if chunk_bytes <= 0 or threads <= 0:
            raise ValueError(f"chunk_bytes and threads must be positive, got {chunk_bytes} and {threads}")
        self.device = torch.device(device)
        self.chunk_bytes, self.threads, self.ahead_slabs = chunk_bytes, threads, ahead_slabs
        pin = self._pinned = self.device.type == "cuda"
        self._buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._views = [memoryview(b.numpy()) for b in self._buffers]
        self._copied = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._next = 0
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="h3-staged-read")
        # what the threads read a file by: its descriptor (os.preadv), or its path (a file object per thread)
        self._files = None if hasattr(os, "preadv") else _ThreadFiles()
        self._read_piece = _preadv_exact if self._files is None else self._files.read_exact
        self._fds: dict[Path, int | Path] = {}
        self._ahead: ReadAhead | None = None

    def __enter__(self) -> StagedReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop reading ahead, wait for the last copies, close the files and give the staging memory back: pinned
        buffers go back to the system, not to PyTorch's cache of page-locked blocks (``give_back_pinned``)."""
        if self._ahead is not None:
            self._ahead.stop()
        if self.device.type == "cuda":
            for event in self._copied:
                event.synchronize()
        self._pool.shutdown(wait=True)
        if self._files is None:
            for fd in self._fds.values():
                os.close(fd)
        else:
            self._files.close()
        self._fds.clear()
        self._views, self._buffers = [], []
        if self._pinned:
            give_back_pinned()

    def _fd(self, path: Path) -> int | Path:
        """What the threads read ``path`` by (opened here either way, so a missing file fails here)."""
        if path not in self._fds:
            if self._files is None:
                self._fds[path] = os.open(path, os.O_RDONLY)
            else:
                self._files.handle(path)
                self._fds[path] = path
        return self._fds[path]

    def expect(self, spans) -> None:
        """The ranges ``(path, offset, nbytes)`` later ``read`` calls will ask for, in that order: they are read
        ahead (``read_ahead``). Anything asked for out of this order is read as without it."""
        if self._ahead is not None:
            self._ahead.stop()
        spans = [(Path(path), offset, nbytes) for path, offset, nbytes in spans]
        fds = {path: self._fd(path) for path, _, _ in spans}
        self._ahead = ReadAhead(
            spans,
            fds,
            self._pool,
            self._read_piece,
            slab_bytes=self.chunk_bytes,
            slabs=self.ahead_slabs,
            pinned=self._pinned,
        )

    def read(self, path: Path, offset: int, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
        """The tensor of ``dtype`` and ``shape`` stored at byte ``offset`` of ``path`` (``nbytes`` bytes), on the
        reader's device. The result is ready for any later work queued on the current stream."""
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        pieces = self._ahead.take((Path(path), offset, nbytes)) if self._ahead is not None else None
        if pieces is not None:
            for staged, start, done in pieces:
                out[start : start + staged.numel()].copy_(staged, non_blocking=True)
                event = None
                if self._pinned:
                    event = torch.cuda.Event()
                    event.record()
                done(event)
            return out.view(dtype).reshape(shape)
        fd = self._fd(Path(path))
        done = 0
        while done < nbytes:
            count = min(self.chunk_bytes, nbytes - done)
            slot = self._next
            self._next = 1 - slot
            if self._copied[slot] is not None:
                self._copied[slot].synchronize()
            self._fill(fd, self._views[slot], offset + done, count, path)
            out[done : done + count].copy_(self._buffers[slot][:count], non_blocking=True)
            if self._copied[slot] is not None:
                self._copied[slot].record()
            done += count
        return out.view(dtype).reshape(shape)

    def _fill(self, fd: int | Path, view: memoryview, offset: int, count: int, path) -> None:
        """``count`` bytes at ``offset`` into ``view[:count]``, split across the threads."""
        step = -(-count // self.threads)
        step = -(-step // 4096) * 4096  # page-aligned pieces
        pieces = [(start, min(step, count - start)) for start in range(0, count, step)]
        for future in [self._pool.submit(self._read_piece, fd, view, s, n, offset, path) for s, n in pieces]:
            future.result()


def _ended_early(path, missing: int, at: int) -> OSError:
    return OSError(f"{path}: the file ended {missing} bytes early at offset {at}")


def _preadv_exact(fd: int, view: memoryview, start: int, count: int, file_offset: int, path) -> None:
    """``count`` bytes of the file at ``file_offset + start`` into ``view[start:start + count]``."""
    got = 0
    while got < count:
        n = os.preadv(fd, [view[start + got : start + count]], file_offset + start + got)
        if n <= 0:
            raise _ended_early(path, count - got, file_offset + start + got)
        got += n


class _ThreadFiles:
    """The reads where ``os.preadv`` is missing (Windows): each thread opens each file once, unbuffered, and
    reads with ``seek`` then ``readinto`` straight into the staging buffer; no thread moves another's file
    position. ``close`` closes every thread's files."""

    def __init__(self):
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: list = []

    def handle(self, path: Path):
        """This thread's file object for ``path``, opened on first use."""
        handles = self._local.__dict__.setdefault("handles", {})
        handle = handles.get(path)
        if handle is None:
            handle = handles[path] = open(path, "rb", buffering=0)
            with self._lock:
                self._open.append(handle)
        return handle

    def read_exact(self, path: Path, view: memoryview, start: int, count: int, file_offset: int, name) -> None:
        """As ``_preadv_exact``, ``path`` in place of a descriptor."""
        handle = self.handle(path)
        handle.seek(file_offset + start)
        got = 0
        while got < count:
            n = handle.readinto(view[start + got : start + count])
            if not n:
                raise _ended_early(name, count - got, file_offset + start + got)
            got += n

    def close(self) -> None:
        with self._lock:
            handles, self._open = self._open, []
        for handle in handles:
            handle.close()


def reader_for(device):
    """A ``StagedReader`` for ``device`` when it is a CUDA device (to use in a ``with`` block), else a context
    giving None: reads to the host stay memory-mapped."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return StagedReader(device)
    return contextlib.nullcontext(None)
