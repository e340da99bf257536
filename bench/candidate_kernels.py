"""Candidate forms timed beside the library's (``branch_stages.py``) before one is adopted.

``spatial_conv_slab``: the linear branch's depthwise 5×5 over each frame's grid (``branch_fused.spatial_conv``,
cuDNN: 2.6–2.7 ms a call at the release size, where reading and writing the tensor once takes ≈ 0.8 ms).
Each program takes a tile of a frame's tokens, flattened (no padding of the 42-token rows to a power of
two), by a few channels, and sums the 25 taps as shifted loads of the tile — a tap (dy, dx) is the token
offset dy·width + dx, masked where it leaves the grid — which after the first come from cache; the 25
weights of its channels are loaded once. Offsets are 32-bit. Two earlier forms lost to cuDNN: a program
per output row reading all 25 taps (6.6 ms a call) and one walking each frame's rows with five rolling
accumulators (5.2–9.2 ms; ``bench/results/dit_block.md``).

``spd_inverse_in_place``: ``linear_branch.spd_inverse`` (the solve's inverse by halves) with every level's
result written where it belongs in the output: the two half inverses by the recursion straight into the
diagonal blocks, the off-diagonal block by its GEMM (−X S⁻¹, the sign in the GEMM's α), the top-left
update P⁻¹ + Y Xᵀ and the Schur complement C − Rᵀ X as GEMMs that accumulate (β = 1) — where the library
form runs a separate add, subtraction or negation after each GEMM and copies four blocks into place per
level (the solve's ≈ 27 elementwise adds, 29 negations and 36 copies per block at the release size).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _spatial_conv_slab_kernel(src, weight, dst, grid_h, grid_w, channels, s_frame, s_token,
                              KSIZE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    half: tl.constexpr = KSIZE // 2
    frame = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    chans = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    n_tokens = grid_h * grid_w
    token_ok = tokens < n_tokens
    chan_ok = chans < channels
    row, col = tokens // grid_w, tokens % grid_w
    tile = src + frame * s_frame + tokens[:, None] * s_token + chans[None, :]
    acc = tl.zeros((BLOCK_S, BLOCK_C), dtype=tl.float32)
    for dy in tl.static_range(KSIZE):
        r = row + (dy - half)
        row_ok = token_ok & (r >= 0) & (r < grid_h)
        for dx in tl.static_range(KSIZE):
            c = col + (dx - half)
            ok = (row_ok & (c >= 0) & (c < grid_w))[:, None] & chan_ok[None, :]
            w = tl.load(weight + chans * (KSIZE * KSIZE) + dy * KSIZE + dx, mask=chan_ok, other=0.0).to(tl.float32)
            x = tl.load(tile + ((dy - half) * grid_w + (dx - half)) * s_token, mask=ok, other=0.0).to(tl.float32)
            acc += x * w[None, :]
    out = dst + (frame * n_tokens + tokens)[:, None] * channels + chans[None, :]
    tl.store(out, acc.to(dst.dtype.element_ty), mask=token_ok[:, None] & chan_ok[None, :])


def spatial_conv_slab(x: torch.Tensor, weight: torch.Tensor, grid, block_s: int = 256, block_c: int = 32,
                      warps: int = 4) -> torch.Tensor:
    """``branch_fused.spatial_conv`` for an odd square ``weight`` ``[C, 1, k, k]``: contiguous ``[F, S, C]`` from
    ``x`` ``[F, S, C]`` with a contiguous last dimension (any frame and token strides)."""
    frames, tokens, channels = x.shape
    grid_h, grid_w = grid
    ksize = weight.shape[-1]
    assert x.stride(2) == 1 and tokens == grid_h * grid_w and weight.shape[-2] == ksize and ksize % 2 == 1
    out = torch.empty(frames, tokens, channels, dtype=x.dtype, device=x.device)
    block_s = min(block_s, triton.next_power_of_2(tokens))
    block_c = min(block_c, triton.next_power_of_2(channels))
    if out.numel():
        _spatial_conv_slab_kernel[(frames, triton.cdiv(tokens, block_s), triton.cdiv(channels, block_c))](
            x, weight.reshape(channels, -1).contiguous(), out, grid_h, grid_w, channels, x.stride(0), x.stride(1),
            KSIZE=ksize, BLOCK_S=block_s, BLOCK_C=block_c, num_warps=warps)
    return out


def spd_inverse_in_place(M: torch.Tensor, base: int = 16, out: torch.Tensor | None = None) -> torch.Tensor:
    """``linear_branch.spd_inverse(M, base)`` written into ``out`` (a new ``[..., n, n]`` tensor by default, or
    a view of one whose batch dimensions flatten without a copy, as the recursion passes its diagonal blocks)."""
    n = M.shape[-1]
    if out is None:
        out = torch.empty(M.shape, dtype=M.dtype, device=M.device)
    if n <= base:
        return out.copy_(torch.linalg.inv_ex(M)[0])
    h = n // 2

    def batched(t):  # [..., h, h] as [B, h, h]; .view, so results written through it land in ``out``
        return t.view(-1, h, h)

    P, R, C = M[..., :h, :h], M[..., :h, h:], M[..., h:, h:]
    top_left, top_right = out[..., :h, :h], out[..., :h, h:]
    X = spd_inverse_in_place(P, base, top_left) @ R  # P⁻¹ R
    S = torch.baddbmm(C.reshape(-1, h, h), R.transpose(-1, -2).reshape(-1, h, h), batched(X), alpha=-1)  # C − Rᵀ X
    S_inv = spd_inverse_in_place(S.view(C.shape), base, out[..., h:, h:])
    neg_y = batched(top_right)
    torch.baddbmm(neg_y, batched(X), batched(S_inv), beta=0, alpha=-1, out=neg_y)  # −Y = −X S⁻¹
    batched(top_left).baddbmm_(neg_y, batched(X).transpose(-1, -2), alpha=-1)  # P⁻¹ + Y Xᵀ
    out[..., h:, :h] = top_right.transpose(-1, -2)
    return out
