"""The hand-written Triton kernels are optional: each is imported on first use, and where Triton (or the kernel's
module) cannot be imported the caller runs its eager reference instead."""

from __future__ import annotations

import functools
import importlib

__all__ = ["triton_form"]


@functools.cache
def triton_form(module: str, attribute: str):
    """``attribute`` of the module ``module`` (an absolute name, e.g. ``h3_core.attention._merge_triton``), or
    None when it cannot be imported."""
    try:
        return getattr(importlib.import_module(module), attribute)
    except ImportError:
        return None
