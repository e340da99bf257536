"""``scale_convert`` as one Triton pass over [N, H, D] rows (see convert.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _convert_kernel(
    src,
    dst,
    scale,
    gate,
    n_rows,
    head_dim,
    s_sn,
    s_sh,
    s_dn,
    s_dh,
    s_gn,
    s_gh,
    limit,
    HAS_SCALE: tl.constexpr,
    HAS_GATE: tl.constexpr,
    SATURATE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    head = tl.program_id(1)
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < head_dim)[None, :]
    x = tl.load(src + (rows * s_sn + head * s_sh)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        x = x * tl.load(scale)
    if HAS_GATE:
        x = x * tl.load(gate + rows * s_gn + head * s_gh, mask=rows < n_rows, other=0.0).to(tl.float32)[:, None]
    if SATURATE:
        x = tl.minimum(tl.maximum(x, -limit), limit)
    tl.store(dst + (rows * s_dn + head * s_dh)[:, None] + cols[None, :], x.to(dst.dtype.element_ty), mask=mask)


def scale_convert_triton(src, dst, scale=None, saturate=False, gate=None) -> torch.Tensor:
    n_rows, heads, head_dim = dst.shape
    assert src.shape == dst.shape and src.stride(-1) == 1 and dst.stride(-1) == 1
    assert gate is None or gate.shape == (n_rows, heads)
    block_d = triton.next_power_of_2(head_dim)
    block_n = max(1, 4096 // block_d)
    grid = (triton.cdiv(n_rows, block_n), heads)
    _convert_kernel[grid](
        src,
        dst,
        scale if scale is not None else src,
        gate if gate is not None else src,
        n_rows,
        head_dim,
        src.stride(0),
        src.stride(1),
        dst.stride(0),
        dst.stride(1),
        *(gate.stride() if gate is not None else (0, 0)),
        float(torch.finfo(dst.dtype).max) if saturate else 0.0,
        HAS_SCALE=scale is not None,
        HAS_GATE=gate is not None,
        SATURATE=saturate,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    return dst
