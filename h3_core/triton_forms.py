"""The hand-written Triton kernels are optional: each is imported on first use, and where Triton (or the kernel's
module) cannot be imported the caller runs its eager reference instead. They run on CUDA tensors — and on any
tensor under Triton's CPU interpreter (``TRITON_INTERPRET=1`` when this module is imported), which is how the
CPU tests drive them through the model's own path."""

from __future__ import annotations

import functools
import importlib
import os

import torch

__all__ = ["triton_form", "runs_here"]

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def runs_here(t: torch.Tensor) -> bool:
    """Whether the hand-written kernels take ``t``'s device: CUDA, or any device under the interpreter."""
    return t.is_cuda or _INTERPRETED


@functools.cache
def triton_form(module: str, attribute: str):
    """``attribute`` of the module ``module`` (an absolute name, e.g. ``h3_core.attention._merge_triton``), or
    None when it cannot be imported."""
    try:
        return getattr(importlib.import_module(module), attribute)
    except ImportError:
        return None
