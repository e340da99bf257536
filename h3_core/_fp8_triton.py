"""``quantize_rows`` as one Triton pass per row (see fp8_linear.py): the row is read once, its amax and scale
formed in registers, and the e4m3 codes written, where the eager form reads the row twice and runs its
division as a generic (unvectorised) mixed-dtype kernel. ``swiglu_quantize_triton`` does the same for the
FFN's SiLU·up straight from ``fc1``'s output, so the product is never stored nor read back.

Same numbers as the eager reference: the amax is exact, the scale is ``amax / 448`` and the codes ``x / scale``
with IEEE-rounded divisions (as torch's CUDA kernels divide), and the cast to e4m3 rounds to nearest even
(the values never exceed 448 by more than the cast rounds away, so its saturation never acts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def quantize_row(x, smallest):
    """One row's quotients ``x / scale`` and its ``scale = max(amax / 448, smallest)`` (fp32, IEEE divisions),
    for kernels that hold the row in registers (masked lanes hold 0)."""
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=0), 448.0), smallest)
    return tl.div_rn(x, scale), scale


@triton.jit
def _quantize_rows_kernel(src, codes, scales, n_cols, s_row, smallest, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    q, scale = quantize_row(tl.load(src + row * s_row + cols, mask=mask, other=0.0).to(tl.float32), smallest)
    tl.store(codes + row * n_cols + cols, q.to(codes.dtype.element_ty), mask=mask)
    tl.store(scales + row, scale)


def code_buffers(rows: int, cols: int, codes_dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs of a row quantiser: codes ``[rows, cols]`` and fp32 scales ``[rows, 1]``, both contiguous."""
    return (torch.empty(rows, cols, dtype=codes_dtype, device=device),
            torch.empty(rows, 1, dtype=torch.float32, device=device))


def quantize_rows_triton(x: torch.Tensor, smallest: float, codes_dtype: torch.dtype = torch.float8_e4m3fn,
                         warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[M, K]`` e4m3 (contiguous) and scales ``[M, 1]`` fp32 for rows ``x`` ``[M, K]`` whose last
    dimension is contiguous (any row stride). ``codes_dtype=torch.float32`` keeps the quotients before the
    cast (Triton's CPU interpreter emulates the e4m3 cast wrongly, so its tests stop there)."""
    rows, cols = x.shape
    assert x.stride(1) == 1 or cols == 1
    codes, scales = code_buffers(rows, cols, codes_dtype, x.device)
    if rows:
        block = triton.next_power_of_2(cols)
        warps = warps or (4 if block <= 2048 else 8 if block <= 8192 else 16)
        _quantize_rows_kernel[(rows,)](x, codes, scales, cols, x.stride(0), smallest, BLOCK=block,
                                       num_warps=warps)
    return codes, scales


@triton.jit
def _swiglu_quantize_kernel(src, codes, scales, ffn, s_row, smallest, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < ffn
    gate = tl.load(src + row * s_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + row * s_row + ffn + cols, mask=mask, other=0.0).to(tl.float32)
    h = (gate * tl.sigmoid(gate) * up).to(src.dtype.element_ty).to(tl.float32)  # the product as fc2 would read it
    q, scale = quantize_row(h, smallest)
    tl.store(codes + row * ffn + cols, q.to(codes.dtype.element_ty), mask=mask)
    tl.store(scales + row, scale)


def swiglu_quantize_triton(gate_up: torch.Tensor, smallest: float, codes_dtype: torch.dtype = torch.float8_e4m3fn,
                           warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(block_fused.swiglu_(gate_up))`` in one pass: ``fc1``'s output ``[M, 2·ffn]`` (gate | up)
    read once, the product rounded to its dtype as the two-step path stores it, quantised per row, and neither
    the product nor a second read of it ever made. ``codes_dtype=torch.float32`` keeps the quotients (for
    Triton's CPU interpreter, whose e4m3 cast is not the GPU's)."""
    rows, width = gate_up.shape
    ffn = width // 2
    assert gate_up.stride(1) == 1
    codes, scales = code_buffers(rows, ffn, codes_dtype, gate_up.device)
    if rows:
        block = triton.next_power_of_2(ffn)
        _swiglu_quantize_kernel[(rows,)](gate_up, codes, scales, ffn, gate_up.stride(0), smallest, BLOCK=block,
                                         num_warps=warps or (32 if block > 8192 else 8))
    return codes, scales
