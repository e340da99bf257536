"""Error kinds shared by every layer of the pack.

Messages are sentences a user can act on: they name the input, quote what was given and say what is
allowed. The node layer turns them into one line under the node that failed.
"""

__all__ = ["H3InputError", "H3BackendUnavailable", "H3DoesNotFit", "is_out_of_memory"]


class H3InputError(ValueError):
    """An argument, file or geometry that cannot be used as given."""


class H3BackendUnavailable(RuntimeError):
    """An explicitly chosen backend or kernel cannot run here; the message names what would fix it."""


class H3DoesNotFit(H3InputError):
    """A request that no memory plan fits on the device it would run on; the message says what it needs."""


# CUDA's cudaErrorMemoryAllocation: what a library's own allocation inside a launch reports.
CUDA_OUT_OF_MEMORY = 2


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says the device ran out of memory: torch's ``OutOfMemoryError``, or a CUDA error raised as
    ``torch.AcceleratorError`` (torch 2.9 and later) whose code is cudaErrorMemoryAllocation or whose message says
    out of memory (an allocation inside a kernel library, or an allocator that runs out that way)."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is None or not isinstance(exc, accelerator_error):
        return False
    return getattr(exc, "error_code", None) == CUDA_OUT_OF_MEMORY or "out of memory" in str(exc).lower()
