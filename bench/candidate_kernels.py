"""Candidate forms timed beside the library's (``fp8_stages.py``) before one is adopted.

``swiglu_in_place``: the bf16 FFN's SiLU·up (``block_fused.swiglu_``: ``silu(gate) · up`` from ``fc1``'s output
``[T, 2·ffn]``, written into its gate half) as one Triton pass over tiles of rows × columns. torch.compile
splits that in-place write into two kernels — the product into a buffer of its own, then a copy into the gate
half: 2.20 + 1.44 ms per bf16 block at the release size (``bench/results/dit_block_kernels_bf16_leaf_inverse
.json``) — where one pass reads the row once and writes the product once (≈ 9 GB, ≈ 2.5 ms at the H200's
bandwidth). The product is rounded once to the rows' dtype, as the library's form stores it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _swiglu_in_place_kernel(gate_up, n_rows, ffn, s_row, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = (tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    cols = (tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    mask = (rows < n_rows) & (cols < ffn)
    gate_at = gate_up + rows * s_row + cols
    gate = tl.load(gate_at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_at + ffn, mask=mask, other=0.0).to(tl.float32)
    tl.store(gate_at, (gate * tl.sigmoid(gate) * up).to(gate_up.dtype.element_ty), mask=mask)


def swiglu_in_place(gate_up: torch.Tensor, block_r: int = 4, block_c: int = 1024, warps: int = 4) -> torch.Tensor:
    """``block_fused.swiglu_(gate_up)``: ``gate_up`` ``[T, 2·ffn]`` (contiguous columns, any row stride), the
    product written into its gate half, whose ``[T, ffn]`` view is returned. The launch (``block_r`` rows ×
    ``block_c`` columns a program, ``warps``) does not change the numbers."""
    rows, width = gate_up.shape
    ffn = width // 2
    assert gate_up.stride(1) == 1 and width == 2 * ffn
    if rows and ffn:
        grid = (triton.cdiv(ffn, block_c), triton.cdiv(rows, block_r))
        _swiglu_in_place_kernel[grid](gate_up, rows, ffn, gate_up.stride(0), BLOCK_R=block_r, BLOCK_C=block_c,
                                      num_warps=warps)
    return gate_up[:, :ffn]
