"""The linear branch's fused functions (branch_fused.py) as Triton passes.

``conv_features``: each program takes a tile of tokens × one head's channels through the frames, sums the
temporal taps over the frames around each one (with the model's five taps, held as it goes: each input read
once), applies SiLU, the L2 norm and √β, and writes the tile head-major. Loads and stores are rows of ``d``
contiguous channels in both layouts, where the compiled form scatters its head-major writes. The arithmetic
is the written function's: fp32 sums over the taps in order, one rounding.

``readout``: each program takes a tile of tokens × one head straight from the projection's q slice, forms
q̃ = L2(SiLU(q)), multiplies it by the frame's state on the tensor cores, and applies the RMSNorm and the
output gate, writing token-major rows: one pass where the compiled form runs three (the features, a batched
GEMM, the finish) through two intermediates the size of the video rows. q̃ and the product are rounded to
the rows' dtype where the written function stores them, so the numbers are its numbers.

``scan``: the prefix and the suffix of the frame states, both directions in one launch. Each program carries
a block of one head's state rows through every frame (rows of S_f = S_{f−1} T_f + J_f evolve independently),
the product on the tensor cores at fp32 accuracy (three TF32 passes), where the library form launches one
small batched GEMM per frame and direction (200 at the release length, each filling a fraction of the GPU).

``gather``: each frame's state from the prefix and suffix states it reads (or the seed) and their decay
bridges, read in place and written once, where the library form copies the gathered frames, selects against
the seed and scales and adds them in separate passes.

``spatial_conv``: the depthwise 5×5 over each frame's grid, each program four output rows × a block of channels
walking the columns with the eight input rows of the five columns around the current one held, where cuDNN's
depthwise kernel moves several times the bytes it needs (bench/results/dit_block.md).

``shifted_gram``: I + ½(A + Aᵀ) for the batch of Gram products, each program a tile and its mirror tile.

``small_inverse``: the solve's smallest blocks (16 × 16) inverted in one pass, a few whole blocks per program
(Gauss-Jordan without pivoting, which positive definite blocks do not need).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .branch_math import gather_plan


@triton.jit
def _head_tile(head, block, n_tokens, head_dim, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token block ``block`` × head ``head``'s channels: the tokens, the columns within the head, the channels,
    and the token, column and tile masks."""
    tokens = (block * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    token_ok = tokens < n_tokens
    col_ok = cols < head_dim
    return tokens, cols, head * head_dim + cols, token_ok, col_ok, token_ok[:, None] & col_ok[None, :]


@triton.jit
def _finish_features(
    acc,
    beta,
    dst,
    frame,
    head,
    tokens,
    cols,
    token_ok,
    mask,
    n_tokens,
    heads,
    head_dim,
    eps,
    NORMALIZE: tl.constexpr,
    HAS_BETA: tl.constexpr,
):
    """SiLU of the summed taps ``acc``, the L2 norm over the head's channels, √β, and the tile written
    head-major into ``dst`` ``[F, heads, S, d]``."""
    z = acc * tl.sigmoid(acc)
    if NORMALIZE:
        z = z / tl.maximum(tl.sqrt(tl.sum(z * z, axis=1)), eps)[:, None]
    if HAS_BETA:
        b = tl.load(beta + (frame * n_tokens + tokens) * heads + head, mask=token_ok, other=0.0).to(tl.float32)
        z = z * tl.sqrt(b)[:, None]
    out = dst + ((frame * heads + head) * n_tokens + tokens)[:, None] * head_dim + cols[None, :]
    tl.store(out, z.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _conv_features_kernel(
    src,
    taps,
    beta,
    dst,
    n_frames,
    n_tokens,
    heads,
    head_dim,
    eps,
    N_TAPS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    HAS_BETA: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    frame = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    tokens, cols, channels, token_ok, col_ok, mask = _head_tile(
        head, tl.program_id(2), n_tokens, head_dim, BLOCK_S, BLOCK_D
    )
    width = heads * head_dim
    acc = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(N_TAPS):
        source = frame + j - N_TAPS // 2
        inside = (source >= 0) & (source < n_frames)
        x = tl.load(
            src + (source * n_tokens + tokens)[:, None] * width + channels[None, :], mask=mask & inside, other=0.0
        ).to(tl.float32)
        w = tl.load(taps + channels * N_TAPS + j, mask=col_ok, other=0.0).to(tl.float32)
        acc = acc + x * w[None, :]
    _finish_features(
        acc, beta, dst, frame, head, tokens, cols, token_ok, mask, n_tokens, heads, head_dim, eps, NORMALIZE, HAS_BETA
    )


@triton.jit
def _conv_features_rolling_kernel(
    src,
    taps,
    beta,
    dst,
    n_frames,
    n_tokens,
    heads,
    eps,
    HEAD_DIM: tl.constexpr,
    NORMALIZE: tl.constexpr,
    HAS_BETA: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # five temporal taps: each program walks one tile of tokens × one head's channels through every frame,
    # holding the five frames around the current one, so each input tile is read once
    head = tl.program_id(0).to(tl.int64)
    tokens, cols, channels, token_ok, col_ok, mask = _head_tile(
        head, tl.program_id(1), n_tokens, HEAD_DIM, BLOCK_S, BLOCK_D
    )
    width = heads * HEAD_DIM
    w0 = tl.load(taps + channels * 5 + 0, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    w1 = tl.load(taps + channels * 5 + 1, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(taps + channels * 5 + 2, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    w3 = tl.load(taps + channels * 5 + 3, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    w4 = tl.load(taps + channels * 5 + 4, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tile = tokens[:, None] * width + channels[None, :]
    x0 = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    x1 = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    x2 = tl.load(src + tile, mask=mask & (n_frames > 0), other=0.0).to(tl.float32)
    x3 = tl.load(src + n_tokens * width + tile, mask=mask & (n_frames > 1), other=0.0).to(tl.float32)
    for frame in range(n_frames):
        ahead = frame + 2
        x4 = tl.load(src + ahead.to(tl.int64) * n_tokens * width + tile, mask=mask & (ahead < n_frames), other=0.0).to(
            tl.float32
        )
        acc = x0 * w0
        acc = acc + x1 * w1
        acc = acc + x2 * w2
        acc = acc + x3 * w3
        acc = acc + x4 * w4
        _finish_features(
            acc,
            beta,
            dst,
            frame,
            head,
            tokens,
            cols,
            token_ok,
            mask,
            n_tokens,
            heads,
            HEAD_DIM,
            eps,
            NORMALIZE,
            HAS_BETA,
        )
        x0, x1, x2, x3 = x1, x2, x3, x4


@triton.jit
def _spatial_column(at, line_stride, inside, row, grid_h):
    """Input rows ``row`` − 2 … ``row`` + 5 at one column (``at`` points at row ``row``'s), fp32, zero outside."""
    r0 = tl.load(at - 2 * line_stride, mask=inside & (row >= 2), other=0.0).to(tl.float32)
    r1 = tl.load(at - line_stride, mask=inside & (row >= 1), other=0.0).to(tl.float32)
    r2 = tl.load(at, mask=inside & (row < grid_h), other=0.0).to(tl.float32)
    r3 = tl.load(at + line_stride, mask=inside & (row + 1 < grid_h), other=0.0).to(tl.float32)
    r4 = tl.load(at + 2 * line_stride, mask=inside & (row + 2 < grid_h), other=0.0).to(tl.float32)
    r5 = tl.load(at + 3 * line_stride, mask=inside & (row + 3 < grid_h), other=0.0).to(tl.float32)
    r6 = tl.load(at + 4 * line_stride, mask=inside & (row + 4 < grid_h), other=0.0).to(tl.float32)
    r7 = tl.load(at + 5 * line_stride, mask=inside & (row + 5 < grid_h), other=0.0).to(tl.float32)
    return r0, r1, r2, r3, r4, r5, r6, r7


@triton.jit
def _spatial_taps(weight, ch, ch_ok, dx: tl.constexpr):
    """Column ``dx`` of each channel's 5×5 taps (rows 0..4), fp32."""
    at = weight + ch.to(tl.int64) * 25 + dx
    a = tl.load(at, mask=ch_ok, other=0.0).to(tl.float32)
    b = tl.load(at + 5, mask=ch_ok, other=0.0).to(tl.float32)
    c = tl.load(at + 10, mask=ch_ok, other=0.0).to(tl.float32)
    d = tl.load(at + 15, mask=ch_ok, other=0.0).to(tl.float32)
    e = tl.load(at + 20, mask=ch_ok, other=0.0).to(tl.float32)
    return a, b, c, d, e


@triton.jit
def _tap_column(a, b, c, d, e, wa, wb, wc, wd, we):
    return a * wa + b * wb + c * wc + d * wd + e * we


@triton.jit
def _zero_column(BLOCK_C: tl.constexpr):
    # eight separate zero tensors: a loop-carried value must not start as the same value as another
    z0 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    z1 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    z2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    z3 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    z4 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    z5 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    z6 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    z7 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    return z0, z1, z2, z3, z4, z5, z6, z7


@triton.jit
def _spatial_store(out, line_stride, col, channels, ok, row, grid_h, y0, y1, y2, y3):
    at = out + col * channels
    tl.store(at, y0.to(out.dtype.element_ty), mask=ok & (row < grid_h))
    tl.store(at + line_stride, y1.to(out.dtype.element_ty), mask=ok & (row + 1 < grid_h))
    tl.store(at + 2 * line_stride, y2.to(out.dtype.element_ty), mask=ok & (row + 2 < grid_h))
    tl.store(at + 3 * line_stride, y3.to(out.dtype.element_ty), mask=ok & (row + 3 < grid_h))


@triton.jit
def _spatial_conv_kernel(src, weight, dst, grid_h, grid_w, channels, row_blocks, BLOCK_C: tl.constexpr):
    # four output rows of one frame × a block of channels per program, walking the columns with the 8 × 5 inputs
    # around the current column held as channel vectors (p … t, rows − 2 … + 5): each step loads the eight of the
    # column that enters, so each input is read twice from L2 instead of five times at one row a program
    frame = tl.program_id(0) // row_blocks
    row = (tl.program_id(0) % row_blocks) * 4
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ch_ok = ch < channels
    line_stride = grid_w.to(tl.int64) * channels
    first = (frame.to(tl.int64) * grid_h + row) * line_stride + ch
    at, out = src + first, dst + first
    w0a, w0b, w0c, w0d, w0e = _spatial_taps(weight, ch, ch_ok, 0)
    w1a, w1b, w1c, w1d, w1e = _spatial_taps(weight, ch, ch_ok, 1)
    w2a, w2b, w2c, w2d, w2e = _spatial_taps(weight, ch, ch_ok, 2)
    w3a, w3b, w3c, w3d, w3e = _spatial_taps(weight, ch, ch_ok, 3)
    w4a, w4b, w4c, w4d, w4e = _spatial_taps(weight, ch, ch_ok, 4)
    p0, p1, p2, p3, p4, p5, p6, p7 = _zero_column(BLOCK_C)
    q0, q1, q2, q3, q4, q5, q6, q7 = _zero_column(BLOCK_C)
    r0, r1, r2, r3, r4, r5, r6, r7 = _spatial_column(at, line_stride, ch_ok & (grid_w > 0), row, grid_h)
    s0, s1, s2, s3, s4, s5, s6, s7 = _spatial_column(at + channels, line_stride, ch_ok & (grid_w > 1), row, grid_h)
    for col in range(grid_w):
        ahead = col + 2
        t0, t1, t2, t3, t4, t5, t6, t7 = _spatial_column(
            at + ahead * channels, line_stride, ch_ok & (ahead < grid_w), row, grid_h
        )
        out0 = _tap_column(p0, p1, p2, p3, p4, w0a, w0b, w0c, w0d, w0e)
        out0 += _tap_column(q0, q1, q2, q3, q4, w1a, w1b, w1c, w1d, w1e)
        out0 += _tap_column(r0, r1, r2, r3, r4, w2a, w2b, w2c, w2d, w2e)
        out0 += _tap_column(s0, s1, s2, s3, s4, w3a, w3b, w3c, w3d, w3e)
        out0 += _tap_column(t0, t1, t2, t3, t4, w4a, w4b, w4c, w4d, w4e)
        out1 = _tap_column(p1, p2, p3, p4, p5, w0a, w0b, w0c, w0d, w0e)
        out1 += _tap_column(q1, q2, q3, q4, q5, w1a, w1b, w1c, w1d, w1e)
        out1 += _tap_column(r1, r2, r3, r4, r5, w2a, w2b, w2c, w2d, w2e)
        out1 += _tap_column(s1, s2, s3, s4, s5, w3a, w3b, w3c, w3d, w3e)
        out1 += _tap_column(t1, t2, t3, t4, t5, w4a, w4b, w4c, w4d, w4e)
        out2 = _tap_column(p2, p3, p4, p5, p6, w0a, w0b, w0c, w0d, w0e)
        out2 += _tap_column(q2, q3, q4, q5, q6, w1a, w1b, w1c, w1d, w1e)
        out2 += _tap_column(r2, r3, r4, r5, r6, w2a, w2b, w2c, w2d, w2e)
        out2 += _tap_column(s2, s3, s4, s5, s6, w3a, w3b, w3c, w3d, w3e)
        out2 += _tap_column(t2, t3, t4, t5, t6, w4a, w4b, w4c, w4d, w4e)
        out3 = _tap_column(p3, p4, p5, p6, p7, w0a, w0b, w0c, w0d, w0e)
        out3 += _tap_column(q3, q4, q5, q6, q7, w1a, w1b, w1c, w1d, w1e)
        out3 += _tap_column(r3, r4, r5, r6, r7, w2a, w2b, w2c, w2d, w2e)
        out3 += _tap_column(s3, s4, s5, s6, s7, w3a, w3b, w3c, w3d, w3e)
        out3 += _tap_column(t3, t4, t5, t6, t7, w4a, w4b, w4c, w4d, w4e)
        _spatial_store(out, line_stride, col, channels, ch_ok, row, grid_h, out0, out1, out2, out3)
        p0, p1, p2, p3, p4, p5, p6, p7 = q0, q1, q2, q3, q4, q5, q6, q7
        q0, q1, q2, q3, q4, q5, q6, q7 = r0, r1, r2, r3, r4, r5, r6, r7
        r0, r1, r2, r3, r4, r5, r6, r7 = s0, s1, s2, s3, s4, s5, s6, s7
        s0, s1, s2, s3, s4, s5, s6, s7 = t0, t1, t2, t3, t4, t5, t6, t7


def spatial_conv_triton(x: torch.Tensor, weight: torch.Tensor, grid, block_c: int = 64, warps: int = 1) -> torch.Tensor:
    """``branch_fused.spatial_conv``: the depthwise 5×5 over each frame's grid of ``x`` ``[F, S, C]`` (zero
    padded) with ``weight`` ``[C, 1, 5, 5]`` rounded to ``x``'s dtype, fp32 sums, one rounding. ``block_c`` and
    ``warps`` choose the launch; the numbers do not depend on it."""
    frames, _, channels = x.shape
    if tuple(weight.shape[-2:]) != (5, 5):
        raise ValueError(f"spatial_conv_triton takes 5×5 taps, got {tuple(weight.shape)}")
    x = x.contiguous()
    taps = weight.to(x.dtype).reshape(channels, 25).contiguous()
    out = torch.empty_like(x)
    if out.numel():
        row_blocks = triton.cdiv(grid[0], 4)
        _spatial_conv_kernel[(frames * row_blocks, triton.cdiv(channels, block_c))](
            x, taps, out, grid[0], grid[1], channels, row_blocks, BLOCK_C=block_c, num_warps=warps
        )
    return out


def conv_features_triton(
    y: torch.Tensor,
    taps: torch.Tensor,
    heads: int,
    normalize: bool,
    beta: torch.Tensor | None = None,
    eps: float = 1e-6,
    rolling: bool = True,
    block_s: int | None = None,
    warps: int = 4,
) -> torch.Tensor:
    """``[F, heads, S, d]`` from contiguous ``y`` ``[F, S, heads·d]``, ``taps`` ``[C, 1, n]`` and ``beta``
    ``[F, S, heads]`` or None (see ``branch_fused.conv_features``). With five taps (the model's) and
    ``rolling`` each program walks its tile through the frames; otherwise a program per frame and tile reads
    the ``n`` frames around it. ``block_s`` and ``warps`` choose the launch; the numbers do not depend on it."""
    frames, tokens, channels = y.shape
    head_dim = channels // heads
    y = y.contiguous()
    taps = taps.reshape(channels, -1).contiguous()
    out = torch.empty(frames, heads, tokens, head_dim, dtype=y.dtype, device=y.device)
    block_d = triton.next_power_of_2(head_dim)
    if beta is not None:
        beta = beta.contiguous()
    if not out.numel():
        return out
    beta_arg = beta if beta is not None else y
    # 32 tokens of 128 channels, the faster tile (bench/results/dit_block.md)
    block_s = block_s or max(1, 4096 // block_d)
    if rolling and taps.shape[1] == 5:
        _conv_features_rolling_kernel[(heads, triton.cdiv(tokens, block_s))](
            y,
            taps,
            beta_arg,
            out,
            frames,
            tokens,
            heads,
            eps,
            HEAD_DIM=head_dim,
            NORMALIZE=normalize,
            HAS_BETA=beta is not None,
            BLOCK_S=block_s,
            BLOCK_D=block_d,
            num_warps=warps,
        )
        return out
    _conv_features_kernel[(frames, heads, triton.cdiv(tokens, block_s))](
        y,
        taps,
        beta_arg,
        out,
        frames,
        tokens,
        heads,
        head_dim,
        eps,
        N_TAPS=taps.shape[1],
        NORMALIZE=normalize,
        HAS_BETA=beta is not None,
        BLOCK_S=block_s,
        BLOCK_D=block_d,
        num_warps=warps,
    )
    return out


@triton.jit
def _readout_kernel(
    q_raw,
    state,
    norm_weight,
    logits,
    dst,
    n_tokens,
    heads,
    s_frame,
    s_token,
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    head_dim = HEAD_DIM  # a compile-time size: the column masks fold away when it fills the tile
    # token tiles vary fastest in the launch order, so the programs that share a frame's state for one head
    # run together and read it from L2 (faster than frames first: bench/results/dit_block.md)
    head = tl.program_id(1).to(tl.int64)
    frame = tl.program_id(2).to(tl.int64)
    tokens = (tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < head_dim
    mask = (tokens < n_tokens)[:, None] & col_ok[None, :]
    q = tl.load(
        q_raw + frame * s_frame + tokens[:, None] * s_token + head * head_dim + cols[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    q = q * tl.sigmoid(q)
    q = q / tl.maximum(tl.sqrt(tl.sum(q * q, axis=1)), eps)[:, None]
    # the state [d_v, d_k] taken as [d_k, d_v]: o[s, v] = Σ_k q̃[s, k] S[v, k]
    square = col_ok[:, None] & col_ok[None, :]
    matrix = state + (frame * heads + head) * head_dim * head_dim
    # rows of S loaded as stored (contiguous) and transposed on chip, faster than a strided load
    # (bench/results/dit_block.md)
    st = tl.trans(tl.load(matrix + cols[:, None] * head_dim + cols[None, :], mask=square, other=0.0))
    rows_dtype = q_raw.dtype.element_ty
    if IEEE:  # fp32 rows: a full-precision product, as torch.matmul's (not TF32)
        o = tl.dot(q, st.to(tl.float32), input_precision="ieee")
    else:
        o = tl.dot(q.to(rows_dtype), st.to(rows_dtype)).to(rows_dtype).to(tl.float32)
    o = o * tl.rsqrt(tl.sum(o * o, axis=1) / head_dim + eps)[:, None]
    o = o * tl.load(norm_weight + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    offsets = (frame * n_tokens + tokens)[:, None] * (heads * head_dim) + head * head_dim + cols[None, :]
    gate = tl.load(logits + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + offsets, (o * tl.sigmoid(gate)).to(dst.dtype.element_ty), mask=mask)


def readout_triton(
    q_raw: torch.Tensor,
    state: torch.Tensor,
    norm_weight: torch.Tensor,
    gate_logits: torch.Tensor,
    eps: float = 1e-6,
    block_s: int = 64,
    warps: int = 4,
) -> torch.Tensor:
    """``branch_fused.readout``: ``[F·S, h·d]`` in the gate's dtype from ``q_raw`` ``[F, S, h, d]`` (any frame
    and token strides: the projection's slice), ``state`` ``[F, h, d, d]`` and ``gate_logits`` ``[F·S, h·d]``.
    The state is rounded to the rows' dtype once here, as the product rounds it anyway, not in every program;
    the launch (``block_s``, ``warps``) does not change the numbers."""
    frames, tokens, heads, head_dim = q_raw.shape
    if q_raw.stride(3) != 1 or q_raw.stride(2) != head_dim:
        q_raw = q_raw.contiguous()
    ieee = q_raw.dtype == torch.float32
    state = (state.float() if ieee else state.to(q_raw.dtype)).contiguous()
    out = torch.empty(frames * tokens, heads * head_dim, dtype=gate_logits.dtype, device=q_raw.device)
    if out.numel():
        tiles = triton.cdiv(tokens, block_s)
        _readout_kernel[(tiles, heads, frames)](
            q_raw,
            state,
            norm_weight,
            gate_logits.contiguous(),
            out,
            tokens,
            heads,
            q_raw.stride(0),
            q_raw.stride(1),
            eps,
            HEAD_DIM=head_dim,
            BLOCK_S=block_s,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            IEEE=ieee,
            num_warps=warps,
        )
    return out


@triton.jit
def _scan_kernel(
    transitions, injections, seed, out, n_frames, heads, D: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr
):
    head = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    backward = tl.program_id(2)  # 0: the prefix, frames in order; 1: the suffix, frames reversed
    cols = tl.arange(0, D)
    square = D * D
    state = tl.load(seed + head * square + rows[:, None] * D + cols[None, :])
    out = out + backward.to(tl.int64) * n_frames * heads * square
    for step in range(n_frames):
        frame = tl.where(backward == 1, n_frames - 1 - step, step).to(tl.int64)
        matrix = (frame * heads + head) * square
        t = tl.load(transitions + matrix + cols[:, None] * D + cols[None, :])
        j = tl.load(injections + matrix + rows[:, None] * D + cols[None, :])
        state = tl.dot(state, t, input_precision=PRECISION) + j
        tl.store(out + matrix + rows[:, None] * D + cols[None, :], state)


def scan_triton(
    T: torch.Tensor, J: torch.Tensor, seed: torch.Tensor, block_v: int = 32, warps: int = 8, precision: str = "tf32x3"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``branch_math.scan``: the prefix and suffix states ``[F, H, d, d]`` fp32 from the transitions and
    injections ``[F, H, d, d]`` and the seed ``[H, d, d]``; ``d`` a power of two of at least 16. ``precision``
    is the product's (``"ieee"``: plain fp32 multiply-adds)."""
    frames, heads, d, _ = J.shape
    T, J = T.float().contiguous(), J.float().contiguous()
    seed = seed.float().contiguous()
    out = torch.empty(2, *J.shape, dtype=torch.float32, device=J.device)
    block_v = min(block_v, d)
    if J.numel():
        _scan_kernel[(heads, d // block_v, 2)](
            T, J, seed, out, frames, heads, D=d, BLOCK_V=block_v, PRECISION=precision, num_warps=warps
        )
    return out[0], out[1]


@triton.jit
def _gather_kernel(
    prefix,
    suffix,
    seed,
    before_frame,
    after_frame,
    bridge_before,
    bridge_after,
    out,
    heads,
    D: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    frame = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = tl.arange(0, D)
    tile = rows[:, None] * D + cols[None, :]
    square = D * D
    b = tl.load(before_frame + frame)
    a = tl.load(after_frame + frame)
    everywhere = tile >= 0
    # a frame index of -1 reads the seed: both loads masked, the other lanes' zeros summed in
    seed_tile = seed + head * square + tile
    before = tl.load(prefix + (tl.maximum(b, 0) * heads + head) * square + tile, mask=everywhere & (b >= 0), other=0.0)
    before += tl.load(seed_tile, mask=everywhere & (b < 0), other=0.0)
    after = tl.load(suffix + (tl.maximum(a, 0) * heads + head) * square + tile, mask=everywhere & (a >= 0), other=0.0)
    after += tl.load(seed_tile, mask=everywhere & (a < 0), other=0.0)
    vector = (frame * heads + head) * D + cols
    state = before * tl.load(bridge_before + vector)[None, :] + after * tl.load(bridge_after + vector)[None, :]
    tl.store(out + (frame * heads + head) * square + tile, state.to(out.dtype.element_ty))


def gather_triton(
    P: torch.Tensor,
    Q: torch.Tensor,
    alpha: torch.Tensor,
    bounds,
    seed: torch.Tensor,
    block_v: int = 32,
    warps: int = 8,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``branch_math.gather`` for fp32 states ``[F, H, d, d]`` (``d`` a power of two of at least 16), each
    state rounded once to ``out_dtype`` (default fp32) as it is written."""
    frames, heads, d, _ = P.shape
    before, after, bridge_before, bridge_after = gather_plan(alpha, bounds, frames, P.dtype)
    P, Q, seed = P.contiguous(), Q.contiguous(), seed.to(P.dtype).contiguous()
    out = torch.empty(P.shape, dtype=out_dtype or P.dtype, device=P.device)
    block_v = min(block_v, d)
    if out.numel():
        _gather_kernel[(frames, heads, d // block_v)](
            P,
            Q,
            seed,
            before,
            after,
            bridge_before.contiguous(),
            bridge_after.contiguous(),
            out,
            heads,
            D=d,
            BLOCK_V=block_v,
            num_warps=warps,
        )
    return out


@triton.jit
def _small_inverse_kernel(
    src, dst, n_mats, n, s_sb, s_sr, s_sc, s_db, s_dr, s_dc, N: tl.constexpr, BLOCK_M: tl.constexpr
):
    mats = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None, None]
    idx = tl.arange(0, N)
    rows, cols = idx[None, :, None], idx[None, None, :]
    inside = (mats < n_mats) & (rows < n) & (cols < n)
    a = tl.load(src + mats * s_sb + rows * s_sr + cols * s_sc, mask=inside, other=0.0).to(tl.float32)
    a = tl.where(inside, a, (rows == cols).to(tl.float32))  # the identity around each matrix and for missing ones
    for k in tl.static_range(N):
        row = tl.sum(tl.where(rows == k, a, 0.0), axis=1)  # [BLOCK_M, N]
        col = tl.sum(tl.where(cols == k, a, 0.0), axis=2)
        pivot = tl.sum(tl.where(idx[None, :] == k, row, 0.0), axis=1)
        row = tl.div_rn(tl.where(idx[None, :] == k, 1.0, row), pivot[:, None])
        col = tl.where(idx[None, :] == k, 0.0, col)
        a = tl.where(cols == k, 0.0, a) - col[:, :, None] * row[:, None, :]
        a = tl.where(rows == k, row[:, None, :], a)
    tl.store(dst + mats * s_db + rows * s_dr + cols * s_dc, a.to(dst.dtype.element_ty), mask=inside)


def small_inverse_triton(M: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The inverses of the symmetric positive definite blocks ``M`` ``[..., n, n]`` (fp32, n up to 64: the
    leaves of ``branch_math.spd_inverse``) written into ``out`` (the same shape, a view whose batch
    dimensions flatten without a copy). Gauss-Jordan elimination without pivoting, each program a few whole
    blocks in registers: positive definite blocks need no pivoting, and one pass replaces the library's batched
    LU factorisation, two triangular solves and row swaps (four launches, each a fraction of the GPU)."""
    n = M.shape[-1]
    src, dst = M.reshape(-1, n, n), out.view(-1, n, n)
    size = triton.next_power_of_2(n)
    block_m = max(1, 4096 // (size * size))
    if src.shape[0]:
        _small_inverse_kernel[(triton.cdiv(src.shape[0], block_m),)](
            src, dst, src.shape[0], n, *src.stride(), *dst.stride(), N=size, BLOCK_M=block_m, num_warps=4
        )
    return out


@triton.jit
def _shifted_gram_kernel(A, out, d, BLOCK: tl.constexpr):
    matrix = tl.program_id(0).to(tl.int64) * d * d
    rows = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[:, None]
    cols = (tl.program_id(2) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (rows < d) & (cols < d)
    a = tl.load(A + matrix + rows * d + cols, mask=mask, other=0.0)
    mirror = tl.load(A + matrix + cols * d + rows, mask=mask, other=0.0)
    eye = tl.where(rows == cols, 1.0, 0.0)
    tl.store(out + matrix + rows * d + cols, (0.5 * (a + mirror) + eye).to(out.dtype.element_ty), mask=mask)


def shifted_gram_triton(A: torch.Tensor, block: int = 32) -> torch.Tensor:
    """``branch_fused.shifted_gram(A)``: I + ½(A + Aᵀ) for ``A`` ``[..., d, d]`` in a new tensor, in ``A``'s
    dtype (the sum, the halving and the identity in that order: the written function's numbers)."""
    d = A.shape[-1]
    A = A.contiguous()
    out = torch.empty_like(A)
    count = A.numel() // (d * d) if d else 0
    if count:
        grid = (count, triton.cdiv(d, block), triton.cdiv(d, block))
        _shifted_gram_kernel[grid](A, out, d, BLOCK=block)
    return out
