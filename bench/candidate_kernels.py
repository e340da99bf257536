"""Candidate forms timed beside the library's (``branch_stages.py``) before one is adopted.

``spatial_conv_rolling``: the linear branch's depthwise 5×5 over each frame's 24×42 grid
(``branch_fused.spatial_conv``: cuDNN, 2.6–2.9 ms a call at the release size, ≈ 3.7 × the time to read and
write its tensor once). Each program walks one frame's grid row by row for a tile of columns × channels,
holding the five output rows an input row feeds as rolling fp32 sums: every input row is loaded once per
horizontal tap (five loads, the later four from cache), and a sum is written when its last input row is in.
Earlier Triton forms lost to cuDNN — a program per output row loading all 25 taps (6.6 ms), the same
rolling walk over whole 42-column rows padded to 64 lanes with its taps' weights loaded inside the walk
(5.2–9.2 ms), flattened token tiles (20.9–95.4 ms). This one keeps a third of the lanes the whole-row walk
left idle (tiles of 16 columns: 48 lanes for 42 columns), loads the 25 weight vectors once before the walk
(a load inside it cannot be hoisted past the stores) and holds a quarter of the registers per program
(16 columns × 64 channels a tile), so more programs share a multiprocessor to hide the loads' latency.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tap_row(weight, chans, chan_ok, dy: tl.constexpr):
    """The five horizontal taps of tap row ``dy`` for the tile's channels, fp32 ``[1, BLOCK_C]`` each."""
    at = weight + chans * 25 + dy * 5
    w0 = tl.load(at + 0, mask=chan_ok, other=0.0).to(tl.float32)[None, :]
    w1 = tl.load(at + 1, mask=chan_ok, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(at + 2, mask=chan_ok, other=0.0).to(tl.float32)[None, :]
    w3 = tl.load(at + 3, mask=chan_ok, other=0.0).to(tl.float32)[None, :]
    w4 = tl.load(at + 4, mask=chan_ok, other=0.0).to(tl.float32)[None, :]
    return w0, w1, w2, w3, w4


@triton.jit
def _shifted(row_at, cols, dx: tl.constexpr, grid_w, s_token, chan_ok, row_ok):
    """The input row's columns ``cols + dx − 2`` (zero outside the grid), fp32 ``[BLOCK_X, BLOCK_C]``."""
    c = cols + (dx - 2)
    ok = ((c >= 0) & (c < grid_w) & row_ok)[:, None] & chan_ok[None, :]
    return tl.load(row_at + c.to(tl.int64)[:, None] * s_token, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _spatial_conv_rolling_kernel(src, weight, dst, grid_h, grid_w, channels, s_frame, s_token,
                                 BLOCK_X: tl.constexpr, BLOCK_C: tl.constexpr):
    chans = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cols = tl.program_id(1) * BLOCK_X + tl.arange(0, BLOCK_X)
    frame = tl.program_id(2).to(tl.int64)
    chan_ok = chans < channels
    out_mask = (cols < grid_w)[:, None] & chan_ok[None, :]
    # w{dy}{dx}: tap (dy, dx); an input row i feeds output row i − 2 + k with tap row dy = 4 − k
    w00, w01, w02, w03, w04 = _tap_row(weight, chans, chan_ok, 0)
    w10, w11, w12, w13, w14 = _tap_row(weight, chans, chan_ok, 1)
    w20, w21, w22, w23, w24 = _tap_row(weight, chans, chan_ok, 2)
    w30, w31, w32, w33, w34 = _tap_row(weight, chans, chan_ok, 3)
    w40, w41, w42, w43, w44 = _tap_row(weight, chans, chan_ok, 4)
    a0 = tl.zeros((BLOCK_X, BLOCK_C), dtype=tl.float32)  # output row i − 2
    a1 = tl.zeros((BLOCK_X, BLOCK_C), dtype=tl.float32)
    a2 = tl.zeros((BLOCK_X, BLOCK_C), dtype=tl.float32)
    a3 = tl.zeros((BLOCK_X, BLOCK_C), dtype=tl.float32)
    a4 = tl.zeros((BLOCK_X, BLOCK_C), dtype=tl.float32)  # output row i + 2
    for i in range(grid_h + 2):
        row_ok = i < grid_h
        row_at = src + frame * s_frame + (i * grid_w).to(tl.int64) * s_token + chans[None, :]
        x = _shifted(row_at, cols, 0, grid_w, s_token, chan_ok, row_ok)
        a0 += x * w40
        a1 += x * w30
        a2 += x * w20
        a3 += x * w10
        a4 += x * w00
        x = _shifted(row_at, cols, 1, grid_w, s_token, chan_ok, row_ok)
        a0 += x * w41
        a1 += x * w31
        a2 += x * w21
        a3 += x * w11
        a4 += x * w01
        x = _shifted(row_at, cols, 2, grid_w, s_token, chan_ok, row_ok)
        a0 += x * w42
        a1 += x * w32
        a2 += x * w22
        a3 += x * w12
        a4 += x * w02
        x = _shifted(row_at, cols, 3, grid_w, s_token, chan_ok, row_ok)
        a0 += x * w43
        a1 += x * w33
        a2 += x * w23
        a3 += x * w13
        a4 += x * w03
        x = _shifted(row_at, cols, 4, grid_w, s_token, chan_ok, row_ok)
        a0 += x * w44
        a1 += x * w34
        a2 += x * w24
        a3 += x * w14
        a4 += x * w04
        done = i - 2  # output row i − 2 has all five of its input rows
        if done >= 0:
            token = (frame * grid_h + done) * grid_w + cols.to(tl.int64)
            tl.store(dst + token[:, None] * channels + chans[None, :], a0.to(dst.dtype.element_ty), mask=out_mask)
        a0, a1, a2, a3 = a1, a2, a3, a4
        a4 = tl.zeros((BLOCK_X, BLOCK_C), dtype=tl.float32)


def spatial_conv_rolling(x: torch.Tensor, weight: torch.Tensor, grid, block_x: int = 16, block_c: int = 64,
                         warps: int = 4) -> torch.Tensor:
    """``branch_fused.spatial_conv`` for a 5×5 ``weight`` ``[C, 1, 5, 5]``: contiguous ``[F, S, C]`` from ``x``
    ``[F, S, C]`` with a contiguous last dimension (any frame and token strides). ``block_x`` columns ×
    ``block_c`` channels a program and ``warps`` choose the launch; the numbers do not depend on it (each
    output is its 25 products summed in fp32 in one order, rounded once)."""
    frames, tokens, channels = x.shape
    grid_h, grid_w = grid
    assert x.stride(2) == 1 and tokens == grid_h * grid_w and tuple(weight.shape[-2:]) == (5, 5)
    out = torch.empty(frames, tokens, channels, dtype=x.dtype, device=x.device)
    if out.numel():
        launch = (triton.cdiv(channels, block_c), triton.cdiv(grid_w, block_x), frames)
        _spatial_conv_rolling_kernel[launch](
            x, weight.reshape(channels, 25).to(x.dtype).contiguous(), out, grid_h, grid_w, channels, x.stride(0),
            x.stride(1), BLOCK_X=block_x, BLOCK_C=block_c, num_warps=warps)
    return out
