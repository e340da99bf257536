"""The fp8 linears' row quantisers in Triton (see fp8_linear.py), each one pass per row where the eager form
reads the row twice and runs its division as a generic (unvectorised) mixed-dtype kernel:

* ``quantize_rows_triton``: rows as they are;
* ``gate_heads_quantize_triton``: ``out_proj``'s input, the window softmax's output times its per-head gate,
  never stored gated;
* ``swiglu_quantize_triton``: ``fc2``'s input, SiLU·up straight from ``fc1``'s output, never stored.

The first two (and the block's norms, ``models._block_triton``) read their row in chunks of a power of two
columns, again for each pass over it (the amax, then the codes; later reads come from cache), since a row held
whole, padded to the next power of two, leaves up to a third of its lanes idle. The SwiGLU one holds its row
whole, which was faster there (``bench/results/dit_block.md``).

Same numbers as the eager reference: the amax is exact, the scale is ``amax / 448`` and the codes ``x / scale``
with IEEE-rounded divisions (as torch's CUDA kernels divide), and the cast to e4m3 rounds to nearest even
(the values never exceed 448 by more than the cast rounds away, so its saturation never acts). A product
(gate, SiLU·up) is rounded to the rows' dtype before it is quantised, as the two-step path
stores it. ``codes_dtype=torch.float32`` keeps the quotients before the cast (Triton's CPU interpreter
emulates the e4m3 cast wrongly, so its tests stop there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def row_scale(amax, smallest):
    """A row's scale ``max(amax / 448, smallest)`` (fp32, an IEEE division) from its lanes' largest |x|."""
    return tl.maximum(tl.div_rn(tl.max(amax, axis=0), 448.0), smallest)


@triton.jit
def quantize_row(x, smallest):
    """One row's quotients ``x / scale`` and its ``row_scale``, for kernels that hold the row in registers (masked
    lanes hold 0)."""
    scale = row_scale(tl.abs(x), smallest)
    return tl.div_rn(x, scale), scale


@triton.jit
def _gated_chunk(src, gate, row, s_row, s_gate, n_cols, head_dim, start, cols, GATED: tl.constexpr):
    """Columns ``start + cols`` of the row (fp32) and their mask; with ``GATED`` times the gate of their head."""
    mask = start + cols < n_cols
    x = tl.load(src + row * s_row + start + cols, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        g = tl.load(gate + row * s_gate + (start + cols) // head_dim, mask=mask, other=0.0).to(tl.float32)
        x = (x * g).to(src.dtype.element_ty).to(tl.float32)
    return x, mask


@triton.jit
def _quantize_chunked_kernel(
    src, gate, codes, scales, n_cols, s_row, s_gate, head_dim, smallest, BLOCK_K: tl.constexpr, GATED: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_K):
        x, mask = _gated_chunk(src, gate, row, s_row, s_gate, n_cols, head_dim, start, cols, GATED)
        amax = tl.maximum(amax, tl.abs(x))
    scale = row_scale(amax, smallest)
    for start in range(0, n_cols, BLOCK_K):
        x, mask = _gated_chunk(src, gate, row, s_row, s_gate, n_cols, head_dim, start, cols, GATED)
        tl.store(codes + row * n_cols + start + cols, tl.div_rn(x, scale).to(codes.dtype.element_ty), mask=mask)
    tl.store(scales + row, scale)


def chunk_launch(cols: int, block_k: int | None, warps: int | None) -> tuple[int, int]:
    """Chunk width and warps for rows of ``cols`` columns: the fastest measured at the model's widths (5,376,
    7,168 and 14,336 columns; ``bench/results/dit_block.md``)."""
    auto_k, auto_warps = (512, 4) if cols <= 6144 else (1024, 4) if cols <= 8192 else (2048, 8)
    return min(block_k or auto_k, triton.next_power_of_2(max(cols, 1))), warps or auto_warps


def code_buffers(rows: int, cols: int, codes_dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs of a row quantiser: codes ``[rows, cols]`` and fp32 scales ``[rows, 1]``, both contiguous."""
    return (
        torch.empty(rows, cols, dtype=codes_dtype, device=device),
        torch.empty(rows, 1, dtype=torch.float32, device=device),
    )


def quantize_rows_triton(
    x: torch.Tensor,
    smallest: float,
    codes_dtype: torch.dtype = torch.float8_e4m3fn,
    block_k: int | None = None,
    warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[M, K]`` e4m3 (contiguous) and scales ``[M, 1]`` fp32 for rows ``x`` ``[M, K]`` whose last
    dimension is contiguous (any row stride). ``block_k`` and ``warps`` choose the launch, not the numbers."""
    rows, cols = x.shape
    assert x.stride(1) == 1 or cols == 1
    codes, scales = code_buffers(rows, cols, codes_dtype, x.device)
    if rows:
        block_k, warps = chunk_launch(cols, block_k, warps)
        _quantize_chunked_kernel[(rows,)](
            x, x, codes, scales, cols, x.stride(0), 0, 1, smallest, BLOCK_K=block_k, GATED=False, num_warps=warps
        )
    return codes, scales


def gate_heads_quantize_triton(
    soft: torch.Tensor,
    gate: torch.Tensor,
    smallest: float,
    codes_dtype: torch.dtype = torch.float8_e4m3fn,
    block_k: int | None = None,
    warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(block_fused.gate_heads_(soft, gate).reshape(T, -1))`` without writing the gated rows:
    ``soft`` ``[T, h, d]`` (heads and channels contiguous, any row stride) times ``gate`` ``[T, h]`` (contiguous
    heads, any row stride). Returns codes ``[T, h·d]`` and fp32 scales ``[T, 1]``."""
    rows, heads, head_dim = soft.shape
    assert soft.stride(2) == 1 and soft.stride(1) == head_dim and gate.shape == (rows, heads)
    if gate.stride(1) != 1:
        gate = gate.contiguous()
    cols = heads * head_dim
    codes, scales = code_buffers(rows, cols, codes_dtype, soft.device)
    if rows:
        block_k, warps = chunk_launch(cols, block_k, warps)
        _quantize_chunked_kernel[(rows,)](
            soft,
            gate,
            codes,
            scales,
            cols,
            soft.stride(0),
            gate.stride(0),
            head_dim,
            smallest,
            BLOCK_K=block_k,
            GATED=True,
            num_warps=warps,
        )
    return codes, scales


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


def swiglu_quantize_triton(
    gate_up: torch.Tensor, smallest: float, codes_dtype: torch.dtype = torch.float8_e4m3fn, warps: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(block_fused.swiglu_(gate_up))`` in one pass: ``fc1``'s output ``[M, 2·ffn]`` (gate | up)
    read once, the product rounded to its dtype as the two-step path stores it, quantised per row, and neither
    the product nor a second read of it ever made. ``codes_dtype=torch.float32`` keeps the quotients (for
    Triton's CPU interpreter, whose e4m3 cast is not the GPU's)."""
    rows, width = gate_up.shape
    ffn = width // 2
    assert gate_up.stride(1) == 1
    codes, scales = code_buffers(rows, ffn, codes_dtype, gate_up.device)
    if rows:
        block = triton.next_power_of_2(ffn)
        _swiglu_quantize_kernel[(rows,)](
            gate_up,
            codes,
            scales,
            ffn,
            gate_up.stride(0),
            smallest,
            BLOCK=block,
            num_warps=warps or (32 if block > 8192 else 8),
        )
    return codes, scales
