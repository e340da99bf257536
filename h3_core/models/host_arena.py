"""One page-aligned host allocation, page-locked with cudaHostRegister when it feeds a GPU: the home of the
streamed DiT blocks (``offload``) and of the AdaLN projections kept in host memory (``adaln_tables``).

Registering the exact size avoids torch's pinned allocator, which rounds each request up to a power of two
(a 1.3 GB block would take 2 GiB, 50 AdaLN projections of 0.5 GB would take 50 GiB) and keeps freed pinned
memory cached. The arena is an anonymous mapping, so its storage starts on a page boundary: the registered
range is whole pages of our own, never shared with another registration, and every view of the arena reports
``is_pinned()`` (torch asks about a tensor's storage, which here is the registered range itself). Pages are
committed as they are written, so an arena filled piece by piece while a model moves out of ordinary RAM
holds at most one piece twice.
"""

from __future__ import annotations

import logging
import mmap
import weakref

import torch

__all__ = ["HostArena", "ALIGN", "aligned"]

_log = logging.getLogger(__name__)

# Offsets of tensors inside an arena: the CUDA caching allocator's granularity, so every view is as aligned as a
# fresh allocation. cuBLAS(Lt) chooses kernels by pointer alignment (up to 256 bytes), so a matmul on weights
# copied from the arena runs the kernels it would run on a fresh copy and reproduces its results bit for bit.
ALIGN = 512


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the next multiple of ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def _discard_cuda_error(device: torch.device) -> None:
    """A failed CUDA runtime call leaves its error as the thread's last error, and the next kernel launch check
    would report it as its own; a trivial launch here reports it once, and it is dropped."""
    try:
        torch.ones(1, device=device).add_(1)
        torch.cuda.synchronize(device)
    except RuntimeError:
        pass


class HostArena:
    """``bytes``: a ``[nbytes rounded up to whole pages]`` uint8 tensor in host memory; ``pinned`` once ``pin``
    has page-locked it. Unregistered when the arena goes (or on ``release``)."""

    def __init__(self, nbytes: int, what: str):
        span = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.what = what
        self._mapping = mmap.mmap(-1, span) if span else None
        self.bytes = torch.frombuffer(self._mapping, dtype=torch.uint8) if span else torch.empty(0, dtype=torch.uint8)
        self.pinned = False
        self._unpin = None

    def pin(self, device: torch.device) -> None:
        """Page-lock the arena so copies from it run asynchronously; if the system refuses, warn and keep it
        pageable (copies then block the host, which stays correct but no longer overlaps compute)."""
        if self.bytes.numel() == 0 or self.pinned:
            return
        cudart = torch.cuda.cudart()
        address = self.bytes.data_ptr()
        result = cudart.cudaHostRegister(address, self.bytes.numel(), 0)
        if int(result) != 0:
            _discard_cuda_error(device)
            _log.warning(
                "could not page-lock %.2f GiB of host memory for %s (%s): their copies will not overlap compute",
                self.bytes.numel() / 2**30,
                self.what,
                cudart.cudaGetErrorString(result),
            )
            return
        # Unregistered when the arena goes, even if release() is never called.
        self._unpin = weakref.finalize(self, cudart.cudaHostUnregister, address)
        self.pinned = True

    def release(self) -> None:
        if self._unpin is not None:
            self._unpin()
        self.pinned = False
