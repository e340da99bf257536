"""comfy-kitchen, the host's quantisation library, for the layers of quantised files
(``h3_core.formats.quantized_files``):
dequantising them, keeping them quantised, and deciding which of the two a device allows.

A layer kept quantised is what ComfyUI's ``MixedPrecisionOps.Linear`` holds (``comfy/ops.py``
``_load_quantized_module`` at Comfy-Org/ComfyUI 5522e4f): its ``weight`` is a comfy-kitchen ``QuantizedTensor``
(``TensorWiseINT8Layout`` or ``TensorCoreNVFP4Layout``, logical dtype the compute dtype) built from the stored
codes and scales, and ``F.linear(x, weight, bias)`` dispatches to the library's registered op for the layout:
for int8 (ConvRot or not) ``comfy_kitchen.int8_linear``, which rotates and quantises ``x`` per row and runs an
int8 matmul; for nvfp4 with a plain input, the weight dequantised for the matmul (ComfyUI's
``full_precision_matrix_mult`` form, which the released nvfp4 text encoder declares; the nvfp4 × nvfp4 matmul
needs the caller to quantise ``x`` too, and compute capability 10.0).

Where that is allowed (``kitchen_support``): a CUDA device only; the layout's ``MIN_SM_VERSION`` (int8 7.5,
nvfp4 weights held for any GPU comfy-kitchen's dequantiser runs on); and a backend of comfy-kitchen's registry
that accepts the call (``registry.get_capable_backend`` on a small probe on that device, the check comfy-kitchen's
own fused int8 ops make). Anywhere else the layers are dequantised on load, and one log line per load says so.

comfy-kitchen is imported on first use, so importing ``h3_core`` loads none of its extensions.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import H3BackendUnavailable, H3InputError
from .quant_layers import HELD, LayerQuant, count_kinds, describe_formats

__all__ = ["Holding", "dequantize", "hold_layers", "kitchen_support", "kitchen_tensor", "requantize", "stored_bytes"]

_LAYOUTS = {"int8_tensorwise": "TensorWiseINT8Layout", "nvfp4": "TensorCoreNVFP4Layout"}
# The registry call whose capable backend decides, by format.
_OPS = {"int8_tensorwise": "int8_linear", "nvfp4": "dequantize_nvfp4"}
_OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_log = logging.getLogger(__name__)


def _tensor_api():
    import comfy_kitchen.tensor as ck_tensor

    return ck_tensor


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kitchen_tensor(view, quant: LayerQuant, dtype: torch.dtype, device, shape: tuple[int, ...] | None = None):
    """The comfy-kitchen ``QuantizedTensor`` of ``quant``'s layer, built from the tensors ``view``
    (``QuantizedView``) stores, on ``device``, standing for a ``dtype`` weight of ``shape`` (default: the stored
    one; an nvfp4 weight padded to 16 columns is cut back to it). Per-row int8 scales are laid out ``[N, 1]``
    as comfy-kitchen's own quantiser makes them, a per-tensor scale as a scalar."""
    if quant.format not in _LAYOUTS:
        raise H3InputError(
            f"{view.path}: layer '{quant.layer}' is {quant.kind}, which comfy-kitchen layers do not "
            f"hold here (its {', '.join(_LAYOUTS)} layers only)"
        )
    ck = _tensor_api()
    device = torch.device(device)
    codes = view.raw(quant.weight).to(device)
    shape = tuple(shape or view.shape(quant.weight))
    if quant.format == "int8_tensorwise":
        scale = view.raw(quant.scale).to(device=device, dtype=torch.float32)
        scale = scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, 1)
        params = ck.TensorWiseINT8Layout.Params(
            scale=scale, orig_dtype=dtype, orig_shape=shape, convrot=quant.convrot, convrot_groupsize=quant.group or 256
        )
    else:
        block = view.raw(quant.scale).to(device)
        if block.dtype == torch.uint8:  # the older on-disk form, read as e4m3 as comfy/ops.py does
            block = block.view(torch.float8_e4m3fn)
        scale = view.raw(quant.scale_2).to(device=device, dtype=torch.float32).reshape(())
        params = ck.TensorCoreNVFP4Layout.Params(scale=scale, orig_dtype=dtype, orig_shape=shape, block_scale=block)
    return ck.QuantizedTensor(codes, _LAYOUTS[quant.format], params)


def dequantize(view, quant: LayerQuant, dtype: torch.dtype, device, shape: tuple[int, ...] | None = None):
    """The ``dtype`` tensor ``quant``'s layer stands for, computed on ``device`` by comfy-kitchen's own
    dequantisation of the stored tensors (``QuantizedTensor.dequantize``: for int8 ConvRot the codes times their
    scales, rotated back; for nvfp4 the e2m1 codes times their block and tensor scales). comfy-kitchen writes
    fp32, fp16 and bf16; any other float ``dtype`` is its fp32 result cast."""
    if dtype not in _OUTPUT_DTYPES:
        return kitchen_tensor(view, quant, torch.float32, device, shape).dequantize().to(dtype)
    return kitchen_tensor(view, quant, dtype, device, shape).dequantize()


def is_kitchen_tensor(tensor) -> bool:
    """Whether ``tensor`` is a comfy-kitchen ``QuantizedTensor`` (False before the library is loaded)."""
    ck_tensor = sys.modules.get("comfy_kitchen.tensor")
    return ck_tensor is not None and isinstance(tensor, ck_tensor.QuantizedTensor)


def stored_bytes(tensor: torch.Tensor) -> int:
    """The bytes ``tensor`` occupies: a comfy-kitchen ``QuantizedTensor``'s codes and scales (what its
    ``state_dict`` stores), any other tensor's elements."""
    if is_kitchen_tensor(tensor):
        return sum(t.numel() * t.element_size() for t in tensor.state_dict().values())
    return tensor.numel() * tensor.element_size()


def requantize(like, weight: torch.Tensor, dtype: torch.dtype):
    """``weight`` (after a LoRA merge) quantised by comfy-kitchen into the layout and options of ``like`` (a
    ``QuantizedTensor`` read from the file: ConvRot group, per-row or per-tensor scale), standing for a ``dtype``
    weight: the library's ``requantize_from_float``, the call ComfyUI's ``set_weight`` makes."""
    fresh = like.requantize_from_float(weight)
    codes = fresh.layout_cls.get_plain_tensors(fresh)[0]
    return type(fresh)(codes, fresh.layout_cls.__name__, dataclasses.replace(fresh.params, orig_dtype=dtype))


def _probe(fmt: str, dtype: torch.dtype, device: torch.device) -> dict:
    """Small arguments of ``_OPS[fmt]`` on ``device``, for the registry's constraint checks (dtypes, ranks,
    devices: the checks comfy-kitchen 0.2.40 registers for these calls do not depend on sizes)."""
    if fmt == "int8_tensorwise":
        return {
            "x": torch.zeros(1, 16, dtype=dtype, device=device),
            "weight": torch.zeros(1, 16, dtype=torch.int8, device=device),
            "weight_scale": torch.ones(1, 1, device=device),
            "bias": None,
            "out_dtype": dtype,
            "convrot": True,
            "convrot_groupsize": 16,
        }
    return {
        "qx": torch.zeros(16, 8, dtype=torch.uint8, device=device),
        "per_tensor_scale": torch.ones((), device=device),
        "block_scales": torch.zeros(128, 4, dtype=torch.float8_e4m3fn, device=device),
        "output_type": dtype,
        "hi_first": True,
    }


@functools.lru_cache(maxsize=None)
def kitchen_support(fmt: str, kind: str, dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """Whether comfy-kitchen runs ``fmt`` layers (ComfyUI's format name; ``kind`` the name users know) computing
    in ``dtype`` on ``device``: ``(True, backend)`` or ``(False, why not)`` (module docstring)."""
    if fmt not in _LAYOUTS:
        return False, f"{kind} layers are read by h3_core's own fp8 path (linears='fp8' keeps their codes)"
    if device.type != "cuda":
        return False, f"comfy-kitchen has no {kind} kernels for {device.type}"
    if not torch.cuda.is_available():
        return False, f"CUDA is not available for {device}"
    ck = _tensor_api()
    from comfy_kitchen.exceptions import NoCapableBackendError
    from comfy_kitchen.registry import registry

    layout = ck.get_layout_class(_LAYOUTS[fmt])
    capability = torch.cuda.get_device_capability(device)
    if fmt == "int8_tensorwise" and layout.MIN_SM_VERSION and capability < layout.MIN_SM_VERSION:
        need = ".".join(map(str, layout.MIN_SM_VERSION))
        return (
            False,
            f"comfy-kitchen's {kind} kernels need compute capability {need}, {device} has "
            f"{capability[0]}.{capability[1]}",
        )
    with torch.cuda.device(device):
        try:
            backend = registry.get_capable_backend(_OPS[fmt], _probe(fmt, dtype, device))
        except NoCapableBackendError as exc:
            return False, f"no comfy-kitchen backend runs {_OPS[fmt]} in {_short(dtype)} on {device} ({exc})"
    how = f"{_OPS[fmt]} on its {backend} backend"
    if fmt == "nvfp4":
        fast = layout.MIN_SM_VERSION is None or capability >= layout.MIN_SM_VERSION
        how += "; matmuls " + ("nvfp4 where the input is quantised too" if fast else "with the weight dequantised")
    return True, how


@dataclass(frozen=True)
class Holding:
    """How the quantised layers of one load are held: ``kept`` (weight keys kept as comfy-kitchen weights),
    ``dequantised`` (read as the tensors they stand for) and the one ``report`` line logged for the load."""

    kept: frozenset[str]
    dequantised: frozenset[str]
    report: str
    dtype: torch.dtype

    def kitchen_weight(self, view, quant: LayerQuant, device, shape=None):
        """A kept layer's weight: its ``QuantizedTensor`` on ``device``, as a frozen parameter value."""
        return kitchen_tensor(view, quant, self.dtype, device, shape).requires_grad_(False)


def hold_layers(
    path, quants, held: str, dtype: torch.dtype, run_device, forced: dict[str, str] | None = None
) -> Holding:
    """Decide how the layers ``quants`` (``LayerQuant``) of the file ``path`` are held when the model computes in
    ``dtype`` on ``run_device``, by ``held`` (``quantized_files.HELD``), and log one line saying so. ``forced``
    names weight keys that are dequantised whatever the device allows, with the reason (an fp32 island, a LoRA
    merged into it, a key map that re-lays it out). ``held="kitchen"`` raises ``H3BackendUnavailable`` naming why
    when a layer cannot be kept."""
    if held not in HELD:
        raise H3InputError(f"held: got {held!r}; allowed: {', '.join(map(repr, HELD))}")
    forced = forced or {}
    run_device = torch.device(run_device)
    if run_device.type == "cuda" and run_device.index is None and torch.cuda.is_available():
        run_device = torch.device("cuda", torch.cuda.current_device())
    kept, dequantised = {}, {}
    for quant in quants:
        if quant.weight in forced:
            ok, why = False, forced[quant.weight]
        elif held == "dequantize":
            ok, why = False, "held='dequantize'"
        elif quant.full_precision and quant.format == "int8_tensorwise":
            ok, why = False, "the file asks for full-precision matmuls"
        else:
            ok, why = kitchen_support(quant.format, quant.kind, dtype, run_device)
        if not ok and held == "kitchen" and quant.weight not in forced:
            raise H3BackendUnavailable(
                f"{path}: layer '{quant.layer}' ({quant.kind}) cannot be kept as a "
                f"comfy-kitchen layer: {why}; load it with held='auto' to dequantise it"
            )
        (kept if ok else dequantised).setdefault(why, []).append(quant)
    parts = [
        f"{describe_formats(count_kinds(qs))} kept quantised as comfy-kitchen layers for {run_device} ({why})"
        for why, qs in kept.items()
    ]
    parts += [
        f"{describe_formats(count_kinds(qs))} dequantised on load to {_short(dtype)}: {why}"
        for why, qs in dequantised.items()
    ]
    report = f"{Path(path).name}: " + "; ".join(parts) if parts else ""
    if report:
        _log.info(report)
    return Holding(
        frozenset(q.weight for qs in kept.values() for q in qs),
        frozenset(q.weight for qs in dequantised.values() for q in qs),
        report,
        dtype,
    )
