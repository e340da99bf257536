"""How a DiT runs, as one immutable ``RunOptions`` applied in one place (``apply_run_options``) and read back from
the modules (``run_options_of``): its blocks and linear branches fused or plain, its attention in head groups,
its FFN in row chunks, its branch statistics a few frames at a time, the cancel hook called before every block.
Only this module sets these on the model's modules. Also: one evaluation with the compiled path's fallback to the
plain one (``evaluate``)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn as nn

from ..errors import H3InputError, is_out_of_memory
from .branch_fused import FUSED_MODES
from .dit import Attention, Block, FinalLayer, H3DiT, SwiGLU
from .linear_branch import LinearBranch
from .low_memory import LowMemory

__all__ = [
    "RunOptions",
    "apply_run_options",
    "run_options_of",
    "options_changed",
    "fuse_blocks",
    "fuse_branches",
    "apply_low_memory",
    "evaluate",
    "compile_failed",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunOptions:
    """How a DiT (or any part of one) runs. ``blocks_fused`` / ``branches_fused``: ``block_fused`` /
    ``branch_fused`` mode of the blocks' per-element work and of the linear branches (``FUSED_MODES``: None runs
    the plain ops); ``head_groups``: attention a group of heads at a time; ``ffn_chunk_rows``: the FFN over that
    many rows at a time (None: all); ``branch_frames``: the branch's statistics that many frames at a time (None:
    all); ``final_chunk_rows``: the output layer over that many rows at a time; ``check_cancel``: called before
    every block (a cancel stops within one evaluation); ``on_out_of_memory``: called when an evaluation runs out
    of device memory (``evaluate``), True once the model was placed for less memory, so the evaluation runs
    again, False to let the error through."""

    blocks_fused: str | None = None
    branches_fused: str | None = None
    head_groups: int = 1
    ffn_chunk_rows: int | None = None
    branch_frames: int | None = None
    final_chunk_rows: int = FinalLayer.chunk_rows
    check_cancel: Callable[[], None] | None = field(default=None, compare=False)
    on_out_of_memory: Callable[[], bool] | None = field(default=None, compare=False)

    @property
    def low_memory(self) -> LowMemory:
        return LowMemory(self.ffn_chunk_rows, self.head_groups, self.branch_frames)


def _check(options: RunOptions, model: nn.Module) -> None:
    for name in ("blocks_fused", "branches_fused"):
        if getattr(options, name) not in FUSED_MODES:
            raise H3InputError(f"{name}: got {getattr(options, name)!r}; allowed: {FUSED_MODES}")
    rows, frames = options.ffn_chunk_rows, options.branch_frames
    if rows is not None and (not isinstance(rows, int) or rows < 1):
        raise H3InputError(f"ffn_chunk_rows must be a positive number of rows or None, got {rows!r}")
    if frames is not None and (not isinstance(frames, int) or frames < 1):
        raise H3InputError(f"branch_frames must be a positive number of frames or None, got {frames!r}")
    if not isinstance(options.final_chunk_rows, int) or options.final_chunk_rows < 1:
        raise H3InputError(f"final_chunk_rows must be a positive number of rows, got {options.final_chunk_rows!r}")
    heads = [m.heads for m in model.modules() if isinstance(m, Attention)]
    if (
        not isinstance(options.head_groups, int)
        or not all(1 <= options.head_groups <= h for h in heads)
        or options.head_groups < 1
    ):
        raise H3InputError(
            f"head_groups must be between 1 and the model's {min(heads, default=1)} heads, got {options.head_groups!r}"
        )
    for name in ("check_cancel", "on_out_of_memory"):
        if getattr(options, name) is not None and not callable(getattr(options, name)):
            raise H3InputError(f"{name} must be callable or None, got {getattr(options, name)!r}")


def apply_run_options(model: nn.Module, options: RunOptions) -> RunOptions:
    """Set ``options`` on every module of ``model`` (an ``H3DiT``, a ``Block``, a ``LinearBranch``...), checked
    first; returns them."""
    _check(options, model)
    for module in model.modules():
        if isinstance(module, Block):
            module.fused = options.blocks_fused
        elif isinstance(module, Attention):
            module.fused = options.blocks_fused
            module.head_groups = options.head_groups
        elif isinstance(module, SwiGLU):
            module.fused = options.blocks_fused
            module.chunk_rows = options.ffn_chunk_rows
        elif isinstance(module, LinearBranch):
            module.fused = options.branches_fused
            module.statistics_frames = options.branch_frames
        elif isinstance(module, FinalLayer):
            module.chunk_rows = options.final_chunk_rows
        elif isinstance(module, H3DiT):
            module.check_cancel = options.check_cancel
            module.on_out_of_memory = options.on_out_of_memory
    return options


def run_options_of(model: nn.Module) -> RunOptions:
    """The options ``model``'s modules run with now (defaults for the parts it lacks)."""

    def first(kind):
        return next((m for m in model.modules() if isinstance(m, kind)), None)

    block, attention, ffn, branch = first(Block), first(Attention), first(SwiGLU), first(LinearBranch)
    final, dit = first(FinalLayer), first(H3DiT)
    return RunOptions(
        blocks_fused=next((m.fused for m in (block, attention, ffn) if m is not None), None),
        branches_fused=None if branch is None else branch.fused,
        head_groups=1 if attention is None else attention.head_groups,
        ffn_chunk_rows=None if ffn is None else ffn.chunk_rows,
        branch_frames=None if branch is None else branch.statistics_frames,
        final_chunk_rows=FinalLayer.chunk_rows if final is None else final.chunk_rows,
        check_cancel=None if dit is None else dit.check_cancel,
        on_out_of_memory=None if dit is None else dit.on_out_of_memory,
    )


@contextlib.contextmanager
def options_changed(model: nn.Module, **changes):
    """``model``'s run options with ``changes`` for the ``with`` block; after it those fields are what they were
    before, and the others as the block left them (a compile fallback or a smaller placement stays)."""
    before = run_options_of(model)
    apply_run_options(model, replace(before, **changes))
    try:
        yield
    finally:
        apply_run_options(model, replace(run_options_of(model), **{name: getattr(before, name) for name in changes}))


def fuse_blocks(model: nn.Module, mode: str | None = "compiled") -> int:
    """``model``'s blocks and linear branches in the fused ``mode``, its other options kept; returns how many
    blocks."""
    if mode not in FUSED_MODES:
        raise H3InputError(f"the block fusion mode must be one of {FUSED_MODES}, got {mode!r}")
    apply_run_options(model, replace(run_options_of(model), blocks_fused=mode, branches_fused=mode))
    return sum(isinstance(m, Block) for m in model.modules())


def compile_failed(model) -> bool:
    """Whether ``model``'s compiled path failed earlier (``evaluate``): the model remembers it
    (``H3DiT.compiled_form``), and runs the plain path from then on."""
    form = getattr(model, "compiled_form", None)
    return form is not None and form.failed


def evaluate(model, compile: str, *args, **kwargs):
    """``_evaluate_once``; where it runs out of device memory and the model's ``on_out_of_memory`` (``RunOptions``)
    places it for less memory, again from the same inputs, as often as that helps."""
    while True:
        try:
            return _evaluate_once(model, compile, *args, **kwargs)
        except Exception as exc:
            fit_smaller = getattr(model, "on_out_of_memory", None)
            if fit_smaller is None or not is_out_of_memory(exc):
                raise
            cause = str(exc).splitlines()[0] if str(exc) else "out of memory"
        # out of the except block: the failed attempt's frames, and the memory they held, are gone
        if not fit_smaller():
            raise torch.OutOfMemoryError(f"{cause} (and no plan that gives up more memory remains)")
        log.warning("an evaluation ran out of device memory (%s); it runs again, placed for less memory", cause)


def _evaluate_once(model, compile: str, *args, **kwargs):
    """``model(*args, **kwargs)``, one evaluation. With ``compile="off"``, or for a model whose compiled path
    failed before, it runs on the plain path: the blocks unfused and no compiled function or Triton kernel
    anywhere in it (``triton_forms.plain_path``). Where a compiled function or kernel fails to compile or
    launch (``CompileFailure``), the model's blocks go plain, one line naming the cause is logged, and the
    evaluation runs again from the same inputs on the plain path: what the failed attempt wrote in place was
    its own intermediates, so the result is the plain path's."""

    def plain():
        if isinstance(model, nn.Module) and any(getattr(m, "fused", None) for m in model.modules()):
            fuse_blocks(model, None)
        return model(*args, **kwargs)

    return model.compiled_form.run(lambda: model(*args, **kwargs), plain, allowed=compile == "auto")


def fuse_branches(model: nn.Module, mode: str | None = "compiled") -> int:
    """``model``'s linear branches in the fused ``mode``, its other options kept; returns how many."""
    if mode not in FUSED_MODES:
        raise H3InputError(f"the branch fusion mode must be one of {FUSED_MODES}, got {mode!r}")
    apply_run_options(model, replace(run_options_of(model), branches_fused=mode))
    return sum(isinstance(m, LinearBranch) for m in model.modules())


def apply_low_memory(model: nn.Module, options: LowMemory) -> None:
    """``options`` (a memory plan's choices) on ``model``, its other options kept."""
    apply_run_options(
        model,
        replace(
            run_options_of(model),
            head_groups=options.head_groups,
            ffn_chunk_rows=options.ffn_chunk_rows,
            branch_frames=options.branch_frames,
        ),
    )
