"""Candidate Triton forms timed beside the library's (``branch_stages.py``) before one is adopted.

``spatial_conv_triton``: the linear branch's depthwise 5×5 over each frame's 24×42 grid, read in place from
the strided slice of the fused projection (cuDNN first copies it to a dense channels-last tensor) and written
dense, one grid row × channel tile per program. A first version unrolled all 25 taps; its tile loads were
hoisted together and it ran at 150 ms per call against cuDNN's 2.9 ms. Here the rows of the window are a
loop the compiler keeps (five loads live at most) and the tiles are half as wide.

``swiglu_quantize_triton``: the fp8 FFN's SiLU·up and the quantisation of ``fc2``'s input in one pass per row,
where the library writes the product (one compiled pass) and the quantiser reads it back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3_core._fp8_triton import quantize_row


@triton.jit
def _spatial_conv_kernel(src, weight, dst, grid_h, grid_w, channels, s_frame, s_token,
                         KSIZE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
    frame = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1)
    chans = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cols = tl.arange(0, BLOCK_W)
    chan_ok = chans < channels
    acc = tl.zeros((BLOCK_W, BLOCK_C), dtype=tl.float32)
    for dy in range(KSIZE):
        r = row + dy - KSIZE // 2
        row_ok = (r >= 0) & (r < grid_h)
        for dx in tl.static_range(KSIZE):
            c = cols + dx - KSIZE // 2
            ok = ((c >= 0) & (c < grid_w) & row_ok)[:, None] & chan_ok[None, :]
            token = (r * grid_w + c).to(tl.int64)
            x = tl.load(src + frame * s_frame + token[:, None] * s_token + chans[None, :], mask=ok, other=0.0)
            w = tl.load(weight + chans * (KSIZE * KSIZE) + dy * KSIZE + dx, mask=chan_ok, other=0.0)
            acc += x.to(tl.float32) * w.to(tl.float32)[None, :]
    out_token = (row * grid_w + cols).to(tl.int64)
    out = dst + (frame * grid_h * grid_w + out_token)[:, None] * channels + chans[None, :]
    tl.store(out, acc.to(dst.dtype.element_ty), mask=(cols < grid_w)[:, None] & chan_ok[None, :])


def spatial_conv_triton(x: torch.Tensor, weight: torch.Tensor, grid, block_c: int = 64,
                        warps: int = 8) -> torch.Tensor:
    """``h3_core.models.branch_fused.spatial_conv``: contiguous ``[F, S, C]`` from ``x`` ``[F, S, C]`` with a
    contiguous last dimension (any frame and token strides) and depthwise ``weight`` ``[C, 1, k, k]``."""
    frames, tokens, channels = x.shape
    grid_h, grid_w = grid
    assert x.stride(2) == 1 and tokens == grid_h * grid_w
    out = torch.empty(frames, tokens, channels, dtype=x.dtype, device=x.device)
    block_c = min(block_c, triton.next_power_of_2(channels))
    if out.numel():
        _spatial_conv_kernel[(frames, grid_h, triton.cdiv(channels, block_c))](
            x, weight.to(x.dtype).contiguous(), out, grid_h, grid_w, channels, x.stride(0), x.stride(1),
            KSIZE=weight.shape[-1], BLOCK_W=triton.next_power_of_2(grid_w), BLOCK_C=block_c, num_warps=warps)
    return out



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


def swiglu_quantize_triton(gate_up: torch.Tensor, smallest: float,
                           codes_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(block_fused.swiglu_(gate_up))`` in one pass: ``fc1``'s output ``[M, 2·ffn]`` (gate | up)
    read once, the product rounded to its dtype as the two-step path stores it, quantised per row, and neither
    the product nor a second read of it ever made. ``codes_dtype=torch.float32`` keeps the quotients (for
    Triton's CPU interpreter, whose e4m3 cast is not the GPU's)."""
    rows, width = gate_up.shape
    ffn = width // 2
    assert gate_up.stride(1) == 1
    codes = torch.empty(rows, ffn, dtype=codes_dtype, device=gate_up.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=gate_up.device)
    if rows:
        block = triton.next_power_of_2(ffn)
        _swiglu_quantize_kernel[(rows,)](gate_up, codes, scales, ffn, gate_up.stride(0), smallest, BLOCK=block,
                                         num_warps=16 if block > 8192 else 8)
    return codes, scales
