"""The fused forms as written: the fused functions of ``block_fused`` and ``branch_fused`` run op by op, with no
``torch.compile`` and no hand-written Triton kernel — the reference form of the fused math, beside the plain ops
(``fused = None``) and the compiled forms. The library's ``"compiled"`` mode runs them so inside
``triton_forms.plain_path``; this gives that form to a call or to a model:

* ``written(fn, *args)``: a library function that takes the fused mode first (``block_fused.run``,
  ``branch_fused.shifted_statistics``, ``block_fused.residual_norm``...) called in ``"compiled"`` mode on the plain
  path;
* ``fused_written(model)``: a ``with`` block in which ``model``'s blocks and linear branches (with
  ``blocks=False`` its branches only) are fused and run as written; after it their fusion is what it was;
* ``EAGER``, this form's name where it stands beside the library's modes (a bench's ``--fused``), and ``mode_for``,
  which maps such a name to the library's mode and the context it runs in.
"""

from __future__ import annotations

import contextlib

from h3_core.models.run_options import options_changed
from h3_core.triton_forms import plain_path

__all__ = ["EAGER", "MODE", "written", "fused_written", "mode_for"]

EAGER = "eager"
MODE = "compiled"  # the library's fused mode, run on the plain path


def written(fn, *args, **kwargs):
    """``fn(MODE, *args, **kwargs)`` with nothing compiled: the fused functions as written."""
    with plain_path():
        return fn(MODE, *args, **kwargs)


@contextlib.contextmanager
def fused_written(model, blocks: bool = True):
    """``model`` (a DiT, a block, an attention, a linear branch) with its blocks and branches fused (``blocks``
    False: its branches only), run as written within the block; yields ``model``."""
    changes = dict(blocks_fused=MODE, branches_fused=MODE) if blocks else dict(branches_fused=MODE)
    with options_changed(model, **changes), plain_path():
        yield model


def mode_for(name: str | None):
    """(the library's fused mode, a context to run it in) for ``name``: ``EAGER``, or one of the library's modes."""
    if name == EAGER:
        return MODE, plain_path()
    return name, contextlib.nullcontext()
