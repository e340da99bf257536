"""Candidate Triton forms timed beside the library's (``branch_stages.py``) before one is adopted.

``spatial_conv_rows``: the linear branch's depthwise 5×5 over each frame's grid (``branch_fused.spatial_conv``,
cuDNN: 2.7 ms a call at the release size, where reading and writing the tensor once takes ≈ 0.6 ms). Each
program walks one frame's grid row by row for a block of channels: every input row is loaded once per
horizontal tap (five loads, from cache after the first) and added into the five output rows it feeds, which
are held as rolling accumulators; the top one is complete when its last input row has been added, and is
written. Two earlier forms — a program per output row reading all 25 taps — took 150 ms (all 25 tile loads
hoisted together) and 6.6 ms a call.

``norm_modulate_quantize``: the fp8 FFN's input — the block's second RMSNorm and AdaLN modulation, then the
row quantisation ``fc1`` applies — in one pass per row, where the library writes the modulated rows (one
compiled pass) and the quantiser reads them back. ``gate_heads_quantize`` does the same for ``out_proj``'s
input: the window softmax's output times its per-head gate, quantised per row.

``quantize_rows_chunked``, ``swiglu_quantize_chunked``: the row quantiser and the SwiGLU quantiser reading
each row in power-of-two chunks, twice, instead of holding it padded to the next power of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3_core._fp8_triton import code_buffers, quantize_row


@triton.jit
def _tap(tile, weight, chans, chan_ok, dy: tl.constexpr, dx: tl.constexpr, KSIZE: tl.constexpr):
    w = tl.load(weight + chans * (KSIZE * KSIZE) + dy * KSIZE + dx, mask=chan_ok, other=0.0).to(tl.float32)
    return tile * w[None, :]


@triton.jit
def _spatial_conv_rows_kernel(src, weight, dst, grid_h, grid_w, channels, s_frame, s_token,
                              BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
    # 5×5: output row r takes input rows r-2..r+2; input row i feeds output rows i+2 (tap row 0) .. i-2 (row 4)
    KSIZE: tl.constexpr = 5
    frame = tl.program_id(0).to(tl.int64)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cols = tl.arange(0, BLOCK_W)
    chan_ok = chans < channels
    col_ok = cols < grid_w
    out_mask = col_ok[:, None] & chan_ok[None, :]
    a0 = tl.zeros((BLOCK_W, BLOCK_C), dtype=tl.float32)  # output row i-2
    a1 = tl.zeros((BLOCK_W, BLOCK_C), dtype=tl.float32)  # i-1
    a2 = tl.zeros((BLOCK_W, BLOCK_C), dtype=tl.float32)  # i
    a3 = tl.zeros((BLOCK_W, BLOCK_C), dtype=tl.float32)  # i+1
    a4 = tl.zeros((BLOCK_W, BLOCK_C), dtype=tl.float32)  # i+2
    for i in range(grid_h + 2):
        row_ok = i < grid_h
        for dx in tl.static_range(KSIZE):
            c = cols + dx - KSIZE // 2
            ok = ((c >= 0) & (c < grid_w) & row_ok)[:, None] & chan_ok[None, :]
            token = (i * grid_w + c).to(tl.int64)
            x = tl.load(src + frame * s_frame + token[:, None] * s_token + chans[None, :], mask=ok,
                        other=0.0).to(tl.float32)
            a0 += _tap(x, weight, chans, chan_ok, 4, dx, KSIZE)
            a1 += _tap(x, weight, chans, chan_ok, 3, dx, KSIZE)
            a2 += _tap(x, weight, chans, chan_ok, 2, dx, KSIZE)
            a3 += _tap(x, weight, chans, chan_ok, 1, dx, KSIZE)
            a4 += _tap(x, weight, chans, chan_ok, 0, dx, KSIZE)
        done = i - 2  # output row i-2 has had all five input rows
        if done >= 0:
            token = (frame * grid_h * grid_w + done * grid_w + cols).to(tl.int64)
            tl.store(dst + token[:, None] * channels + chans[None, :], a0.to(dst.dtype.element_ty), mask=out_mask)
        a0, a1, a2, a3 = a1, a2, a3, a4
        a4 = tl.zeros((BLOCK_W, BLOCK_C), dtype=tl.float32)


def spatial_conv_rows(x: torch.Tensor, weight: torch.Tensor, grid, block_c: int = 32,
                      warps: int = 4) -> torch.Tensor:
    """``branch_fused.spatial_conv`` for a 5×5 ``weight`` ``[C, 1, 5, 5]``: contiguous ``[F, S, C]`` from ``x``
    ``[F, S, C]`` with a contiguous last dimension (any frame and token strides)."""
    frames, tokens, channels = x.shape
    grid_h, grid_w = grid
    assert x.stride(2) == 1 and tokens == grid_h * grid_w and tuple(weight.shape[-2:]) == (5, 5)
    out = torch.empty(frames, tokens, channels, dtype=x.dtype, device=x.device)
    block_c = min(block_c, triton.next_power_of_2(channels))
    if out.numel():
        _spatial_conv_rows_kernel[(frames, triton.cdiv(channels, block_c))](
            x, weight.to(x.dtype).contiguous(), out, grid_h, grid_w, channels, x.stride(0), x.stride(1),
            BLOCK_W=triton.next_power_of_2(grid_w), BLOCK_C=block_c, num_warps=warps)
    return out


@triton.jit
def _norm_modulate_quantize_kernel(x, weight, shift, scale, table_rows, codes, scales, hidden, eps, smallest,
                                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    v = tl.load(x + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(v * v, axis=0) / hidden + eps)
    w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    entry = tl.load(table_rows + row).to(tl.int64)
    sh = tl.load(shift + entry * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    sc = tl.load(scale + entry * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    h = (v * inv * w * (1 + sc) + sh).to(x.dtype.element_ty).to(tl.float32)  # as the two-pass path stores it
    q, s = quantize_row(h, smallest)
    tl.store(codes + row * hidden + cols, q.to(codes.dtype.element_ty), mask=mask)
    tl.store(scales + row, s)


def norm_modulate_quantize(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                           table_rows: torch.Tensor, eps: float, smallest: float,
                           codes_dtype: torch.dtype = torch.float8_e4m3fn, warps: int = 8):
    """``quantize_rows(block_fused.norm_modulate(x, weight, shift, scale, table_rows, eps))`` in one pass per
    row, for the FFN's input (which only ``fc1`` reads): the modulated rows are never stored. ``x``
    ``[T, hidden]`` contiguous, ``shift``/``scale`` ``[R, hidden]``, ``table_rows`` ``[T]``; returns codes
    ``[T, hidden]`` and fp32 scales ``[T, 1]`` (``codes_dtype=torch.float32`` keeps the quotients, for
    Triton's CPU interpreter)."""
    rows, hidden = x.shape
    x = x.contiguous()
    codes, scales = code_buffers(rows, hidden, codes_dtype, x.device)
    if rows:
        _norm_modulate_quantize_kernel[(rows,)](x, weight, shift.contiguous(), scale.contiguous(), table_rows, codes,
                                                scales, hidden, eps, smallest, BLOCK=triton.next_power_of_2(hidden),
                                                num_warps=warps)
    return codes, scales


@triton.jit
def _gate_heads_quantize_kernel(soft, gate, codes, scales, heads, head_dim, smallest, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    width = heads * head_dim
    mask = cols < width
    v = tl.load(soft + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate + row * heads + cols // head_dim, mask=mask, other=0.0).to(tl.float32)
    h = (v * g).to(soft.dtype.element_ty).to(tl.float32)  # as the two-pass path stores it
    q, s = quantize_row(h, smallest)
    tl.store(codes + row * width + cols, q.to(codes.dtype.element_ty), mask=mask)
    tl.store(scales + row, s)


def gate_heads_quantize(soft: torch.Tensor, gate: torch.Tensor, smallest: float,
                        codes_dtype: torch.dtype = torch.float8_e4m3fn, warps: int = 8):
    """``quantize_rows(block_fused.gate_heads_(soft, gate).reshape(T, -1))`` in one pass per row: the window
    softmax's output ``[T, h, d]`` (contiguous) times its per-head gate ``[T, h]``, quantised for ``out_proj``
    without storing the gated rows. Returns codes ``[T, h·d]`` and fp32 scales ``[T, 1]``."""
    rows, heads, head_dim = soft.shape
    soft, gate = soft.contiguous(), gate.contiguous()
    codes, scales = code_buffers(rows, heads * head_dim, codes_dtype, soft.device)
    if rows:
        _gate_heads_quantize_kernel[(rows,)](soft, gate, codes, scales, heads, head_dim, smallest,
                                             BLOCK=triton.next_power_of_2(heads * head_dim), num_warps=warps)
    return codes, scales


@triton.jit
def _chunk(src, row, s_row, n_cols, start, cols, SWIGLU: tl.constexpr):
    """Columns ``start + cols`` of the row to quantise (fp32) and their mask: the row itself, or with ``SWIGLU``
    the product silu(gate) · up from ``fc1``'s row [gate | up], rounded as the two-step path stores it."""
    mask = start + cols < n_cols
    x = tl.load(src + row * s_row + start + cols, mask=mask, other=0.0).to(tl.float32)
    if SWIGLU:
        up = tl.load(src + row * s_row + n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x * tl.sigmoid(x) * up).to(src.dtype.element_ty).to(tl.float32)
    return x, mask


@triton.jit
def _quantize_chunked_kernel(src, codes, scales, n_cols, s_row, smallest, BLOCK_K: tl.constexpr,
                             SWIGLU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_K):
        x, mask = _chunk(src, row, s_row, n_cols, start, cols, SWIGLU)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), 448.0), smallest)
    for start in range(0, n_cols, BLOCK_K):  # the row again, from cache
        x, mask = _chunk(src, row, s_row, n_cols, start, cols, SWIGLU)
        tl.store(codes + row * n_cols + start + cols, tl.div_rn(x, scale).to(codes.dtype.element_ty), mask=mask)
    tl.store(scales + row, scale)


def quantize_rows_chunked(x: torch.Tensor, smallest: float, codes_dtype: torch.dtype = torch.float8_e4m3fn,
                          block_k: int = 512, warps: int = 4):
    """``h3_core._fp8_triton.quantize_rows_triton`` reading each row in chunks of ``block_k`` columns, twice
    (the amax, then the codes; the second read from cache), where the library holds the whole row padded to a
    power of two: 8,192 lanes for the hidden width of 5,376, a third of them idle."""
    rows, cols = x.shape
    assert x.stride(1) == 1 or cols == 1
    codes, scales = code_buffers(rows, cols, codes_dtype, x.device)
    if rows:
        _quantize_chunked_kernel[(rows,)](x, codes, scales, cols, x.stride(0), smallest, BLOCK_K=block_k,
                                          SWIGLU=False, num_warps=warps)
    return codes, scales


def swiglu_quantize_chunked(gate_up: torch.Tensor, smallest: float, codes_dtype: torch.dtype = torch.float8_e4m3fn,
                            block_k: int = 2048, warps: int = 8):
    """``h3_core._fp8_triton.swiglu_quantize_triton`` over chunks of ``block_k`` columns, twice (the amax, then
    the codes), where the library holds the row padded to 16,384 lanes for the FFN width of 14,336."""
    rows, width = gate_up.shape
    ffn = width // 2
    assert gate_up.stride(1) == 1
    codes, scales = code_buffers(rows, ffn, codes_dtype, gate_up.device)
    if rows:
        _quantize_chunked_kernel[(rows,)](gate_up, codes, scales, ffn, gate_up.stride(0), smallest,
                                          BLOCK_K=block_k, SWIGLU=True, num_warps=warps)
    return codes, scales
