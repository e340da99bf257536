"""How a DiT runs, applied in one place: its blocks and linear branches fused or plain, its attention in head
groups, its FFN in row chunks, its branch statistics a few frames at a time; and one evaluation with the
compiled path's fallback to the plain one."""

from __future__ import annotations

import logging
import weakref

import torch.nn as nn

from ..errors import H3InputError
from ..triton_forms import CompileFailure, plain_path
from .branch_fused import FUSED_MODES
from .dit import Attention, Block, SwiGLU
from .linear_branch import LinearBranch
from .low_memory import LowMemory

__all__ = ["fuse_blocks", "fuse_branches", "apply_low_memory", "evaluate", "compile_failed"]

log = logging.getLogger(__name__)


def fuse_blocks(model: nn.Module, mode: str | None = "compiled") -> int:
    """Set every DiT block in ``model`` — and every linear branch — to the fused ``mode``; returns how many
    blocks."""
    if mode not in FUSED_MODES:
        raise H3InputError(f"the block fusion mode must be one of {FUSED_MODES}, got {mode!r}")
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        block.fused = mode
        block.attn.fused = mode
        block.mlp.fused = mode
    fuse_branches(model, mode)
    return len(blocks)


# The models whose compiled path failed in this process: each runs the plain path from then on.
_failed: weakref.WeakSet = weakref.WeakSet()


def compile_failed(model) -> bool:
    """Whether ``model``'s compiled path failed earlier in this process (``evaluate``)."""
    try:
        return model in _failed
    except TypeError:  # not weakly referable: never recorded
        return False


def evaluate(model, compile: str, *args, **kwargs):
    """``model(*args, **kwargs)``, one evaluation. With ``compile="off"``, or for a model whose compiled path
    failed before, it runs on the plain path: the blocks unfused and no compiled function or Triton kernel
    anywhere in it (``triton_forms.plain_path``). Where a compiled function or kernel fails to compile or
    launch (``CompileFailure``), the model's blocks go plain, one line naming the cause is logged, and the
    evaluation runs again from the same inputs on the plain path: what the failed attempt wrote in place was
    its own intermediates, so the result is the plain path's."""
    if compile == "auto" and not compile_failed(model):
        try:
            return model(*args, **kwargs)
        except CompileFailure as failure:
            _failed.add(model)
            log.warning("the compiled DiT path failed (%s); this model runs the plain path from now on",
                        failure.describe())
    if isinstance(model, nn.Module) and any(getattr(m, "fused", None) for m in model.modules()):
        fuse_blocks(model, None)
    with plain_path():
        return model(*args, **kwargs)


def fuse_branches(model: nn.Module, mode: str | None = "compiled") -> int:
    """Set every linear branch in ``model`` to the fused ``mode`` (see module docstring); returns how many."""
    if mode not in FUSED_MODES:
        raise H3InputError(f"the branch fusion mode must be one of {FUSED_MODES}, got {mode!r}")
    branches = [m for m in model.modules() if isinstance(m, LinearBranch)]
    for branch in branches:
        branch.fused = mode
    return len(branches)


def apply_low_memory(model: nn.Module, options: LowMemory) -> None:
    """Set ``options`` on every block of ``model`` (an ``H3DiT`` or a single ``Block``)."""
    if options.ffn_chunk_rows is not None and (not isinstance(options.ffn_chunk_rows, int) or options.ffn_chunk_rows < 1):
        raise H3InputError(f"ffn_chunk_rows must be a positive number of rows or None, got {options.ffn_chunk_rows!r}")
    if options.branch_frames is not None and (not isinstance(options.branch_frames, int) or options.branch_frames < 1):
        raise H3InputError(f"branch_frames must be a positive number of frames or None, got {options.branch_frames!r}")
    for module in model.modules():
        if isinstance(module, LinearBranch):
            module.statistics_frames = options.branch_frames
        elif isinstance(module, SwiGLU):
            module.chunk_rows = options.ffn_chunk_rows
        elif isinstance(module, Attention):
            if not isinstance(options.head_groups, int) or not 1 <= options.head_groups <= module.heads:
                raise H3InputError(f"head_groups must be between 1 and the model's {module.heads} heads, "
                                   f"got {options.head_groups!r}")
            module.head_groups = options.head_groups
