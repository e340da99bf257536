"""fp8 (e4m3) linear layers for the DiT's large projections: weights stored in fp8, matmuls in fp8 on Hopper.

Storage: ``weight`` ``[out, in]`` float8_e4m3fn and ``weight_scale`` ``[out]`` fp32 (one scale per output
channel), so the weight the layer stands for is ``weight · weight_scale[:, None]`` (the names and meaning of
ComfyUI's fp8-scaled files, whose checkpoints ``Fp8Linear.from_scaled`` takes as they are); an optional bias
in the compute dtype.

Forward, for activations ``x`` ``[..., in]`` (any leading shape, flattened to rows ``[M, in]``):
  s_a = amax(|x_row|) / 448   (fp32 ``[M, 1]``; 448 is e4m3's largest finite value)
  x_q = e4m3(x / s_a)         (the row's largest magnitude lands on ±448: nothing overflows)
  y   = (x_q · s_a) @ (w_q · s_w)ᵀ + bias, returned in the compute dtype.
On a CUDA device that runs fp8 matmuls (sm89+) this is one ``torch._scaled_mm`` with row-wise scales on both
sides. A CUDA card without fp8 tensor cores (sm80, sm86) keeps the weight's codes and multiplies in the compute
dtype: the weight dequantised into it (``fp8_linear_weights_only``), the activations as they come, as a bf16
layer would. Anywhere else (CPU, shapes or dtypes the kernel refuses) it is computed literally in fp32 by
dequantising both operands: ``fp8_linear_reference``, the eager reference the fast paths are tested against.
``linear_form`` names the form per compute capability.

Which layers (``FP8_LAYERS``): the published VDN-H3 fp8 path (reference/vdn_h3.md §6, ``ops/fp8_linear.py``)
quantises the Linears with both sides ≥ 4096 — q, k, v, to_out, the FFN pair and to_out_linear — with a
weight scale per output channel and an activation scale per row on sm90, and counts 363 of them. 363 =
50 blocks × 7 + 2 token-refiner blocks × 6 + 1 (``condition_proj``, 5120→5376) [our arithmetic], so the
refiner's projections were quantised too: they carry the same attribute names here and are swapped by
default. ``condition_proj`` (run on the prompt rows only) is left out of the default list; add its name to
reproduce the published set. The fp32 islands (patch projections, timestep MLP, output heads) never are.
Quantise after merging LoRAs (vdn_h3.md §2: "fp8 (must be after merge)"): merging into an fp8 weight would
lose the update.
"""

from __future__ import annotations

import collections
import functools
import logging
from typing import Iterable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import H3InputError
from ..triton_forms import capability_of, runs_here, triton_form

try:  # Triton is optional: without it the plain forms run
    from . import fp8_triton
except ImportError:
    fp8_triton = None

__all__ = [
    "E4M3_MAX",
    "FP8_LAYERS",
    "Fp8Linear",
    "QuantizedRows",
    "quantize_input",
    "quantization_targets",
    "fp8_linear_reference",
    "fp8_linear_scaled_mm",
    "fp8_linear_weights_only",
    "FP8_MATMUL_CAPABILITY",
    "linear_form",
    "device_linear_form",
    "reads_quantized_rows",
    "quantize_linears",
    "quantize_rows",
    "quantize_rows_reference",
    "scaled_mm_supports",
]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
# Zero rows get this scale instead of 0, so x / scale stays 0 rather than NaN; the smallest normal fp32 keeps
# the scale away from subnormals that a kernel might flush to zero.
_SMALLEST_SCALE = torch.finfo(torch.float32).tiny
_COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# torch._scaled_mm's row-wise path returns these; it refuses a bias with an fp32 output.
_SCALED_MM_OUT_DTYPES = (torch.bfloat16, torch.float16)

FP8_LAYERS = ("qkv_proj", "out_proj", "fc1", "fc2", "to_out_linear")
# The first compute capability with fp8 tensor cores (Ada); older cards multiply an fp8 layer in its compute dtype.
FP8_MATMUL_CAPABILITY = (8, 9)

_log = logging.getLogger(__name__)
_fallbacks_reported: set[str] = set()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` ``[M, K]`` (any float dtype, any strides) as e4m3 codes ``[M, K]`` (contiguous) and
    its fp32 scale ``[M, 1]`` (contiguous), ``x ≈ codes · scale``: ``quantize_rows_reference``'s numbers, in
    one Triton pass per row on CUDA (``_fp8_triton``) when the rows' last dimension is contiguous."""
    if runs_here(x) and x.dim() == 2 and x.dtype in _COMPUTE_DTYPES and x.stride(-1) == 1:
        fused = triton_form(fp8_triton, "quantize_rows_triton", x.device)
        if fused is not None:
            return fused(x, _SMALLEST_SCALE)
    return quantize_rows_reference(x)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager form of ``quantize_rows``, the reference of its fast path.

    ``scale = amax / 448`` puts the row's largest magnitude on e4m3's largest value, so every element keeps
    e4m3's 3-bit relative precision and none overflows: ``|x| ≤ amax`` and ``scale ≥ amax / 448 · (1 − 2⁻²⁴)``
    give ``|x / scale| < 448 · (1 + 2⁻²²)``, which rounds to 448 (e4m3fn's next value would be 480; the cast
    only turns to NaN from 464 up), so saturation needs no clamp. The division runs in fp32 and is written
    straight into the e4m3 output: one pass, no fp32 copy of ``x`` (6 GB for the FFN's input at 104k rows)."""
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1, keepdim=True).float()  # exact in x's dtype
    # Divided by a device tensor, not the Python number: CUDA turns division by a host scalar into a product
    # with its reciprocal, which rounds differently from the CPU, and a weight's codes would then depend on
    # the device it was quantised on.
    scale = torch.div(amax, torch.full_like(amax, E4M3_MAX)).clamp_min_(_SMALLEST_SCALE)
    codes = torch.empty(x.shape, dtype=E4M3, device=x.device)
    torch.div(x, scale, out=codes)
    return codes, scale


class QuantizedRows(NamedTuple):
    """Activations already quantised by ``quantize_input``: the same input read by several slices of one
    layer (the head-group path's q, k and v rows of every group) is quantised once."""

    codes: torch.Tensor  # [M, in] e4m3
    scale: torch.Tensor  # [M, 1] fp32
    lead: tuple[int, ...]  # the input's leading shape

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.lead, self.codes.shape[-1])

    @property
    def device(self) -> torch.device:
        return self.codes.device


def quantize_input(x: torch.Tensor) -> QuantizedRows:
    """``x`` ``[..., in]`` quantised per row as ``Fp8Linear`` does (``quantize_rows``), for reuse."""
    codes, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return QuantizedRows(codes, scale, tuple(x.shape[:-1]))


def _rows(x: torch.Tensor | QuantizedRows) -> QuantizedRows:
    return x if isinstance(x, QuantizedRows) else quantize_input(x)


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """The eager reference of ``Fp8Linear``: rows quantised as the fast path does, then
    ``(x_q · s_a) @ (w_q · s_w)ᵀ (+ bias)`` in fp32, cast to ``out_dtype``. Runs on any device; on CUDA its
    fp32 matmul follows torch's TF32 setting.

    Args:
        x ``[..., in]`` (or its ``QuantizedRows``); weight ``[out, in]`` e4m3; weight_scale ``[out]`` fp32; bias
        ``[out]`` or None.
    Returns:
        ``[..., out]`` in ``out_dtype``.
    """
    rows = _rows(x)
    y = (rows.codes.float() * rows.scale) @ (weight.float() * weight_scale.float()[:, None]).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype).reshape(*rows.lead, weight.shape[0])


def fp8_linear_scaled_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    fast_accum: bool = True,
) -> torch.Tensor:
    """The fast path: one row-wise-scaled ``torch._scaled_mm``. Only where ``scaled_mm_supports`` says so.

    The kernel's layout rules are met by construction: the codes of ``x`` are a fresh row-major ``[M, in]``,
    ``weight.t()`` of the contiguous ``[out, in]`` weight is the column-major ``[in, out]`` it wants, and the
    scales are contiguous fp32 ``[M, 1]`` and ``[1, out]``. ``fast_accum`` lets Hopper's fp8 tensor cores
    accumulate without the periodic fp32 promotion (faster, less precise; the published path uses it).
    """
    rows = _rows(x)
    y = torch._scaled_mm(
        rows.codes,
        weight.t(),
        scale_a=rows.scale,
        scale_b=weight_scale.view(1, -1),
        bias=bias,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )
    return y.reshape(*rows.lead, weight.shape[0])


def fp8_linear_weights_only(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """A card without fp8 matmuls: ``x @ (w_q · s_w)ᵀ (+ bias)`` in ``out_dtype``, the weight dequantised into one
    ``[out, in]`` buffer of ``out_dtype`` (e4m3 codes are exact in bf16 and fp16; the product with the fp32 scale
    is rounded once) and ``x`` taken as it is (rows that come quantised are dequantised first)."""
    if isinstance(x, QuantizedRows):
        lead, rows = x.lead, _dequantized(x.codes, x.scale, out_dtype)
    else:
        lead, rows = tuple(x.shape[:-1]), x.reshape(-1, x.shape[-1]).to(out_dtype)
    dense = _dequantized(weight, weight_scale.float()[:, None], out_dtype)
    y = F.linear(rows, dense, None if bias is None else bias.to(out_dtype))
    return y.reshape(*lead, weight.shape[0])


def _dequantized(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes · scale`` (fp32 scale, broadcast) in ``dtype``, computed in fp32 and rounded once, in one buffer."""
    dense = codes.to(dtype)
    return torch.mul(dense, scale, out=dense)


def linear_form(capability: tuple[int, int] | None) -> str:
    """How an ``Fp8Linear`` multiplies on a device of ``capability`` (None: not a CUDA device): ``"fp8"`` (one
    ``torch._scaled_mm``, the activations quantised per row), ``"weights only"`` (``fp8_linear_weights_only``:
    a card without fp8 tensor cores) or ``"reference"`` (``fp8_linear_reference``, fp32, off CUDA)."""
    if capability is None:
        return "reference"
    return "fp8" if tuple(capability) >= FP8_MATMUL_CAPABILITY else "weights only"


def device_linear_form(device: torch.device | str) -> str:
    """``linear_form`` of ``device``'s card (``"reference"`` off CUDA)."""
    return linear_form(capability_of(device))


def reads_quantized_rows(layer: nn.Module, device: torch.device) -> bool:
    """Whether ``layer`` takes its input quantised per row (``QuantizedRows``) on ``device``: an ``Fp8Linear``,
    except on a card that multiplies it in its compute dtype (``linear_form`` "weights only"), whose
    activations are never quantised."""
    return isinstance(layer, Fp8Linear) and device_linear_form(device) != "weights only"


@functools.cache
def _rowwise_scaled_mm_runs(device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether this torch build runs a row-wise-scaled e4m3 ``_scaled_mm`` with an ``out_dtype`` output and bias
    on ``device``: tried once on a 16×16×16 product, because support (sm89 row-wise, fp16 outputs, ROCm's
    e4m3fnuz) depends on the torch and CUDA versions more than the capability alone says."""
    codes = torch.zeros(16, 16, dtype=E4M3, device=device)
    try:
        torch._scaled_mm(
            codes,
            codes.t(),
            scale_a=torch.ones(16, 1, device=device),
            scale_b=torch.ones(1, 16, device=device),
            bias=torch.zeros(16, dtype=out_dtype, device=device),
            out_dtype=out_dtype,
            use_fast_accum=True,
        )
    except (RuntimeError, ValueError, NotImplementedError):
        return False
    return True


def scaled_mm_supports(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> tuple[bool, str]:
    """``(True, "")`` when ``fp8_linear_scaled_mm`` can run ``x @ weightᵀ``, else ``(False, why)``.

    torch._scaled_mm needs a CUDA device of compute capability ≥ 8.9, both dimensions of the weight (in and
    out features) divisible by 16 (the row count is free), and with row-wise scales a bf16/fp16 output. A
    layer whose sizes are not multiples of 16 falls back to the reference rather than being padded: every
    layer of the released model is (5376, 7168, 14336 and their multiples), so only toy sizes get there."""
    if x.device.type != "cuda":
        return False, f"activations on {x.device.type}, the fp8 matmul is CUDA-only"
    capability = torch.cuda.get_device_capability(x.device)
    if capability < (8, 9):
        return False, f"compute capability {capability[0]}.{capability[1]}, fp8 matmuls need 8.9 or newer"
    if out_dtype not in _SCALED_MM_OUT_DTYPES:
        return False, f"compute dtype {out_dtype}, row-wise scaled fp8 matmuls return bf16 or fp16"
    out_features, in_features = weight.shape
    if in_features % 16 or out_features % 16:
        return False, f"a [{out_features}, {in_features}] weight, the fp8 matmul needs both sizes divisible by 16"
    if not _rowwise_scaled_mm_runs(x.device, out_dtype):
        return False, f"torch {torch.__version__} refused a row-wise scaled fp8 matmul on this device"
    return True, ""


def _report_fallback_once(reason: str) -> None:
    if reason not in _fallbacks_reported:
        _fallbacks_reported.add(reason)
        _log.info("Fp8Linear computes in fp32 by dequantising (slower) for %s", reason)


def _check_compute_dtype(compute_dtype) -> None:
    if compute_dtype not in _COMPUTE_DTYPES:
        allowed = ", ".join(map(str, _COMPUTE_DTYPES))
        raise H3InputError(f"compute_dtype must be one of {allowed}, got {compute_dtype!r}")


def _channel_scales(scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """A checkpoint's weight scale as fp32 ``[out]``: one value (per tensor) broadcast, or one per channel
    (``[out]`` or ``[out, 1]``) kept."""
    if not isinstance(scale, torch.Tensor):
        raise H3InputError(f"scale must be a tensor, got {type(scale).__name__}")
    if scale.numel() == 1:
        return scale.float().reshape(1).expand(out_features).contiguous()
    if tuple(scale.shape) in ((out_features,), (out_features, 1)):
        return scale.float().reshape(out_features).contiguous()
    raise H3InputError(
        f"scale must hold one value (per tensor) or one per output channel ([{out_features}] or "
        f"[{out_features}, 1]) for a weight with {out_features} rows, got shape {list(scale.shape)}"
    )


class Fp8Linear(nn.Module):
    """A Linear whose weight is e4m3 with one fp32 scale per output channel; the matmul runs in fp8 where the
    device allows (see the module docstring). Build it with ``from_linear`` or ``from_scaled``; the
    constructor makes an empty (zero) layer for ``load_state_dict``. State-dict keys: ``weight`` (e4m3),
    ``weight_scale`` (fp32), ``bias``. Move it with ``.to(device)``: a cast to another dtype breaks it."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        compute_dtype: torch.dtype = torch.bfloat16,
        device=None,
        fast_accum: bool = True,
    ):
        super().__init__()
        _check_compute_dtype(compute_dtype)
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype, self.fast_accum = compute_dtype, fast_accum
        self.weight = nn.Parameter(
            torch.zeros(out_features, in_features, dtype=E4M3, device=device), requires_grad=False
        )
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        bias_value = torch.zeros(out_features, dtype=compute_dtype, device=device) if bias else None
        self.bias = None if bias_value is None else nn.Parameter(bias_value, requires_grad=False)

    @classmethod
    @torch.no_grad()
    def from_linear(
        cls, linear: nn.Linear, compute_dtype: torch.dtype = torch.bfloat16, fast_accum: bool = True
    ) -> Fp8Linear:
        """Quantise ``linear`` as it is now (after any LoRA merge): each output channel scaled by its own
        amax / 448, computed in fp32 from the stored weight, on the weight's device."""
        if not isinstance(linear, nn.Linear):
            raise H3InputError(f"from_linear takes an nn.Linear, got {type(linear).__name__}")
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype, "meta", fast_accum)
        codes, scale = quantize_rows(linear.weight.detach())
        layer._set_storage(codes, scale.view(-1), linear.bias)
        return layer

    @classmethod
    @torch.no_grad()
    def from_scaled(
        cls,
        weight_fp8: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
        fast_accum: bool = True,
        check_finite: bool = True,
    ) -> Fp8Linear:
        """An fp8-scaled checkpoint's layer taken as it is, no round trip through bf16: ``weight_fp8``
        ``[out, in]`` e4m3 (ComfyUI's ``<layer>.weight``) and its ``scale`` (``<layer>.weight_scale``, or the
        legacy ``scale_weight``): one value broadcast to every channel, or one per channel. A checkpoint's
        static ``input_scale`` is not needed: activations are scaled per row at run time. ``check_finite=False``
        leaves the scale's finiteness to the caller (a load checks every layer's at once: on a GPU each check
        waits for the device)."""
        if not isinstance(weight_fp8, torch.Tensor) or weight_fp8.dtype != E4M3:
            got = weight_fp8.dtype if isinstance(weight_fp8, torch.Tensor) else type(weight_fp8).__name__
            hint = (
                (
                    "; e5m2 weights are read dequantised (h3_core.formats.fp8_scaled) and can be requantised with "
                    "Fp8Linear.from_linear"
                )
                if got == torch.float8_e5m2
                else ""
            )
            raise H3InputError(f"weight_fp8 must be a torch.float8_e4m3fn tensor, got {got}{hint}")
        if weight_fp8.dim() != 2:
            raise H3InputError(f"weight_fp8 must be a matrix [out, in], got shape {list(weight_fp8.shape)}")
        out_features, in_features = weight_fp8.shape
        channel_scale = _channel_scales(scale, out_features).to(weight_fp8.device)
        if check_finite and not bool(torch.isfinite(channel_scale).all()):
            raise H3InputError(f"scale must be finite, got values {channel_scale.unique()[:4].tolist()}")
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise H3InputError(
                f"bias must have shape [{out_features}] for a weight with {out_features} rows, got {list(bias.shape)}"
            )
        layer = cls(in_features, out_features, bias is not None, compute_dtype, "meta", fast_accum)
        layer._set_storage(weight_fp8.contiguous(), channel_scale, bias)
        return layer

    def _set_storage(self, codes: torch.Tensor, channel_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.weight_scale = channel_scale.float().contiguous()
        if bias is not None:
            self.bias = nn.Parameter(
                bias.detach().to(device=codes.device, dtype=self.compute_dtype), requires_grad=False
            )

    def dequantized_weight(self) -> torch.Tensor:
        """The fp32 weight ``[out, in]`` this layer stands for."""
        return self.weight.float() * self.weight_scale[:, None]

    # A weight patcher (ComfyUI's ModelPatcher finds these by the names ``convert_<param>`` / ``set_<param>``)
    # reads the codes as plain numbers, turns them into the weight they stand for with ``convert_weight``,
    # adds its patches in fp32 and hands the result to ``set_weight``, which quantises it afresh.
    def convert_weight(self, codes: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """The weight ``codes`` ``[out, in]`` (this layer's codes as floats) stand for, scaled per channel."""
        scale = self.weight_scale.to(device=codes.device, dtype=codes.dtype)[:, None]
        return codes.mul_(scale) if inplace else codes * scale

    @torch.no_grad()
    def set_weight(self, weight: torch.Tensor, inplace_update: bool = False, seed=None, **_) -> None:
        """Quantise ``weight`` ``[out, in]`` (fp32) as ``from_linear`` does — a fresh scale per channel, amax / 448
        — and hold its codes and scales. ``inplace_update`` writes into the current tensors (same devices);
        otherwise the codes become a new parameter where ``weight`` is, and the scales are copied into the
        existing buffer. ``seed`` is accepted for the patcher's signature; the rounding is deterministic."""
        self._check_storage()
        if tuple(weight.shape) != tuple(self.weight.shape):
            raise H3InputError(
                f"Fp8Linear.set_weight: expected a weight of shape {list(self.weight.shape)}, got {list(weight.shape)}"
            )
        codes, scale = quantize_rows(weight)
        self.weight_scale.copy_(scale.view(-1))
        if inplace_update:
            self.weight.copy_(codes)
        else:
            self.weight = nn.Parameter(codes, requires_grad=False)

    def _check_storage(self) -> None:
        if self.weight.dtype != E4M3 or self.weight_scale.dtype != torch.float32:
            raise H3InputError(
                f"Fp8Linear's weight must stay float8_e4m3fn with an fp32 weight_scale, found "
                f"{self.weight.dtype} and {self.weight_scale.dtype}: the model was cast to another "
                f"dtype after quantisation; move quantised models with .to(device) only"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.part(x)

    def part(
        self, x: torch.Tensor | QuantizedRows, rows: slice | None = None, cols: slice | None = None
    ) -> torch.Tensor:
        """``x @ W[rows, cols]ᵀ`` (+ the bias of those rows when every input column is used): output features
        ``rows`` or the share of input features ``cols``, for the head-group path (``models.low_memory``).
        A column slice of the weight is copied (the kernel wants it contiguous; it is one head group's
        share of the layer). ``x`` may come quantised already (``quantize_input``), the same numbers."""
        self._check_storage()
        weight, scale, bias = self.weight, self.weight_scale, self.bias
        if rows is not None:
            weight, scale = weight[rows], scale[rows]
            bias = None if bias is None else bias[rows]
        if cols is not None:
            weight, bias = weight[:, cols].contiguous(), None
        if x.shape[-1] != weight.shape[1]:
            raise H3InputError(f"Fp8Linear expects inputs [..., {weight.shape[1]}], got {list(x.shape)}")
        usable, reason = scaled_mm_supports(x, weight, self.compute_dtype)
        if usable:
            return fp8_linear_scaled_mm(x, weight, scale, bias, self.compute_dtype, self.fast_accum)
        if device_linear_form(x.device) == "weights only":
            return fp8_linear_weights_only(x, weight, scale, bias, self.compute_dtype)
        if x.device.type == "cuda":
            _report_fallback_once(reason)
        return fp8_linear_reference(x, weight, scale, bias, self.compute_dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"compute_dtype={self.compute_dtype}, fast_accum={self.fast_accum}"
        )


def quantization_targets(model: nn.Module, names: frozenset[str]) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) for every nn.Linear attribute named in ``names``, fp32 islands skipped."""
    from .precision import keeps_fp32

    curve = getattr(getattr(model, "cfg", None), "adaln_curve_grid", 0) > 0
    targets = []
    for parent_name, parent in model.named_modules():
        for attribute, child in parent.named_children():
            full_name = f"{parent_name}.{attribute}" if parent_name else attribute
            if attribute in names and isinstance(child, nn.Linear) and not keeps_fp32(f"{full_name}.weight", curve):
                targets.append((parent, attribute, child))
    return targets


@torch.no_grad()
def quantize_linears(
    model: nn.Module,
    names: Iterable[str] = FP8_LAYERS,
    compute_dtype: torch.dtype = torch.bfloat16,
    fast_accum: bool = True,
) -> int:
    """Swap, in place, every ``nn.Linear`` of ``model`` whose attribute name is in ``names`` for an ``Fp8Linear``
    (see the module docstring for the default set and why); fp32 islands are kept. Run it once, after
    merging LoRAs. Returns the number of layers swapped.

    Each bf16 weight is freed as its layer is swapped (a Linear shared by several parents, once the last of them
    is), so the peak is the model plus one layer's codes, not the model plus all of them: no list, loop variable
    or table here holds a swapped Linear. A reference the caller keeps (a ``state_dict()``, the Linear itself)
    keeps its weight alive."""
    names = (names,) if isinstance(names, str) else tuple(names)
    if not all(isinstance(n, str) for n in names):
        raise H3InputError(f"names must be a list of attribute names such as {list(FP8_LAYERS)}, got {names!r}")
    _check_compute_dtype(compute_dtype)
    already = [name for name, module in model.named_modules() if isinstance(module, Fp8Linear)]
    if already:
        raise H3InputError(
            f"the model already holds {len(already)} Fp8Linear layers (e.g. '{already[0]}'): "
            f"quantize_linears runs once per model, on its bf16/fp32 weights"
        )
    targets = quantization_targets(model, frozenset(names))
    count = len(targets)
    # A Linear shared by several parents is quantised once; ``holders`` counts the parents still holding it,
    # and its entry in ``swapped`` goes with the last one.
    holders = collections.Counter(id(linear) for _, _, linear in targets)
    swapped: dict[int, Fp8Linear] = {}
    targets.reverse()  # popped from the end in the model's order: the list lets go of each Linear as it goes
    while targets:
        parent, attribute, linear = targets.pop()
        key = id(linear)
        if key not in swapped:
            swapped[key] = Fp8Linear.from_linear(linear, compute_dtype, fast_accum)
        setattr(parent, attribute, swapped[key])
        del parent, linear  # the parent now holds the Fp8Linear: the old Linear (and its weight) goes here
        holders[key] -= 1
        if not holders[key]:
            del swapped[key]
    return count
