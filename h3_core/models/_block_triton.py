"""``block_fused.qk_norm_rope`` as one Triton pass (see block_fused.py): each tile of rows is read once (its
rotation partners again, from cache), normed, rotated and written, where the compiled form splits into a
reduction kernel and a pointwise one that reads the rows again. Each program takes a tile of rows through
every head, so the rows' cos and sin are read once, not once per head (``per_head=True`` launches a program
per tile and head instead).

The arithmetic is the written function's: fp32 throughout, one rounding of the result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
def _qk_norm_rope_kernel(src, dst, weight, cos, sin, n_rows, heads, heads_per_program, n_rot, s_row, s_head, eps,
                         HEAD_DIM: tl.constexpr, ROTATE: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_D: tl.constexpr):
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


def qk_norm_rope_triton(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                        eps: float, per_head: bool = False, block_t: int | None = None,
                        warps: int = 4) -> torch.Tensor:
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
        x, out, weight, cos if rotate else x, sin if rotate else x, rows, heads, heads_per_program, n_rot,
        x.stride(0), x.stride(1), eps, HEAD_DIM=head_dim, ROTATE=rotate, BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=warps)
    return out
