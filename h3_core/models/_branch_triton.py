"""``branch_fused.conv_features`` as one Triton pass (see branch_fused.py): each program reads a tile of tokens
× one head's channels from the ``n`` frames around its frame, sums the temporal taps, applies SiLU, the L2
norm and √β, and writes the tile head-major. Loads and stores are rows of ``d`` contiguous channels in both
layouts, where the compiled form scatters its head-major writes.

The arithmetic is the written function's: fp32 sums over the taps in order, one rounding of the result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_features_kernel(src, taps, beta, dst, n_frames, n_tokens, heads, head_dim, eps,
                          N_TAPS: tl.constexpr, NORMALIZE: tl.constexpr, HAS_BETA: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    frame = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    tokens = (tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    channels = head * head_dim + cols
    token_ok = tokens < n_tokens
    col_ok = cols < head_dim
    mask = token_ok[:, None] & col_ok[None, :]
    width = heads * head_dim
    acc = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(N_TAPS):
        source = frame + j - N_TAPS // 2
        inside = (source >= 0) & (source < n_frames)
        x = tl.load(src + (source * n_tokens + tokens)[:, None] * width + channels[None, :], mask=mask & inside,
                    other=0.0).to(tl.float32)
        w = tl.load(taps + channels * N_TAPS + j, mask=col_ok, other=0.0).to(tl.float32)
        acc = acc + x * w[None, :]
    z = acc * tl.sigmoid(acc)
    if NORMALIZE:
        norm = tl.sqrt(tl.sum(z * z, axis=1))
        z = z / tl.maximum(norm, eps)[:, None]
    if HAS_BETA:
        b = tl.load(beta + (frame * n_tokens + tokens) * heads + head, mask=token_ok, other=0.0).to(tl.float32)
        z = z * tl.sqrt(b)[:, None]
    out = dst + ((frame * heads + head) * n_tokens + tokens)[:, None] * head_dim + cols[None, :]
    tl.store(out, z.to(dst.dtype.element_ty), mask=mask)


def conv_features_triton(y: torch.Tensor, taps: torch.Tensor, heads: int, normalize: bool,
                         beta: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """``[F, heads, S, d]`` from contiguous ``y`` ``[F, S, heads·d]``, ``taps`` ``[C, 1, n]`` and ``beta``
    ``[F, S, heads]`` or None (see ``branch_fused.conv_features``)."""
    frames, tokens, channels = y.shape
    head_dim = channels // heads
    y = y.contiguous()
    taps = taps.reshape(channels, -1).contiguous()
    out = torch.empty(frames, heads, tokens, head_dim, dtype=y.dtype, device=y.device)
    block_d = triton.next_power_of_2(head_dim)
    block_s = max(1, 4096 // block_d)
    if beta is not None:
        beta = beta.contiguous()
    if out.numel():
        _conv_features_kernel[(frames, heads, triton.cdiv(tokens, block_s))](
            y, taps, beta if beta is not None else y, out, frames, tokens, heads, head_dim, eps,
            N_TAPS=taps.shape[1], NORMALIZE=normalize, HAS_BETA=beta is not None, BLOCK_S=block_s,
            BLOCK_D=block_d)
    return out
