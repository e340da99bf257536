"""Merging two attention results over disjoint key sets by their log-sum-exp.

For one query attending to key sets A and B with results (o_a, lse_a) and (o_b, lse_b), attention over
A ∪ B is ``o = o_b + sigmoid(lse_a - lse_b) · (o_a - o_b)`` — the stable form of the weights
``exp(lse_a - lse)`` and ``exp(lse_b - lse)`` with ``lse = logaddexp(lse_a, lse_b)``. It is computed in
float32 (float64 for float64 inputs) and written into ``out``, which may alias neither input.

Shapes: outputs ``[N, H, D]`` or ``[G, L, H, D]``, log-sum-exps ``[N, H]`` or ``[G, L, H]``; any strides
with a contiguous last dim (the grouped form lets batched kernel outputs merge without a copy).
"""

from __future__ import annotations

import torch

from ..triton_forms import triton_form

try:  # Triton is optional: without it the plain forms run
    from . import merge_triton
except ImportError:
    merge_triton = None

__all__ = ["merge_partials", "merge_partials_reference"]


def merge_partials_reference(o_a, lse_a, o_b, lse_b, out) -> torch.Tensor:
    """Eager merge; the reference for the fused kernel and the path on CPU and for float64."""
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    weight_a = torch.sigmoid(lse_a.to(acc) - lse_b.to(acc)).unsqueeze(-1)
    o_b = o_b.to(acc)
    out.copy_(o_b + weight_a * (o_a.to(acc) - o_b))
    return out


def merge_partials(o_a, lse_a, o_b, lse_b, out) -> torch.Tensor:
    """Merge two partial attention results into ``out`` (one fused pass on CUDA)."""
    if out.is_cuda and out.dtype != torch.float64 and out.shape[0] > 0:
        fused = triton_form(merge_triton, "merge_partials_triton")
        if fused is not None:
            return fused(o_a, lse_a, o_b, lse_b, out)
    return merge_partials_reference(o_a, lse_a, o_b, lse_b, out)
