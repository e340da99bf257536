"""The fused forms as written: the fused functions of ``block_fused`` and ``branch_fused`` run op by op, with no
``torch.compile`` and no hand-written Triton kernel — the reference form of the fused math, beside the plain ops
(``fused = None``) and the compiled forms. The library's ``"compiled"`` mode runs them so inside
``triton_forms.plain_path``; this gives that form to a call or to a model:

* ``written(fn, *args)``: a library function that takes the fused mode first (``block_fused.run``,
  ``branch_fused.shifted_statistics``, ``block_fused.residual_norm``...) called in ``"compiled"`` mode on the plain
  path;
* ``fused_written(run)``: a ``with`` block on the plain path that yields ``run`` (``RunOptions``, plain by default)
  with the blocks and linear branches (with ``blocks=False`` the branches only) fused: a model given those options
  in the block runs the fused forms as written;
* ``EAGER``, this form's name where it stands beside the library's modes (a bench's ``--fused``), and ``mode_for``,
  which maps such a name to the library's mode and the context it runs in.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

from h3_core.models.options import PLAIN, RunOptions
from h3_core.triton_forms import plain_path

__all__ = ["EAGER", "MODE", "written", "fused_written", "mode_for"]

EAGER = "eager"
MODE = "compiled"  # the library's fused mode, run on the plain path


def written(fn, *args, **kwargs):
    """``fn(MODE, *args, **kwargs)`` with nothing compiled: the fused functions as written."""
    with plain_path():
        return fn(MODE, *args, **kwargs)


@contextlib.contextmanager
def fused_written(run: RunOptions = PLAIN, blocks: bool = True):
    """``run`` with the blocks and branches fused (``blocks`` False: the branches only), yielded within a
    ``plain_path`` block: what a model given them runs there is the fused forms as written."""
    fused = run.fused(MODE) if blocks else replace(run, branches_fused=MODE)
    with plain_path():
        yield fused


def mode_for(name: str | None):
    """(the library's fused mode, a context to run it in) for ``name``: ``EAGER``, or one of the library's modes."""
    if name == EAGER:
        return MODE, plain_path()
    return name, contextlib.nullcontext()
