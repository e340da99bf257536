"""A DiT block's per-element work in few passes: the plain block (``RunOptions.blocks_fused`` None) is the
reference.

The plain block runs every step as its own PyTorch op over ``[T, hidden]`` or ``[T, H, D]`` rows: the RMSNorm,
then the AdaLN modulation run by run, the per-head q/k RMSNorm, RoPE as slices, a negation, two
concatenations and three products, the gated residual, the hybrid attention's softmax gate and the FFN's
SiLU and product. Here each of those chains is one function — ``norm_modulate``, ``qk_norm_rope``,
``gated_residual_``, ``gate_heads_``, ``swiglu_`` — with the sums in fp32 (fp64 for fp64 inputs) and
one rounding of the result; the AdaLN rows are looked up per packed row from its table index.

Modes (``RunOptions.blocks_fused``): ``"compiled"`` runs these functions (and the linear branch's, ``branch_fused``)
through ``torch.compile`` or a hand-written Triton kernel, and inside ``triton_forms.plain_path`` as written (the
same arithmetic op by op); ``None`` the plain path.

A compiled function or Triton kernel that fails to compile or launch raises ``CompileFailure``; the evaluation —
which writes in place only into tensors it made itself, never into its inputs — runs again from its inputs on the
plain path (``run_options.Evaluations``), and the model stays there from then on (its ``compiled_form``).
"""

from __future__ import annotations

import logging

import torch

from ..triton_forms import runs_here, triton_form
from . import branch_fused
from .fp8_linear import _COMPUTE_DTYPES, _SMALLEST_SCALE, QuantizedRows, quantize_input

try:  # Triton is optional: without it the plain forms run
    from . import block_triton
except ImportError:
    block_triton = None
try:  # Triton is optional: without it the plain forms run
    from . import fp8_triton
except ImportError:
    fp8_triton = None

__all__ = [
    "norm_modulate",
    "qk_norm_rope",
    "gated_residual_",
    "gate_heads_",
    "swiglu_",
    "swiglu_quantized",
    "norm_modulate_quantized",
    "residual_norm",
    "gate_heads_input",
    "row_index",
    "run",
]

log = logging.getLogger(__name__)


def row_index(runs, device) -> torch.Tensor:
    """Each packed row's AdaLN table row ``[T]`` from the runs ``(start, stop, row)``."""
    rows = torch.tensor([row for _, _, row in runs], dtype=torch.long)
    lengths = torch.tensor([stop - start for start, stop, _ in runs], dtype=torch.long)
    return torch.repeat_interleave(rows, lengths).to(device, non_blocking=True)


def norm_modulate(x, weight, shift, scale, rows, eps: float):
    """``RMSNorm(x) · (1 + scale[row]) + shift[row]`` for rows ``x`` ``[T, hidden]``, tables ``[R, hidden]``."""
    acc = branch_fused.accumulation(x.dtype)
    h = x.to(acc)
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * weight.to(acc)
    return (h * (1 + scale.to(acc)[rows]) + shift.to(acc)[rows]).to(x.dtype)


def qk_norm_rope(x, weight, cos, sin, eps: float):
    """Per-head RMSNorm of ``x`` ``[T, H, D]`` then rotate-half RoPE on its first ``cos.shape[-1]`` channels
    (``cos``/``sin`` ``[T, n]``, fp32); ``cos`` None skips the rotation."""
    acc = branch_fused.accumulation(x.dtype)
    h = x.to(acc)
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * weight.to(acc)
    if cos is None:
        return h.to(x.dtype)
    n = cos.shape[-1]
    half = n // 2
    rot, rest = h[..., :n], h[..., n:]
    turned = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    c, s = cos.to(acc)[:, None], sin.to(acc)[:, None]
    return torch.cat([rot * c + turned * s, rest], dim=-1).to(x.dtype)


def gated_residual_(x, y, gate, rows):
    """``x + gate[row] · y`` written into ``y``'s storage, which is returned."""
    acc = branch_fused.accumulation(y.dtype)
    return y.copy_(x.to(acc) + y.to(acc) * gate.to(acc)[rows])


def gate_heads_(x, gate):
    """``x`` ``[T, h, d]`` times its per-head ``gate`` ``[T, h]``, in place (the softmax gate)."""
    acc = branch_fused.accumulation(x.dtype)
    return x.copy_(x.to(acc) * gate.to(acc)[..., None])


def swiglu_(gate_up):
    """``silu(gate) · up`` from ``fc1``'s output ``[T, 2·ffn]`` (gate | up), written into the gate half, whose
    ``[T, ffn]`` view (row stride 2·ffn) is returned: no further ``[T, ffn]`` buffer, as the plain path."""
    gate, up = gate_up.chunk(2, dim=-1)
    acc = branch_fused.accumulation(gate_up.dtype)
    return gate.copy_(torch.nn.functional.silu(gate.to(acc)) * up.to(acc))


def swiglu_quantized(mode: str, gate_up: torch.Tensor) -> QuantizedRows:
    """An fp8 ``fc2``'s input from ``fc1``'s output ``[T, 2·ffn]``: ``quantize_input(swiglu_(gate_up))``, run
    as ``mode`` says — on CUDA in ``"compiled"`` mode as one Triton pass per row
    (``_fp8_triton.swiglu_quantize_triton``, the same codes) that never stores the product nor reads it back."""
    kernel = _quantiser(mode, gate_up, "swiglu_quantize_triton")
    if kernel is not None and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        codes, scale = kernel(gate_up, _SMALLEST_SCALE)
        return QuantizedRows(codes, scale, (gate_up.shape[0],))
    return quantize_input(run(mode, "swiglu_", gate_up))


def _kernel(mode: str | None, rows: torch.Tensor, module, name: str):
    """The hand-written Triton kernel ``name`` of ``module`` where ``mode`` runs it on ``rows`` (``"compiled"``,
    CUDA, a half or fp32 dtype); None where the written or compiled steps run instead."""
    if mode == "compiled" and runs_here(rows) and rows.dtype in _COMPUTE_DTYPES:
        return triton_form(module, name, rows.device)
    return None


def _quantiser(mode: str | None, rows: torch.Tensor, name: str):
    """``_kernel`` for the fp8 quantiser ``name`` of ``fp8_triton``."""
    return _kernel(mode, rows, fp8_triton, name)


def norm_modulate_quantized(mode: str, x, weight, shift, scale, rows, eps: float) -> QuantizedRows:
    """An fp8 linear's input: ``quantize_input(norm_modulate(...))``, on CUDA in ``"compiled"`` mode one Triton
    pass per row (``_block_triton.block_norm_triton``) that never stores the modulated rows."""
    kernel = _block_norm(mode, x)
    if kernel is not None:
        codes, row_scale = kernel(x, weight, shift, scale, rows, eps, smallest=_SMALLEST_SCALE)
        return QuantizedRows(codes, row_scale, (x.shape[0],))
    return quantize_input(run(mode, "norm_modulate", x, weight, shift, scale, rows, eps))


def residual_norm(mode: str, x, y, gate, rows, weight, shift, scale, eps: float, quantized: bool):
    """The block's residual after its attention and the FFN's input from it: ``gated_residual_(x, y, gate,
    rows)`` — written into ``y``, returned first — and ``norm_modulate`` of it (``weight``, ``shift``,
    ``scale``, ``eps``), quantised per row when ``quantized`` (an fp8 ``fc1``). On CUDA in ``"compiled"`` mode
    one Triton pass per row (``_block_triton.block_norm_triton``), where the two steps write the residual and
    read it back."""
    kernel = _block_norm(mode, x)
    if kernel is not None and y.is_contiguous():
        if quantized:
            codes, row_scale = kernel(x, weight, shift, scale, rows, eps, y, gate, smallest=_SMALLEST_SCALE)
            return y, QuantizedRows(codes, row_scale, (x.shape[0],))
        return y, kernel(x, weight, shift, scale, rows, eps, y, gate)
    x = run(mode, "gated_residual_", x, y, gate, rows)
    if quantized:
        return x, norm_modulate_quantized(mode, x, weight, shift, scale, rows, eps)
    return x, run(mode, "norm_modulate", x, weight, shift, scale, rows, eps)


def _block_norm(mode: str, x: torch.Tensor):
    """``_kernel`` for ``_block_triton.block_norm_triton``, which takes contiguous ``[T, hidden]`` rows."""
    if x.dim() == 2 and x.is_contiguous():
        return _kernel(mode, x, block_triton, "block_norm_triton")
    return None


def gate_heads_input(mode: str, soft: torch.Tensor, gate: torch.Tensor, quantized: bool):
    """``out_proj``'s input ``[T, h·d]`` from the window softmax's output ``soft`` ``[T, h, d]`` and its per-head
    ``gate`` ``[T, h]``: ``gate_heads_`` (in place), or its rows quantised when ``quantized`` (an fp8
    ``out_proj``), on CUDA in ``"compiled"`` mode in one Triton pass (``_fp8_triton.gate_heads_quantize_triton``)
    that never writes the gated rows (the plain ops: ``block_ops.BlockOps.gate_heads_input``)."""
    T = soft.shape[0]
    kernel = _quantiser(mode, soft, "gate_heads_quantize_triton") if quantized else None
    if kernel is not None and soft.stride(-1) == 1 and soft.stride(-2) == soft.shape[-1]:
        codes, row_scale = kernel(soft, gate, _SMALLEST_SCALE)
        return QuantizedRows(codes, row_scale, (T,))
    gated = run(mode, "gate_heads_", soft, gate)
    return quantize_input(gated.reshape(T, -1)) if quantized else gated.reshape(T, -1)


_FUNCTIONS = {
    "norm_modulate": norm_modulate,
    "qk_norm_rope": qk_norm_rope,
    "gated_residual_": gated_residual_,
    "gate_heads_": gate_heads_,
    "swiglu_": swiglu_,
}


def run(mode: str, name: str, *args):
    """Call the block's fused function ``name`` as ``mode`` says (``branch_fused.call``: ``"compiled"`` runs
    each of them on CUDA as its own Triton kernel, so an evaluation there traces nothing with dynamo)."""
    return branch_fused.call(mode, _FUNCTIONS[name], *args, name=name)
