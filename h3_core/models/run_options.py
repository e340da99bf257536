"""Evaluations of a DiT under its ``RunOptions`` (``options``), given with each call: the options checked against
the model (``check_run_options``), the compiled path's fallback to the plain one and the retry after running out of
device memory (``Evaluations``, ``evaluate``)."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from ..errors import H3InputError, is_out_of_memory
from ..triton_forms import plain_path
from .branch_fused import FUSED_MODES
from .dit import Attention
from .options import PLAIN, RunOptions

__all__ = ["RunOptions", "PLAIN", "check_run_options", "Evaluations", "evaluate", "compile_failed"]

log = logging.getLogger(__name__)


def check_run_options(options: RunOptions, model: nn.Module) -> RunOptions:
    """``options`` if ``model`` (an ``H3DiT``, a ``Block``, ...) can run with them; an ``H3InputError`` naming the
    field otherwise."""
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
    return options


def compile_failed(model) -> bool:
    """Whether ``model``'s compiled path failed earlier: the model remembers it (``H3DiT.compiled_form``), and runs
    the plain path from then on."""
    form = getattr(model, "compiled_form", None)
    return form is not None and form.failed


class Evaluations:
    """The evaluations of one run: ``model`` (an ``H3DiT``, or any callable of its inputs) called with ``run``, the
    ``RunOptions`` given with every call (checked once, here), and ``compile`` (``"auto"`` / ``"off"``).

    With ``compile="off"``, or for a model whose compiled path failed before, an evaluation runs on the plain path:
    the blocks and branches unfused and no compiled function or Triton kernel anywhere in it
    (``triton_forms.plain_path``). Where a compiled function or kernel fails to compile or launch, the model's
    ``compiled_form`` says so once and the evaluation runs again from the same inputs on the plain path (what the
    failed attempt wrote in place was its own intermediates). Where an evaluation runs out of device memory and
    ``run.on_out_of_memory`` places the model for less (it returns that placement's ``LowMemory``), it runs again
    from the same inputs with those choices, which every later evaluation of the run keeps (``run``)."""

    def __init__(self, model, run: RunOptions = PLAIN, compile: str = "auto"):
        self.model, self.compile = model, compile
        self.run = check_run_options(run, model) if isinstance(model, nn.Module) else run

    def __call__(self, *args, **kwargs):
        while True:
            try:
                return self._once(args, kwargs)
            except Exception as exc:
                fit_smaller = self.run.on_out_of_memory
                if fit_smaller is None or not is_out_of_memory(exc):
                    raise
                cause = str(exc).splitlines()[0] if str(exc) else "out of memory"
            # out of the except block: the failed attempt's frames, and the memory they held, are gone
            smaller = fit_smaller()
            if smaller is None:
                raise torch.OutOfMemoryError(f"{cause} (and no plan that gives up more memory remains)")
            self.run = self.run.with_low_memory(smaller)
            log.warning("an evaluation ran out of device memory (%s); it runs again, placed for less memory", cause)

    def _once(self, args, kwargs):
        model, run = self.model, self.run
        form = getattr(model, "compiled_form", None)
        if form is None:  # a callable of the model's inputs: nothing of its own to fuse, fall back from or cancel
            if run.check_cancel is not None:
                run.check_cancel()
            with plain_path(self.compile != "auto"):
                return model(*args, **kwargs)
        if form.tries(self.compile == "auto"):
            with form.attempt():
                return model(*args, run=run, **kwargs)
        with plain_path():
            return model(*args, run=run.fused(None), **kwargs)


def evaluate(model, compile: str, *args, run: RunOptions = PLAIN, **kwargs):
    """One evaluation, as ``Evaluations(model, run, compile)`` runs each."""
    return Evaluations(model, run, compile)(*args, **kwargs)
