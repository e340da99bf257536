"""Candidate Triton forms timed beside the library's (``branch_stages.py``) before one is adopted.

``spatial_conv_triton``: the linear branch's depthwise 5×5 over each frame's 24×42 grid, read in place from
the strided slice of the fused projection (cuDNN first copies it to a dense channels-last tensor) and written
dense, one grid row × channel tile per program. A first version unrolled all 25 taps; its tile loads were
hoisted together and it ran at 150 ms per call against cuDNN's 2.9 ms. Here the rows of the window are a
loop the compiler keeps (five loads live at most) and the tiles are half as wide.

``swiglu_quantize_triton``: the fp8 FFN's SiLU·up and the quantisation of ``fc2``'s input in one pass per row,
where the library writes the product (one compiled pass) and the quantiser reads it back.

``readout_triton``: the linear branch's readout — q̃ = L2(SiLU(q)), the product with the frame's state, the
RMSNorm and the output gate — in one pass per tile of tokens × head, where the library runs three (the
features, a batched GEMM, the finish) with two intermediates of the video rows' size.
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


@triton.jit
def _readout_kernel(q_raw, state, norm_weight, logits, dst, n_tokens, heads, s_row, eps,
                    D: tl.constexpr, BLOCK_S: tl.constexpr):
    frame = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    tokens = (tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    cols = tl.arange(0, D)
    token_ok = (tokens < n_tokens)[:, None]
    rows = frame * n_tokens + tokens
    q = tl.load(q_raw + rows[:, None] * s_row + head * D + cols[None, :], mask=token_ok, other=0.0).to(tl.float32)
    q = q * tl.sigmoid(q)
    q = q / tl.maximum(tl.sqrt(tl.sum(q * q, axis=1)), eps)[:, None]  # q̃ = L2(SiLU(q))
    # state [d_v, d_k] read transposed as [d_k, d_v]: out[s, v] = Σ_k q̃[s, k] S[v, k]
    base = state + (frame * heads + head) * D * D
    st = tl.load(base + cols[None, :] * D + cols[:, None])
    o = tl.dot(q.to(q_raw.dtype.element_ty), st.to(q_raw.dtype.element_ty))
    o = o.to(q_raw.dtype.element_ty).to(tl.float32)  # the library's readout GEMM rounds its output
    o = o * tl.rsqrt(tl.sum(o * o, axis=1) / D + eps)[:, None] * tl.load(norm_weight + cols).to(tl.float32)[None, :]
    offsets = rows[:, None] * (heads * D) + head * D + cols[None, :]
    gate = tl.load(logits + offsets, mask=token_ok, other=0.0).to(tl.float32)
    tl.store(dst + offsets, (o * tl.sigmoid(gate)).to(dst.dtype.element_ty), mask=token_ok)


def readout_triton(q_raw: torch.Tensor, state: torch.Tensor, norm_weight: torch.Tensor,
                   gate_logits: torch.Tensor, eps: float = 1e-6, block_s: int = 64) -> torch.Tensor:
    """The linear branch's fused readout in one pass: ``query_features``, the GEMM with each frame's state and
    ``readout_finish`` (``LinearBranch._fused_readout`` less the gate's projections). ``q_raw`` ``[F, S, h, d]``
    (any frame and token strides: the projection's slice), ``state`` ``[F, h, d, d]`` fp32, ``gate_logits``
    ``[F·S, h·d]``; returns ``[F·S, h·d]`` in the gate's dtype."""
    frames, tokens, heads, d = q_raw.shape
    assert q_raw.stride(3) == 1 and q_raw.stride(2) == d and q_raw.stride(0) == tokens * q_raw.stride(1)
    state = state.float().contiguous()
    out = torch.empty(frames * tokens, heads * d, dtype=gate_logits.dtype, device=q_raw.device)
    if out.numel():
        _readout_kernel[(frames, heads, triton.cdiv(tokens, block_s))](
            q_raw, state, norm_weight, gate_logits.contiguous(), out, tokens, heads, q_raw.stride(1), eps, D=d,
            BLOCK_S=block_s)
    return out
