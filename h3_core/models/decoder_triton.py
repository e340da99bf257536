"""The video decoder's blocks with their per-element work as hand-written Triton passes (``video_vae``'s halves,
``block_attention_inputs`` and ``block_finish``, as the same two functions).

The GEMMs and the attention stay cuBLAS's and the attention kernel's; around them: the RMSNorm of the fp32 residual
stream cast to the weights' dtype (``residual_norm``, one pass a row), q and k normed per head and rotated (the DiT's
``block_triton.qk_norm_rope``, cos and sin widened to the rotated channels), the LayerScale residual formed on the way
to the next norm, the FFN's SiLU·up written into ``w1``'s output (``block_triton.swiglu``). Unlike ``torch.compile``
they need no tracing in a new process: Triton's cache holds the compiled kernels, so a restarted server decodes
without retracing (``bench/results/decoder_paths.md``). The sums run in fp32 with one rounding of each result, as the
compiled form's; the eager halves are the reference (``tests/unit/test_decoder_triton.py``).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .block_triton import qk_norm_rope_triton, swiglu_triton

__all__ = ["residual_norm_triton", "attention_inputs", "finish"]


@triton.jit
def _residual_norm_kernel(
    x,
    y,
    scale,
    weight,
    x_out,
    h_out,
    width,
    eps,
    RESIDUAL: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    v = tl.load(x + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        s = tl.load(scale + cols, mask=mask, other=0.0).to(tl.float32)
        v = v + tl.load(y + row * width + cols, mask=mask, other=0.0).to(tl.float32) * s
        tl.store(x_out + row * width + cols, v, mask=mask)
    if NORM:
        w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(v * v, axis=0) / width + eps)
        tl.store(h_out + row * width + cols, (v * inv * w).to(h_out.dtype.element_ty), mask=mask)


def residual_norm_triton(x, y=None, scale=None, weight=None, eps: float = 1e-5, dtype=torch.float16):
    """For fp32 rows ``x`` ``[N, D]`` (contiguous): ``x + y · scale`` when ``y`` is given (fp32, returned as the new
    stream) and its RMSNorm times ``weight`` in ``dtype`` when ``weight`` is given. Returns ``(stream, normed)``,
    either None where not asked."""
    rows, width = x.shape
    residual, norm = y is not None, weight is not None
    stream = torch.empty_like(x) if residual else x
    normed = torch.empty(rows, width, dtype=dtype, device=x.device) if norm else None
    if rows:
        _residual_norm_kernel[(rows,)](
            x,
            y if residual else x,
            scale if residual else x,
            weight if norm else x,
            stream,
            normed if norm else x,
            width,
            eps,
            RESIDUAL=residual,
            NORM=norm,
            BLOCK=triton.next_power_of_2(width),
            num_warps=8 if width >= 2048 else 4,
        )
    return (stream if residual else None), normed


# Every block of a tile batch rotates by the same cos and sin (``ViTDecoder3d.forward`` makes them once a batch and
# never changes them): their widened tables are made at the first block and kept, by the cos tensor's id, until
# that tensor is freed.
_tables_of: dict = {}
_ones: dict = {}  # (head_dim, device): the per-head norms' unit weight


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor, batch: int):
    """The decoder's ``[T, n/2]`` cos and sin as the rotation kernel reads them: fp32 ``[B·T, n]``, each row's
    angles for both halves of the rotated channels; the same tensors again for the same ``cos``, ``sin`` and
    ``batch``."""
    held = _tables_of.get(id(cos))
    if held is not None and held[0] is sin and held[1] == batch:
        return held[2]
    wide_cos, wide_sin = torch.cat([cos, cos], dim=-1).float(), torch.cat([sin, sin], dim=-1).float()
    tables = wide_cos.repeat(batch, 1), wide_sin.repeat(batch, 1)
    if held is None:
        weakref.finalize(cos, _tables_of.pop, id(cos), None)
    _tables_of[id(cos)] = (sin, batch, tables)
    return tables


def _unit_weight(head_dim: int, device) -> torch.Tensor:
    ones = _ones.get((head_dim, device))
    if ones is None:
        ones = _ones[(head_dim, device)] = torch.ones(head_dim, dtype=torch.float32, device=device)
    return ones


def attention_inputs(x, norm1_w, qkv_w, qkv_b, cos, sin, heads: int, head_dim: int, eps: float):
    """``video_vae.block_attention_inputs``: q, k, v ``[B, H, T, D]`` in the weights' dtype."""
    B, T, width = x.shape
    _, h = residual_norm_triton(x.reshape(B * T, width), weight=norm1_w, eps=eps, dtype=qkv_w.dtype)
    qkv = F.linear(h, qkv_w, qkv_b).view(B * T, heads, 3, head_dim)
    ones = _unit_weight(head_dim, x.device)  # the per-head norms are not affine
    c, s = _rope_tables(cos, sin, B)
    q, k = (qk_norm_rope_triton(qkv[:, :, i], ones, c, s, eps) for i in (0, 1))
    return tuple(t.reshape(B, T, heads, head_dim).transpose(1, 2) for t in (q, k, qkv[:, :, 2]))


def finish(x, attn, out_w, out_b, scale1, norm2_w, w1_w, w1_b, w2_w, w2_b, scale2, eps: float):
    """``video_vae.block_finish``: the fp32 stream after the output projection and the gated FFN."""
    B, H, T, D = attn.shape
    width = x.shape[-1]
    y = F.linear(attn.transpose(1, 2).reshape(B * T, H * D), out_w, out_b)
    stream, h = residual_norm_triton(x.reshape(B * T, width), y, scale1, norm2_w, eps, w1_w.dtype)
    product = swiglu_triton(F.linear(h, w1_w, w1_b))
    stream, _ = residual_norm_triton(stream, F.linear(product, w2_w, w2_b), scale2)
    return stream.view(B, T, width)
