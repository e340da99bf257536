"""Copying rows into another float dtype with a device-side scale, in one pass.

``scale_convert(src, dst, scale, saturate, gate)`` writes ``dst = cast(src · scale · gate)``, the
products taken in float32; ``scale`` is a float32 tensor of shape [1] on the device (so no host sync is
needed to pick it) or None; ``gate`` ``[N, H]`` (any strides) multiplies each row's head, or None;
``saturate`` clamps to the finite range of ``dst``'s dtype before the cast. Shapes: ``[N, H, D]`` with
any strides and a contiguous last dim. One fused Triton pass on CUDA; the eager version below is the
reference and the path everywhere else.
"""

from __future__ import annotations

import torch

from ..triton_forms import triton_form

try:  # Triton is optional: without it the plain forms run
    from . import convert_triton
except ImportError:
    convert_triton = None

__all__ = ["scale_convert", "scale_convert_reference"]


def scale_convert_reference(src, dst, scale=None, saturate=False, gate=None) -> torch.Tensor:
    x = src.float()
    if scale is not None:
        x = x * scale
    if gate is not None:
        x = x * gate.float()[..., None]
    if saturate:
        limit = torch.finfo(dst.dtype).max
        x = x.clamp(-limit, limit)
    dst.copy_(x)
    return dst


def scale_convert(src, dst, scale=None, saturate=False, gate=None) -> torch.Tensor:
    if dst.is_cuda and dst.dim() == 3 and src.shape == dst.shape and dst.numel():
        fused = triton_form(convert_triton, "scale_convert_triton", dst.device)
        if fused is not None:
            return fused(src, dst, scale, saturate, gate)
    return scale_convert_reference(src, dst, scale, saturate, gate)
