"""Exact lower-memory ways to run a DiT block: the same arithmetic on smaller pieces at a time.

* ``ffn_chunk_rows``: the SwiGLU FFN over row chunks (``RowChunks``, the run's ``ffn_rows``), so its ``[T, 2·ffn]``
  intermediate exists for one chunk only. Rows are independent, so the result is the plain one.
* ``head_groups``: attention — and in VDN-H3 the linear branch — computed a group of heads at a time: q, k,
  v, the attention output and the branch's features exist for one group only, and each group's share of
  ``out_proj`` (and ``to_out_linear``) is added into the block output. Heads are independent, so only the
  order of that final sum changes (in half precision each group's share is rounded as it is added).
* ``branch_frames``: the plain linear branch's fp32 frame statistics formed that many frames at a time; each
  frame's sums are its own, so the numbers are the same. (The fused branch makes no fp32 copies of its
  features, ``branch_fused.gram_statistics``, so it has nothing to chunk.)

The plain path is ``LowMemory()``: everything at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "LowMemory",
    "WholeRows",
    "RowChunks",
    "WHOLE_ROWS",
    "rows_form",
    "head_slices",
    "linear_rows",
    "linear_row_blocks",
    "slicing_dequantises",
    "add_linear_cols",
]


@dataclass(frozen=True)
class LowMemory:
    ffn_chunk_rows: int | None = None  # None: all rows at once
    head_groups: int = 1  # 1: all heads at once
    branch_frames: int | None = None  # None: the branch's statistics over all frames at once


class WholeRows:
    """A row-wise function run on all rows at once."""

    def apply(self, fn, x: torch.Tensor, width: int) -> torch.Tensor:
        """``fn(x)``; ``width``: its output's last dimension (what ``RowChunks`` allocates)."""
        return fn(x)


@dataclass(frozen=True)
class RowChunks:
    """A row-wise function run on ``rows`` rows at a time, each chunk's result written into one output of ``x``'s
    dtype: the function's intermediates exist for one chunk only, and row by row its arithmetic is the whole form's."""

    rows: int

    def apply(self, fn, x: torch.Tensor, width: int) -> torch.Tensor:
        if self.rows >= x.shape[0]:
            return fn(x)
        out = x.new_empty(*x.shape[:-1], width)
        for start in range(0, x.shape[0], self.rows):
            out[start : start + self.rows] = fn(x[start : start + self.rows])
        return out


WHOLE_ROWS = WholeRows()


def rows_form(rows: int | None) -> WholeRows | RowChunks:
    """All rows at once (``rows`` None) or ``rows`` at a time."""
    return WHOLE_ROWS if rows is None else RowChunks(rows)


def head_slices(heads: int, groups: int) -> list[slice]:
    """``groups`` consecutive head ranges as even as possible."""
    bounds = [round(i * heads / groups) for i in range(groups + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def linear_rows(layer: nn.Module, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Output features ``[start, stop)`` of ``layer(x)``: a row slice of the weight, no copy."""
    if hasattr(layer, "part"):  # an fp8 linear slices its own codes and scales
        return layer.part(x, rows=slice(start, stop))
    bias = None if layer.bias is None else layer.bias[start:stop]
    return F.linear(x, layer.weight[start:stop], bias)


def slicing_dequantises(weight: torch.Tensor) -> bool:
    """Whether a slice of ``weight`` leaves its format: a tensor subclass with its own dispatch (a comfy-kitchen
    ``QuantizedTensor``) slices into a plain dequantised tensor, so a product over a slice is not its kernel's."""
    return type(weight).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def linear_row_blocks(layer: nn.Module, x: torch.Tensor, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Output features ``[start, stop)`` of ``layer(x)`` for each range, each its own dense tensor: row slices of
    the weight (``linear_rows``), except where the ranges cover every output feature of a layer whose weight
    ``slicing_dequantises``: then the layer's own forward runs once (its quantised kernel) and each range's
    columns are copied out."""
    covered = sum(stop - start for start, stop in ranges)
    weight = getattr(layer, "weight", None)
    if hasattr(layer, "part") or weight is None or not slicing_dequantises(weight) or covered != weight.shape[0]:
        return [linear_rows(layer, x, start, stop) for start, stop in ranges]
    out = layer(x)
    return [out[..., start:stop].contiguous() for start, stop in ranges]


def add_linear_cols(
    total: torch.Tensor | None, layer: nn.Module, x: torch.Tensor, start: int, stop: int
) -> torch.Tensor:
    """``total + x @ W[:, start:stop]ᵀ``: the share of input features ``[start, stop)`` in ``layer``'s output
    (bias excluded), added in place into ``total`` (created on the first call)."""
    if total is None and (start, stop) == (0, layer.in_features) and layer.bias is None:
        return layer(x)  # the whole layer: its own forward (whatever kind of linear it is)
    if hasattr(layer, "part"):  # an fp8 linear: its activations are scaled per row of this share
        share = layer.part(x, cols=slice(start, stop))
        return share if total is None else total.add_(share)
    weight = layer.weight[:, start:stop]
    if total is None:
        return F.linear(x, weight)
    return total.addmm_(x.reshape(-1, x.shape[-1]), weight.t()) if total.dim() == 2 else total.add_(F.linear(x, weight))
