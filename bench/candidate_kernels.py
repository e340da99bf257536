"""Candidate forms timed beside the library's (``branch_stages.py``) before one is adopted.

Measured and not adopted (H200, ``branch_stages_conv_rolling.json``): the spatial conv below took 3.96 ms at
its fastest launch (16 columns × 64 channels, 4 warps, weights held — the spilling one) and 4.6–27.8 ms at the
others, against cuDNN's 2.73 ms. It stays as the register tool's spilling example (``kernel_registers.py``).

``spatial_conv_rolling``: the linear branch's depthwise 5×5 over each frame's 24×42 grid
(``branch_fused.spatial_conv``: cuDNN, 2.6–2.9 ms a call at the release size, ≈ 3.7 × the time to read and
write its tensor once). Each program walks one frame's grid row by row for a tile of columns × channels,
holding the five output rows an input row feeds as rolling fp32 sums: every input row is loaded once per
horizontal tap (five loads, the later four from cache), and a sum is written when its last input row is in.
Earlier Triton forms lost to cuDNN — a program per output row loading all 25 taps (6.6 ms), the same
rolling walk over whole 42-column rows padded to 64 lanes with its bf16 weights loaded and widened inside
the walk (5.2–9.2 ms, ``branch_stages_rows_candidate.json``), flattened token tiles (20.9–95.4 ms). Their
registers were not what held that walk back: compiled for the H200 (``bench/kernel_registers.py``) its
fastest launch (32 channels, 4 warps: 5.3 ms) takes 254 registers a thread with no stack, and its leaner
ones were slower (16 channels: 165 registers, 6.4 ms; 8 warps: 174, 9.2 ms). Both of those forms put frames
on the grid's first axis, so the programs running together read the same channels of different frames, 64
bytes out of each 14 KB token row. Here the channel blocks come first: programs running together read
neighbouring channels of the same rows, the whole row between them. Tiles of 16 columns leave 6 of 48 lanes
idle (the whole-row walk 22 of 64), and the weights come widened to fp32 once, either held through the walk
(``hoist``) or loaded as each tap column is used (from cache). One launch holds eight channels a thread at
one column and so 200 registers of weights, and spills (a control); the others take 64–125 registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tap_column(weight, chans, chan_ok, dx: tl.constexpr):
    """The five vertical taps (dy = 0..4) of tap column ``dx`` for the tile's channels, ``[1, BLOCK_C]`` each."""
    at = weight + chans * 25 + dx
    w0 = tl.load(at + 0, mask=chan_ok, other=0.0)[None, :]
    w1 = tl.load(at + 5, mask=chan_ok, other=0.0)[None, :]
    w2 = tl.load(at + 10, mask=chan_ok, other=0.0)[None, :]
    w3 = tl.load(at + 15, mask=chan_ok, other=0.0)[None, :]
    w4 = tl.load(at + 20, mask=chan_ok, other=0.0)[None, :]
    return w0, w1, w2, w3, w4


@triton.jit
def _shifted(row_at, cols, dx: tl.constexpr, grid_w, s_token, chan_ok, row_ok):
    """The input row's columns ``cols + dx − 2`` (zero outside the grid), fp32 ``[BLOCK_X, BLOCK_C]``."""
    c = cols + (dx - 2)
    ok = ((c >= 0) & (c < grid_w) & row_ok)[:, None] & chan_ok[None, :]
    return tl.load(row_at + c.to(tl.int64)[:, None] * s_token, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _tap_column_into(a0, a1, a2, a3, a4, row_at, cols, grid_w, s_token, chan_ok, row_ok, weight, chans,
                     dx: tl.constexpr, w0, w1, w2, w3, w4, HOIST: tl.constexpr):
    """The input row shifted by tap column ``dx`` into the five rolling sums (sum k, output row i − 2 + k, takes
    tap row 4 − k), with the column's weights ``w0..w4`` as held (``HOIST``) or loaded here."""
    if not HOIST:
        w0, w1, w2, w3, w4 = _tap_column(weight, chans, chan_ok, dx)
    x = _shifted(row_at, cols, dx, grid_w, s_token, chan_ok, row_ok)
    return a0 + x * w4, a1 + x * w3, a2 + x * w2, a3 + x * w1, a4 + x * w0


@triton.jit
def _spatial_conv_rolling_kernel(src, weight, dst, grid_h, grid_w, channels, s_frame, s_token,
                                 BLOCK_X: tl.constexpr, BLOCK_C: tl.constexpr, HOIST: tl.constexpr):
    chans = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cols = tl.program_id(1) * BLOCK_X + tl.arange(0, BLOCK_X)
    frame = tl.program_id(2).to(tl.int64)
    chan_ok = chans < channels
    out_mask = (cols < grid_w)[:, None] & chan_ok[None, :]
    # w{dy}{dx}: tap (dy, dx), held through the walk with HOIST (without it unused, and dropped by the compiler)
    w00, w10, w20, w30, w40 = _tap_column(weight, chans, chan_ok, 0)
    w01, w11, w21, w31, w41 = _tap_column(weight, chans, chan_ok, 1)
    w02, w12, w22, w32, w42 = _tap_column(weight, chans, chan_ok, 2)
    w03, w13, w23, w33, w43 = _tap_column(weight, chans, chan_ok, 3)
    w04, w14, w24, w34, w44 = _tap_column(weight, chans, chan_ok, 4)
    a0 = tl.zeros((BLOCK_X, BLOCK_C), dtype=tl.float32)  # output row i − 2
    a1 = tl.zeros((BLOCK_X, BLOCK_C), dtype=tl.float32)
    a2 = tl.zeros((BLOCK_X, BLOCK_C), dtype=tl.float32)
    a3 = tl.zeros((BLOCK_X, BLOCK_C), dtype=tl.float32)
    a4 = tl.zeros((BLOCK_X, BLOCK_C), dtype=tl.float32)  # output row i + 2
    for i in range(grid_h + 2):
        row_ok = i < grid_h
        row_at = src + frame * s_frame + (i * grid_w).to(tl.int64) * s_token + chans[None, :]
        a0, a1, a2, a3, a4 = _tap_column_into(a0, a1, a2, a3, a4, row_at, cols, grid_w, s_token, chan_ok, row_ok,
                                              weight, chans, 0, w00, w10, w20, w30, w40, HOIST)
        a0, a1, a2, a3, a4 = _tap_column_into(a0, a1, a2, a3, a4, row_at, cols, grid_w, s_token, chan_ok, row_ok,
                                              weight, chans, 1, w01, w11, w21, w31, w41, HOIST)
        a0, a1, a2, a3, a4 = _tap_column_into(a0, a1, a2, a3, a4, row_at, cols, grid_w, s_token, chan_ok, row_ok,
                                              weight, chans, 2, w02, w12, w22, w32, w42, HOIST)
        a0, a1, a2, a3, a4 = _tap_column_into(a0, a1, a2, a3, a4, row_at, cols, grid_w, s_token, chan_ok, row_ok,
                                              weight, chans, 3, w03, w13, w23, w33, w43, HOIST)
        a0, a1, a2, a3, a4 = _tap_column_into(a0, a1, a2, a3, a4, row_at, cols, grid_w, s_token, chan_ok, row_ok,
                                              weight, chans, 4, w04, w14, w24, w34, w44, HOIST)
        done = i - 2  # output row i − 2 has all five of its input rows
        if done >= 0:
            token = (frame * grid_h + done) * grid_w + cols.to(tl.int64)
            tl.store(dst + token[:, None] * channels + chans[None, :], a0.to(dst.dtype.element_ty), mask=out_mask)
        a0, a1, a2, a3 = a1, a2, a3, a4
        a4 = tl.zeros((BLOCK_X, BLOCK_C), dtype=tl.float32)


# (columns, channels, warps, weights held through the walk) timed by branch_stages.py; registers a thread and
# stack as ptxas gives them for sm_90 (bench/kernel_registers.py, Triton 3.8): the first, eight channels a
# thread at one column, holds 200 registers of weights alone and spills (255 and 200 bytes of stack); the
# others 64–125 registers, no stack
SPATIAL_CONV_LAUNCHES = ((16, 64, 4, True), (16, 64, 8, False), (16, 32, 8, True), (16, 32, 4, False),
                         (8, 64, 8, False), (16, 16, 4, False))


def spatial_conv_rolling(x: torch.Tensor, weight: torch.Tensor, grid, block_x: int = 16, block_c: int = 32,
                         warps: int = 8, hoist: bool = True) -> torch.Tensor:
    """``branch_fused.spatial_conv`` for a 5×5 ``weight`` ``[C, 1, 5, 5]``: contiguous ``[F, S, C]`` from ``x``
    ``[F, S, C]`` with a contiguous last dimension (any frame and token strides). ``block_x`` columns ×
    ``block_c`` channels a program, ``warps`` and ``hoist`` (the 25 weights held through the walk, or loaded as
    each tap column is used) choose the launch; the numbers do not depend on it (each output is its 25
    products summed in fp32 in one order, rounded once; the weights rounded to ``x``'s dtype, as the library
    form convolves with them, and widened once here)."""
    frames, tokens, channels = x.shape
    grid_h, grid_w = grid
    assert x.stride(2) == 1 and tokens == grid_h * grid_w and tuple(weight.shape[-2:]) == (5, 5)
    out = torch.empty(frames, tokens, channels, dtype=x.dtype, device=x.device)
    if out.numel():
        taps = weight.reshape(channels, 25).to(x.dtype).float().contiguous()
        launch = (triton.cdiv(channels, block_c), triton.cdiv(grid_w, block_x), frames)
        _spatial_conv_rolling_kernel[launch](x, taps, out, grid_h, grid_w, channels, x.stride(0), x.stride(1),
                                             BLOCK_X=block_x, BLOCK_C=block_c, HOIST=hoist, num_warps=warps)
    return out
