"""Which format each layer of a quantised safetensors checkpoint is in, read from its header (the formats are
described in ``h3_core.formats.quantized_files``), and how a load holds such layers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from ..errors import H3InputError

if TYPE_CHECKING:
    from .files import CheckpointFiles

__all__ = ["FORMATS", "HELD", "LayerQuant", "layer_quants", "count_kinds", "describe_formats"]

# comfy_quant "format" -> the weight's stored dtype (safetensors header names)
_STORAGE = {"float8_e4m3fn": ("F8_E4M3",), "float8_e5m2": ("F8_E5M2",), "int8_tensorwise": ("I8",), "nvfp4": ("U8",)}
FORMATS = tuple(_STORAGE)
# How a quantised file's layers are held: comfy-kitchen layers where it has kernels for the device, else
# dequantised ("auto"); always dequantised ("dequantize"); comfy-kitchen layers or an error ("kitchen").
HELD = ("auto", "dequantize", "kitchen")
_FLOATS = ("F32", "F16", "BF16")
_NVFP4_BLOCK = 16  # codes per block scale (comfy/quant_ops.py QUANT_ALGOS["nvfp4"]["group_size"])
SHOW = 5


@dataclass(frozen=True)
class LayerQuant:
    """How one layer's weight is stored: ``weight`` its key, ``format`` ComfyUI's name for it, the ConvRot
    rotation (``convrot``, ``group``), ``full_precision`` (the file asks for the matmul in the compute dtype)
    and the keys of its sidecars (None where absent)."""

    weight: str
    format: str
    scale: str
    convrot: bool = False
    group: int = 0
    full_precision: bool = False
    scale_2: str | None = None
    input_scale: str | None = None
    pre_quant_scale: str | None = None
    marker: str | None = None

    @property
    def layer(self) -> str:
        return self.weight.removesuffix(".weight")

    @property
    def kind(self) -> str:
        """The name users know the format by: ``float8_e4m3fn``, ``float8_e5m2``, ``int8_tensorwise``,
        ``int8_convrot``, ``nvfp4`` or ``nvfp4_awq``."""
        if self.convrot:
            return "int8_convrot"
        if self.pre_quant_scale is not None:
            return "nvfp4_awq"
        return self.format

    @property
    def sidecars(self) -> tuple[str, ...]:
        keys = (self.scale, self.scale_2, self.input_scale, self.pre_quant_scale, self.marker)
        return tuple(k for k in keys if k is not None)


def _marker(files: CheckpointFiles, key: str) -> dict:
    try:
        spec = json.loads(bytes(files.get(key).flatten().tolist()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, ValueError):
        spec = None
    if not isinstance(spec, dict):
        raise H3InputError(
            f"{files.path}: '{key}' is not a JSON object; ComfyUI's quantization sidecars hold the "
            f'bytes of one, e.g. {{"format": "int8_tensorwise"}}'
        )
    return spec


def _option(spec: dict, name: str, default):
    """A comfy_quant option, at the top level or under ``"params"`` (comfy/ops.py reads both)."""
    params = spec.get("params")
    nested = params.get(name, default) if isinstance(params, dict) else default
    return spec.get(name, nested)


class _Check:
    """Header checks of one layer; every failure names the file, the layer and what is expected."""

    def __init__(self, files: CheckpointFiles, layer: str, kind: str):
        self.files, self.layer, self.kind = files, layer, kind

    def fail(self, what: str):
        raise H3InputError(f"{self.files.path}: layer '{self.layer}' ({self.kind}): {what}")

    def tensor(
        self, suffix: str, dtypes: tuple[str, ...], shapes: Iterable[tuple[int, ...]] | None, expected: str
    ) -> str:
        key = f"{self.layer}.{suffix}"
        if key not in self.files.keys:
            self.fail(f"has no '{key}'; ComfyUI's {self.kind} layers store {expected} there")
        dtype, shape = self.files.dtypes[key], tuple(self.files.shape(key))
        if dtype not in dtypes or (shapes is not None and shape not in set(shapes)):
            self.fail(f"'{key}' is {dtype} {list(shape)}, expected {expected}")
        return key

    def optional(self, suffix: str, dtypes: tuple[str, ...], shapes, expected: str) -> str | None:
        key = f"{self.layer}.{suffix}"
        return self.tensor(suffix, dtypes, shapes, expected) if key in self.files.keys else None


def _row_scale_shapes(rows: int) -> tuple[tuple[int, ...], ...]:
    return (), (1,), (rows,), (rows, 1)


def _comfy_layer(files: CheckpointFiles, marker: str) -> LayerQuant:
    layer = marker.removesuffix(".comfy_quant")
    spec = _marker(files, marker)
    fmt = spec.get("format")
    if fmt not in _STORAGE:
        named = "names no format" if fmt is None else f"is quantized as '{fmt}'"
        raise H3InputError(
            f"{files.path}: layer '{layer}' {named}, which this pack does not read; it reads "
            f"ComfyUI's {', '.join(FORMATS)} (with convrot) layers through comfy-kitchen"
        )
    convrot = fmt == "int8_tensorwise" and bool(_option(spec, "convrot", False))
    group = int(_option(spec, "convrot_groupsize", 256)) if convrot else 0
    kind = "int8_convrot" if convrot else fmt
    check = _Check(files, layer, kind)
    weight = f"{layer}.weight"
    if weight not in files.keys:
        check.fail(f"'{marker}' describes a layer with no '{weight}'")
    shape = tuple(files.shape(weight))
    if files.dtypes[weight] not in _STORAGE[fmt] or len(shape) != 2:
        check.fail(f"'{weight}' is {files.dtypes[weight]} {list(shape)}, expected a {_STORAGE[fmt][0]} matrix")
    rows, cols = shape
    common = dict(
        weight=weight,
        format=fmt,
        marker=marker,
        full_precision=bool(_option(spec, "full_precision_matrix_mult", False)),
    )
    if fmt == "nvfp4":
        k = 2 * cols
        if k % _NVFP4_BLOCK:
            check.fail(
                f"'{weight}' holds {k} columns, not a multiple of the {_NVFP4_BLOCK} codes each block scale "
                f"covers (comfy-kitchen pads them)"
            )
        blocks = ((rows + 127) // 128 * 128, (k // _NVFP4_BLOCK + 3) // 4 * 4)
        return LayerQuant(
            **common,
            scale=check.tensor(
                "weight_scale",
                ("F8_E4M3", "U8"),
                (blocks,),
                f"F8_E4M3 block scales {list(blocks)} (one per {_NVFP4_BLOCK} codes, swizzled)",
            ),
            scale_2=check.tensor("weight_scale_2", ("F32",), ((), (1,)), "the F32 per-tensor scale"),
            input_scale=check.optional("input_scale", ("F32",), ((), (1,)), "one F32 input scale"),
            pre_quant_scale=check.optional(
                "pre_quant_scale", _FLOATS, [(n,) for n in range(k - 15, k + 1)], f"the AWQ input scales [{k}]"
            ),
        )
    if convrot:
        if group < 4 or group & (group - 1) or (group.bit_length() - 1) % 2:
            check.fail(f"convrot_groupsize {group} is not a power of 4 (comfy-kitchen's Hadamard sizes)")
        if cols % group:
            check.fail(f"its {cols} input columns are not a multiple of its convrot_groupsize {group}")
    scale = check.tensor(
        "weight_scale", _FLOATS, _row_scale_shapes(rows), f"a float scale per tensor or per row ([{rows}, 1])"
    )
    return LayerQuant(
        **common,
        scale=scale,
        convrot=convrot,
        group=group,
        input_scale=check.optional("input_scale", _FLOATS, None, "the input scale"),
    )


def layer_quants(files: CheckpointFiles) -> dict[str, LayerQuant]:
    """Every quantised layer of ``files`` by weight key, read from the header and the few-byte ``comfy_quant``
    sidecars (ComfyUI's per-layer form, and the older ``scaled_fp8`` one); {} for a plain file. Raises
    ``H3InputError`` for a format this pack does not read or a layer whose sidecars are missing or malformed."""
    layers = {}
    for marker in sorted(k for k in files.keys if k.endswith(".comfy_quant")):
        quant = _comfy_layer(files, marker)
        layers[quant.weight] = quant
    if "scaled_fp8" in files.keys:
        for key in sorted(k for k in files.keys if k.endswith(".scale_weight")):
            layer = key.removesuffix(".scale_weight")
            weight = f"{layer}.weight"
            if weight in layers or weight not in files.keys:
                continue
            fmt = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}.get(files.dtypes[weight])
            if fmt is None:
                raise H3InputError(
                    f"{files.path}: layer '{layer}' (scaled fp8): '{weight}' is "
                    f"{files.dtypes[weight]}, expected F8_E4M3 or F8_E5M2"
                )
            input_scale = f"{layer}.scale_input"
            layers[weight] = LayerQuant(
                weight=weight, format=fmt, scale=key, input_scale=input_scale if input_scale in files.keys else None
            )
    return layers


def count_kinds(quants: Iterable[LayerQuant]) -> dict[str, int]:
    """How many of ``quants`` each format (``LayerQuant.kind``) has, by name."""
    counts: dict[str, int] = {}
    for quant in quants:
        counts[quant.kind] = counts.get(quant.kind, 0) + 1
    return dict(sorted(counts.items()))


def describe_formats(counts: dict[str, int]) -> str:
    """``{"int8_convrot": 200}`` → ``"int8_convrot (200 layers)"``."""
    return ", ".join(f"{kind} ({n} layer{'' if n == 1 else 's'})" for kind, n in counts.items())
