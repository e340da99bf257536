"""fp8-scaled checkpoints: their codes taken as they are for fp8 linears.

Reading an fp8-scaled file is one case of reading ComfyUI's quantised files (``h3_core.formats.quantized_files``):
ComfyUI's per-layer form stores ``<layer>.weight`` in float8 (e4m3fn or e5m2) with a ``<layer>.weight_scale``
(fp32, per tensor or per row), an optional ``<layer>.input_scale`` and a JSON ``<layer>.comfy_quant`` naming
the format; the older form marks the file with a ``scaled_fp8`` tensor and stores ``<layer>.scale_weight``
(and ``<layer>.scale_input``). Either way the dequantised weight is ``weight.float() · scale``; input scales
only matter to fp8 matmuls and are dropped. ``fp8_scaled_view`` is ``quantized_view`` under its older name, and
``Fp8ScaledView`` the view's class: the same view reads int8 and nvfp4 layers through comfy-kitchen.

For fp8 linears (``Fp8Linear``) the codes can instead be taken as they are: ``Fp8ScaledView.stored`` gives a
key's fp8 tensor and scale untouched, and ``layer_codes`` re-lays out a module weight's stored codes as its
key map's rule lays out the weight (official shards' per-head qkv interleave, diffusers' separate q, k, v and
``[up; gate]`` FFN halves), with the scales spread to one per output row, so that ``codes · scale[:, None]``
is bit for bit the weight the view would have dequantised. Where that cannot hold it says why, and the
caller dequantises and requantises that layer instead.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from .quantized_files import QuantizedView, quantized_view

__all__ = ["fp8_scaled_view", "FP8_FORMATS", "Fp8ScaledView", "LayerCodes", "layer_codes"]

FP8_FORMATS = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}

Fp8ScaledView = QuantizedView
fp8_scaled_view = quantized_view


class LayerCodes(NamedTuple):
    """One linear's weight as e4m3 ``codes`` ``[out, in]`` and fp32 ``scale`` ``[out]``, one per output row."""

    codes: torch.Tensor
    scale: torch.Tensor


def _row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor | None:
    """A stored scale as fp32 ``[rows]``: one value (per tensor) spread to every row, or one per row kept; None
    for any other shape (e.g. block-wise scales)."""
    if scale.numel() == 1:
        return scale.float().reshape(1).expand(rows)
    if tuple(scale.shape) in ((rows,), (rows, 1)):
        return scale.float().reshape(rows)
    return None


def _row_map(combine: Callable, rows: Sequence[int], out_rows: int) -> torch.Tensor | None:
    """Which stacked source row each output row of ``combine`` is, when ``combine`` only picks whole rows and
    keeps their columns in order (a re-layout of rows); None when it does anything else. Found by running it
    on a two-column probe holding each element's own index."""
    total = sum(rows)
    probe = torch.arange(2 * total, dtype=torch.int64).view(total, 2)
    try:
        out = combine(list(probe.split(list(rows))))
    except (RuntimeError, ValueError, IndexError, TypeError):
        return None
    if not isinstance(out, torch.Tensor) or out.dtype != torch.int64 or tuple(out.shape) != (out_rows, 2):
        return None
    first, second = out[:, 0], out[:, 1]
    if bool((first % 2).any()) or not torch.equal(second, first + 1):
        return None
    return first // 2


def layer_codes(files, sources: Sequence[str], combine: Callable | None, shape: tuple[int, int]) -> LayerCodes | str:
    """The stored e4m3 codes and per-row scales of the weight ``shape`` ``[out, in]`` that a key map's rule
    builds from the file keys ``sources`` with ``combine`` (None: the one source as it is), laid out as that
    rule lays out the weight, or a sentence saying why they cannot be taken as they are.

    Exact by construction: each output row is one stored row of codes with that row's own scale (a per-tensor
    scale spread to every row), so ``codes.float() · scale[:, None]`` equals, bit for bit, the fp32 weight the
    dequantising view reads (both are the same fp32 products). Separately scaled sources (diffusers' q, k and
    v) concatenate exactly for that reason. The rule must be a re-layout of whole rows: checked on a probe,
    then on the codes themselves (the rule applied to the codes must give the rows the probe says).
    Not taken: a source that is not fp8 in the file, e5m2 codes (``Fp8Linear`` holds e4m3), a scale neither
    per tensor nor per row, a rule that does anything but re-order rows.
    """
    if not isinstance(files, QuantizedView):
        return "not fp8 in the file"
    parts, scales = [], []
    for source in sources:
        stored = files.stored(source)
        if stored is None:
            return f"'{source}' is not fp8 in the file"
        codes, scale = stored
        if codes.dtype != torch.float8_e4m3fn:
            return f"'{source}' is stored as {codes.dtype}, Fp8Linear holds e4m3 codes"
        if codes.dim() != 2:
            return f"'{source}' is not a matrix (shape {list(codes.shape)})"
        row_scale = _row_scales(scale, codes.shape[0])
        if row_scale is None:
            return f"the scale of '{source}' (shape {list(scale.shape)}) is neither per tensor nor per row"
        parts.append(codes)
        scales.append(row_scale)
    if not parts or any(p.shape[1] != shape[1] for p in parts):
        return "its stored shapes do not give the layer's columns"
    if combine is None and len(parts) == 1:
        codes, scale = parts[0], scales[0]
    else:
        rows = _row_map(combine, [p.shape[0] for p in parts], shape[0]) if combine is not None else None
        if rows is None:
            return "the layout's rule for it is not a re-layout of rows"
        bytes_ = [p.view(torch.uint8) for p in parts]
        laid_out = combine(bytes_)
        stacked = bytes_[0] if len(bytes_) == 1 else torch.cat(bytes_)
        if laid_out.dtype != torch.uint8 or not torch.equal(laid_out, stacked[rows]):
            return "the layout's rule moves the codes otherwise than whole rows"
        codes, scale = laid_out.view(torch.float8_e4m3fn), torch.cat(scales)[rows]
    if tuple(codes.shape) != tuple(shape):
        return f"its codes are {list(codes.shape)}, the layer is {list(shape)}"
    return LayerCodes(codes.contiguous(), scale.contiguous())
