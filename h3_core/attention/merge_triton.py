"""The log-sum-exp merge as one Triton pass: read both partial outputs once, write the result once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(
    o_a,
    o_b,
    out,
    lse_a,
    lse_b,
    n_rows,
    group_rows,
    head_dim,
    s_ag,
    s_an,
    s_ah,
    s_bg,
    s_bn,
    s_bh,
    s_og,
    s_on,
    s_oh,
    s_lag,
    s_lan,
    s_lah,
    s_lbg,
    s_lbn,
    s_lbh,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    head = tl.program_id(1)
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    group = rows // group_rows
    row = rows - group * group_rows
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < head_dim)[None, :]
    la = tl.load(lse_a + group * s_lag + row * s_lan + head * s_lah, mask=row_ok, other=0.0).to(tl.float32)
    lb = tl.load(lse_b + group * s_lbg + row * s_lbn + head * s_lbh, mask=row_ok, other=0.0).to(tl.float32)
    weight_a = tl.sigmoid(la - lb)[:, None]
    a_rows = (group * s_ag + row * s_an + head * s_ah)[:, None]
    b_rows = (group * s_bg + row * s_bn + head * s_bh)[:, None]
    o_rows = (group * s_og + row * s_on + head * s_oh)[:, None]
    xa = tl.load(o_a + a_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xb = tl.load(o_b + b_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = xb + weight_a * (xa - xb)
    tl.store(out + o_rows + cols[None, :], y.to(out.dtype.element_ty), mask=mask)


def _grouped(x: torch.Tensor, rank: int) -> torch.Tensor:
    return x.unsqueeze(0) if x.dim() == rank - 1 else x


def merge_partials_triton(o_a, lse_a, o_b, lse_b, out) -> torch.Tensor:
    o_a, o_b, out4 = (_grouped(t, 4) for t in (o_a, o_b, out))
    lse_a, lse_b = (_grouped(t, 3) for t in (lse_a, lse_b))
    groups, group_rows, heads, head_dim = out4.shape
    for t in (o_a, o_b):
        assert t.shape == out4.shape and t.stride(-1) == 1
    assert out4.stride(-1) == 1 and lse_a.shape == lse_b.shape == out4.shape[:3]
    block_d = triton.next_power_of_2(head_dim)
    block_n = max(1, 4096 // block_d)
    n_rows = groups * group_rows
    grid = (triton.cdiv(n_rows, block_n), heads)
    _merge_kernel[grid](
        o_a,
        o_b,
        out4,
        lse_a,
        lse_b,
        n_rows,
        group_rows,
        head_dim,
        *o_a.stride()[:3],
        *o_b.stride()[:3],
        *out4.stride()[:3],
        *lse_a.stride(),
        *lse_b.stride(),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    return out
