"""Host tensors for a decoded clip's frames, on transparent huge pages where the kernel offers them.

A release-size clip's frames are gigabytes of fresh host memory, written once as the decode goes and freed when
the host drops the run's outputs (at the next prompt). On 4 KiB pages the first write faults once per page, on
the thread that also issues the decode's kernels, and the free returns every page. An anonymous private mapping
advised ``MADV_HUGEPAGE`` takes 2 MiB a fault where ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always``
or ``madvise`` (the common default); elsewhere the advice changes nothing and the mapping is ordinary memory.
``bench/host_frames.py`` times both."""

from __future__ import annotations

import math
import mmap

import torch

__all__ = ["empty_frames", "HUGE_PAGE_BYTES"]

HUGE_PAGE_BYTES = 2 << 20


def empty_frames(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor of ``shape`` and ``dtype``: for one of at least a huge page, an anonymous mapping
    advised to use huge pages (kept alive by the tensor, unmapped with it); otherwise, or where the platform has no
    such advice, ``torch.empty``."""
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    private = getattr(mmap, "MAP_PRIVATE", None)
    if nbytes < HUGE_PAGE_BYTES or advice is None or private is None:
        return torch.empty(shape, dtype=dtype)
    try:
        region = mmap.mmap(-1, nbytes, flags=private | mmap.MAP_ANONYMOUS)
    except OSError:
        return torch.empty(shape, dtype=dtype)
    try:
        region.madvise(advice)
    except OSError:  # a kernel without transparent huge pages: ordinary pages
        pass
    return torch.frombuffer(region, dtype=dtype).view(shape)
