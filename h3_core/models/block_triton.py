"""The block's norms and the FFN's SiLU·up as Triton passes (see block_fused.py).

``qk_norm_rope``: each tile of rows is read once (its rotation partners again, from cache), normed, rotated
and written, where the compiled form splits into a reduction kernel and a pointwise one that reads the rows
again. Each program takes a tile of rows through every head, so the rows' cos and sin are read once, not
once per head (``per_head=True`` launches a program per tile and head instead). The arithmetic is the
written function's: fp32 throughout, one rounding of the result.

``block_norm``: the RMSNorm and AdaLN modulation of the block's rows (``norm_modulate``), one program per
row reading it in chunks — optionally of the gated residual ``x + gate[row]·y`` formed on the way (and
written into ``y``'s storage, as ``gated_residual_`` does), optionally quantised per row for an fp8 linear
(``fp8_linear.quantize_rows``) instead of written. The residual and the modulated values are rounded to the
rows' dtype where the two-step path stores them; the row's norm is summed in fp32 in another order than
torch's reduction, so a result may differ from the compiled form's by one rounding where it sits on a
boundary.

``swiglu``: the FFN's ``silu(gate) · up`` from ``fc1``'s output ``[T, 2·ffn]``, written into its gate half
(``block_fused.swiglu_``) by one pass over tiles of rows × columns, each element read once and the product
rounded once; torch.compile splits that in-place write into the product in a buffer of its own and a copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_triton import chunk_launch, code_buffers, row_scale


@triton.jit
def _rotation(weight, cos, sin, rows, cols, row_ok, n_rot):
    """Rotate-half RoPE on the first ``n_rot`` channels: each column's partner and sign, the partners' norm
    weights, the rows' cos and sin (1 and 0 beyond ``n_rot``) and the mask of the rotated tile."""
    half = n_rot // 2
    rotated = cols < n_rot
    partner = tl.where(cols < half, cols + half, cols - half)
    sign = tl.where(cols < half, -1.0, 1.0)
    pmask = row_ok[:, None] & rotated[None, :]
    wp = tl.load(weight + partner, mask=rotated, other=0.0).to(tl.float32)
    c = tl.load(cos + rows[:, None] * n_rot + cols[None, :], mask=pmask, other=1.0)
    s = tl.load(sin + rows[:, None] * n_rot + cols[None, :], mask=pmask, other=0.0)
    return partner, sign, pmask, wp, c, s


@triton.jit
def _qk_norm_rope_kernel(
    src,
    dst,
    weight,
    cos,
    sin,
    n_rows,
    heads,
    heads_per_program,
    n_rot,
    s_row,
    s_head,
    eps,
    HEAD_DIM: tl.constexpr,
    ROTATE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # a tile of rows through ``heads_per_program`` heads: its cos, sin and weights are read once for them all
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    first = tl.program_id(1) * heads_per_program
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < HEAD_DIM)[None, :]
    w = tl.load(weight + cols, mask=cols < HEAD_DIM, other=0.0).to(tl.float32)
    if ROTATE:
        partner, sign, pmask, wp, c, s = _rotation(weight, cos, sin, rows, cols, row_ok, n_rot)
    for head in range(first, tl.minimum(first + heads_per_program, heads)):
        base = src + rows[:, None] * s_row + head * s_head
        x = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        h = x * inv * w[None, :]
        if ROTATE:
            xp = tl.load(base + partner[None, :], mask=pmask, other=0.0).to(tl.float32)
            h = h * c + sign[None, :] * (xp * inv * wp[None, :]) * s
        out = dst + rows[:, None] * (heads * HEAD_DIM) + head * HEAD_DIM + cols[None, :]
        tl.store(out, h.to(dst.dtype.element_ty), mask=mask)


def qk_norm_rope_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
    per_head: bool = False,
    block_t: int | None = None,
    warps: int = 4,
) -> torch.Tensor:
    """``[T, H, D]`` contiguous from ``x`` ``[T, H, D]`` with a contiguous last dimension (any row and head
    strides: a slice of the fused projection), ``cos``/``sin`` fp32 ``[T, n]`` or None. ``per_head``,
    ``block_t`` (rows per tile) and ``warps`` choose the launch; the numbers do not depend on them."""
    rows, heads, head_dim = x.shape
    assert x.stride(2) == 1
    out = torch.empty(rows, heads, head_dim, dtype=x.dtype, device=x.device)
    rotate = cos is not None
    if rotate:
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
    n_rot = cos.shape[-1] if rotate else 0
    block_d = triton.next_power_of_2(head_dim)
    # tiles of 2,048 elements per head, or of 1,024 through every head (the faster launches on an H200,
    # bench/results/kernel_launches.json)
    block_t = block_t or max(1, (2048 if per_head else 1024) // block_d)
    if not out.numel():
        return out
    heads_per_program = 1 if per_head else heads
    _qk_norm_rope_kernel[(triton.cdiv(rows, block_t), triton.cdiv(heads, heads_per_program))](
        x,
        out,
        weight,
        cos if rotate else x,
        sin if rotate else x,
        rows,
        heads,
        heads_per_program,
        n_rot,
        x.stride(0),
        x.stride(1),
        eps,
        HEAD_DIM=head_dim,
        ROTATE=rotate,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        num_warps=warps,
    )
    return out


@triton.jit
def _row_chunk(x, y, gate, row, entry, hidden, start, cols, RESIDUAL: tl.constexpr):
    """Columns ``start + cols`` of the row to norm (fp32) and their mask: ``x``'s, or with ``RESIDUAL`` the gated
    residual ``x + gate[entry] · y`` rounded to the rows' dtype."""
    mask = start + cols < hidden
    v = tl.load(x + row * hidden + start + cols, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        b = tl.load(y + row * hidden + start + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gate + entry * hidden + start + cols, mask=mask, other=0.0).to(tl.float32)
        v = (v + b * g).to(x.dtype.element_ty).to(tl.float32)
    return v, mask


@triton.jit
def _modulate(v, weight, shift, scale, entry, hidden, inv, start, cols, mask, dtype: tl.constexpr):
    """The chunk normed (``inv`` = the row's 1/RMS) and modulated by its table row, rounded to ``dtype`` (fp32)."""
    w = tl.load(weight + start + cols, mask=mask, other=0.0).to(tl.float32)
    sh = tl.load(shift + entry * hidden + start + cols, mask=mask, other=0.0).to(tl.float32)
    sc = tl.load(scale + entry * hidden + start + cols, mask=mask, other=0.0).to(tl.float32)
    return (v * inv * w * (1 + sc) + sh).to(dtype).to(tl.float32)


@triton.jit
def _block_norm_kernel(
    x,
    y,
    gate,
    weight,
    shift,
    scale,
    table_rows,
    out,
    scales,
    hidden,
    eps,
    smallest,
    BLOCK_K: tl.constexpr,
    RESIDUAL: tl.constexpr,
    QUANTIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    entry = tl.load(table_rows + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    dtype = x.dtype.element_ty
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for start in range(0, hidden, BLOCK_K):
        v, mask = _row_chunk(x, y, gate, row, entry, hidden, start, cols, RESIDUAL)
        squares += v * v
    inv = tl.rsqrt(tl.sum(squares, axis=0) / hidden + eps)
    q_scale = 1.0
    if QUANTIZE:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for start in range(0, hidden, BLOCK_K):
            v, mask = _row_chunk(x, y, gate, row, entry, hidden, start, cols, RESIDUAL)
            amax = tl.maximum(
                amax, tl.abs(_modulate(v, weight, shift, scale, entry, hidden, inv, start, cols, mask, dtype))
            )
        q_scale = row_scale(amax, smallest)
        tl.store(scales + row, q_scale)
    for start in range(0, hidden, BLOCK_K):
        v, mask = _row_chunk(x, y, gate, row, entry, hidden, start, cols, RESIDUAL)
        h = _modulate(v, weight, shift, scale, entry, hidden, inv, start, cols, mask, dtype)
        if RESIDUAL:  # each element of y read above before it is overwritten here
            tl.store(y + row * hidden + start + cols, v.to(dtype), mask=mask)
        if QUANTIZE:
            h = tl.div_rn(h, q_scale)
        tl.store(out + row * hidden + start + cols, h.to(out.dtype.element_ty), mask=mask)


def block_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    table_rows: torch.Tensor,
    eps: float,
    y: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    smallest: float | None = None,
    codes_dtype: torch.dtype = torch.float8_e4m3fn,
    block_k: int | None = None,
    warps: int | None = None,
):
    """``block_fused.norm_modulate(x, weight, shift, scale, table_rows, eps)`` in one pass per row: ``x``
    ``[T, hidden]``, the tables ``shift`` / ``scale`` ``[R, hidden]``, ``table_rows`` ``[T]`` each
    row's table row. With ``y`` and ``gate`` (``[T, hidden]`` contiguous, ``[R, hidden]``) the rows normed are
    ``gated_residual_(x, y, gate, table_rows)``'s, written into ``y``; with ``smallest`` the modulated rows
    are returned quantised, e4m3 codes ``[T, hidden]`` and fp32 scales ``[T, 1]`` (``codes_dtype=float32``
    keeps the quotients, for Triton's CPU interpreter), instead of as ``[T, hidden]`` rows in ``x``'s dtype.
    ``block_k`` and ``warps`` choose the launch."""
    rows, hidden = x.shape
    assert y is None or (y.is_contiguous() and y.shape == x.shape and gate is not None)
    x = x.contiguous()
    quantize = smallest is not None
    if quantize:
        out, scales = code_buffers(rows, hidden, codes_dtype, x.device)
    else:
        out = scales = torch.empty_like(x)
    if rows:
        block_k, warps = chunk_launch(hidden, block_k, warps)
        residual = y is not None
        _block_norm_kernel[(rows,)](
            x,
            y if residual else x,
            gate.contiguous() if residual else x,
            weight.contiguous(),
            shift.contiguous(),
            scale.contiguous(),
            table_rows.contiguous(),
            out,
            scales,
            hidden,
            eps,
            smallest or 0.0,
            BLOCK_K=block_k,
            RESIDUAL=residual,
            QUANTIZE=quantize,
            num_warps=warps,
        )
    return (out, scales) if quantize else out


@triton.jit
def _swiglu_kernel(gate_up, n_rows, ffn, s_row, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    mask = (rows < n_rows) & (cols < ffn)
    gate_at = gate_up + rows * s_row + cols
    gate = tl.load(gate_at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_at + ffn, mask=mask, other=0.0).to(tl.float32)
    tl.store(gate_at, (gate * tl.sigmoid(gate) * up).to(gate_up.dtype.element_ty), mask=mask)


def swiglu_triton(gate_up: torch.Tensor, block_r: int = 4, block_c: int = 1024, warps: int = 4) -> torch.Tensor:
    """``block_fused.swiglu_(gate_up)``: ``gate_up`` ``[T, 2·ffn]`` (contiguous columns, any row stride), the
    product written into its gate half, whose ``[T, ffn]`` view is returned. ``block_r`` rows × ``block_c``
    columns a program and ``warps`` choose the launch (the H200's table in ``bench/results/dit_block.md``)."""
    rows, width = gate_up.shape
    ffn = width // 2
    assert gate_up.stride(1) == 1 and width == 2 * ffn
    if rows and ffn:
        # rows on the grid's first axis: the others stop at 65,535 programs
        grid = (triton.cdiv(rows, block_r), triton.cdiv(ffn, block_c))
        _swiglu_kernel[grid](gate_up, rows, ffn, gate_up.stride(0), BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return gate_up[:, :ffn]


@triton.jit
def _gated_residual_kernel(
    x, y, gate, table_rows, n_rows, hidden, s_xr, s_xc, s_yr, s_yc, s_gr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)[None, :]
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < hidden)
    table = tl.load(table_rows + rows, mask=row_ok, other=0).to(tl.int64)[:, None]
    rows = rows[:, None]
    xv = tl.load(x + rows * s_xr + cols * s_xc, mask=mask, other=0.0).to(tl.float32)
    y_at = y + rows * s_yr + cols * s_yc
    yv = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
    gv = tl.load(gate + table * s_gr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_at, (xv + yv * gv).to(y.dtype.element_ty), mask=mask)


def gated_residual_triton(
    x: torch.Tensor,
    y: torch.Tensor,
    gate: torch.Tensor,
    table_rows: torch.Tensor,
    block_r: int = 4,
    block_c: int = 1024,
    warps: int = 4,
) -> torch.Tensor:
    """``block_fused.gated_residual_(x, y, gate, table_rows)``: ``x + gate[table_rows] · y`` in fp32 for rows
    ``x`` and ``y`` ``[T, hidden]`` (any strides), the gate table ``[R, hidden]``, rounded once and written into
    ``y``'s storage, which is returned. ``block_r`` rows × ``block_c`` columns a program and ``warps`` choose the
    launch."""
    rows, hidden = y.shape
    assert x.shape == y.shape and gate.shape[-1] == hidden and table_rows.shape == (rows,)
    gate = gate.contiguous()
    if rows and hidden:
        grid = (triton.cdiv(rows, block_r), triton.cdiv(hidden, block_c))
        _gated_residual_kernel[grid](
            x,
            y,
            gate,
            table_rows.contiguous(),
            rows,
            hidden,
            *x.stride(),
            *y.stride(),
            gate.stride(0),
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            num_warps=warps,
        )
    return y


@triton.jit
def _gate_heads_kernel(
    x, gate, n_rows, heads, d, s_xr, s_xh, s_xd, s_gr, s_gh, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    head = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_D).to(tl.int64)[None, :]
    row_ok = rows < n_rows
    mask = row_ok & (cols < d)
    gv = tl.load(gate + rows * s_gr + head * s_gh, mask=row_ok, other=0.0).to(tl.float32)
    x_at = x + rows * s_xr + head * s_xh + cols * s_xd
    xv = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_at, (xv * gv).to(x.dtype.element_ty), mask=mask)


def gate_heads_triton(x: torch.Tensor, gate: torch.Tensor, block_r: int = 16, warps: int = 4) -> torch.Tensor:
    """``block_fused.gate_heads_(x, gate)``: ``x`` ``[T, h, d]`` (any strides) times its per-head ``gate``
    ``[T, h]`` in fp32, rounded once and written in place; ``x`` is returned. A program takes ``block_r`` rows of
    one head."""
    rows, heads, d = x.shape
    assert gate.shape == (rows, heads)
    if rows and heads and d:
        grid = (triton.cdiv(rows, block_r), heads)
        _gate_heads_kernel[grid](
            x,
            gate,
            rows,
            heads,
            d,
            *x.stride(),
            *gate.stride(),
            BLOCK_R=block_r,
            BLOCK_D=triton.next_power_of_2(d),
            num_warps=warps,
        )
    return x
