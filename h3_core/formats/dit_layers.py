"""The DiT read key by key, its big linears built one layer at a time: as fp8 layers, or from a quantised file
as comfy-kitchen layers or dequantised, with the LoRAs that touch a layer merged into it in fp32 first.

``load_layers`` fills a model built on the meta device (``meta_model``) from the checkpoints
``describe_dit_checkpoint`` described (``h3_core.formats.checkpoints``). Every key goes, memory-mapped, straight to the
device in the target dtype (fp32 islands in fp32) except the weights of the layers built one at a time:

* ``linears="fp8"``: the ``FP8_LAYERS`` (qkv_proj, out_proj, fc1, fc2, to_out_linear, the refiner's included)
  become ``Fp8Linear`` layers computing in ``dtype``. A layer no LoRA touches whose weight the file stores in
  e4m3 with a scale per tensor or per row takes the file's codes and scales as they are, re-laid out by the
  layout's rule (``fp8_scaled.layer_codes``), so its ``codes · scale`` is bit for bit the file's dequantised
  weight; any other is read in fp32 (dequantised where the file is quantised: comfy-kitchen for int8 and
  nvfp4), has its LoRA updates merged in fp32, in order, and is quantised with ``Fp8Linear.from_linear``.
* ``linears="dtype"`` with a file quantised in another format (``*_int8_convrot``, nvfp4): every linear whose
  weight the file quantises is held as ``h3_core.formats.kitchen.hold_layers`` decides for ``run_device``: a
  comfy-kitchen
  ``QuantizedTensor`` weight taken from the file's codes and scales (``F.linear`` runs the library's int8
  matmul), or the weight comfy-kitchen dequantises, in ``dtype``. A layer a LoRA touches is dequantised to
  fp32, merged, then requantised by comfy-kitchen into the file's layout (kept) or rounded to ``dtype``.
Only one layer's weight is ever held in fp32 at a time. Where the run device is a GPU, dequantising and
requantising run there (comfy-kitchen's CUDA kernels); the result goes to ``device``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from ..errors import H3InputError
from ..models.dit import H3DiT
from ..models.fp8_linear import FP8_LAYERS, Fp8Linear, quantization_targets
from ..models.precision import keeps_fp32
from .dit import layouts
from .files import CheckpointFiles, spans_of
from .fp8_scaled import LayerCodes, layer_codes
from .keymap import match_layout, quantized_plan
from .kitchen import hold_layers, kitchen_tensor, requantize
from .lora import LoraDelta, merge_lora
from .meta_shapes import meta_shapes
from .quantized_files import QuantizedView, quantized_view
from .staged_read import reader_for
from .vdn import BranchWeights, branch_layouts

__all__ = ["DIT", "BRANCH", "FROM_FILE", "AT_LOAD", "KEPT", "load_layers", "meta_model", "meta_shapes", "needs_layers"]

DIT = "MiniMax H3 DiT"
BRANCH = "VDN-H3 linear branch"
FROM_FILE, AT_LOAD = "codes from the file", "quantised at load"
KEPT, REQUANTISED = "kept as a comfy-kitchen layer", "requantised by comfy-kitchen after its LoRA merge"
_SHOW = 5


def meta_model(base_info, branch_info) -> H3DiT:
    """The model the checkpoints describe, every weight on the meta device."""
    cfg = replace(base_info.cfg, hybrid=branch_info is not None)
    with torch.device("meta"):
        # .to("meta"): the LoRA checks need every weight on meta, even where torch.empty is wrapped (the device
        # context then misses it and builds on the CPU)
        return H3DiT(cfg).to("meta")


def needs_layers(info) -> bool:
    """Whether a checkpoint quantises layers in a format other than fp8 (so ``linears="dtype"`` loads it here)."""
    return info is not None and any(not kind.startswith("float8") for kind, _ in info.quantization)


@dataclass(frozen=True)
class _Planned:
    """How one key of the model is read: from which (possibly dequantising) files, which file keys, combined
    how, and whether it is an fp32 island."""

    files: object
    sources: tuple[str, ...]
    combine: object
    fp32: bool


def _plan_keys(model: H3DiT, base_info, branch_info, work_device, reader) -> tuple[dict, str]:
    """Every key of ``model`` (built on meta) with how it is read (through ``reader`` when not None), and the
    layout's name as the plain load gives it."""
    cfg = base_info.cfg
    curve = cfg.adaln_curve_grid > 0
    base_files = quantized_view(CheckpointFiles(base_info.path, reader), work_device)
    base_map, base_plan = match_layout(
        base_files, list(meta_shapes(H3DiT, cfg)), layouts(cfg, base_info.qkv_interleaved), DIT
    )
    planned = {
        key: _Planned(base_files, sources, combine, keeps_fp32(key, curve))
        for key, (sources, combine) in base_plan.items()
    }
    layout = base_map.name + (" (pruned AdaLN curves)" if curve else "")
    if branch_info is not None:
        branch_files = quantized_view(CheckpointFiles(branch_info.path, reader), work_device)
        branch_map, branch_plan = match_layout(
            branch_files, list(meta_shapes(BranchWeights, cfg)), branch_layouts(), BRANCH
        )
        for key, (sources, combine) in branch_plan.items():
            planned["blocks." + key.removeprefix("transformer_blocks.")] = _Planned(
                branch_files, sources, combine, False
            )
        layout += f" + {branch_map.name}"
    expected = set(model.state_dict())
    if set(planned) != expected:  # the key maps and the model disagree: a bug here, not in the file
        raise AssertionError(f"planned keys differ from the model's: {sorted(set(planned) ^ expected)[:_SHOW]}")
    return planned, layout


def _read_planned(key: str, entry: _Planned, shape: tuple[int, ...]) -> torch.Tensor:
    """One model tensor as the key map builds it (dequantised where the file is quantised), on the CPU."""
    tensors = [entry.files.get(s) for s in entry.sources]
    value = tensors[0] if entry.combine is None else entry.combine(tensors)
    if tuple(value.shape) != tuple(shape):
        raise H3InputError(
            f"{entry.files.path}: key {entry.sources[0]!r} has shape {tuple(value.shape)}, the model "
            f"needs {tuple(shape)} for {key!r}"
        )
    return value


@dataclass
class _Context:
    """What every layer of one load is built with."""

    model: H3DiT
    planned: dict
    shapes: dict
    device: torch.device
    dtype: torch.dtype
    work: torch.device  # where dequantising, merging and requantising run

    def read(self, key: str, dtype: torch.dtype, device=None) -> torch.Tensor:
        value = _read_planned(key, self.planned[key], self.shapes[key])
        return value.to(device=device or self.device, dtype=dtype)

    def merged_fp32(self, name: str, linear: nn.Linear, bias, lora_updates) -> torch.Tensor:
        """``name``'s weight read in fp32 on the work device with ``lora_updates`` (``(source, deltas)``) merged
        in order; ``linear`` holds it (and ``bias``) while ``merge_lora`` runs."""
        linear.weight = nn.Parameter(self.read(f"{name}.weight", torch.float32, self.work), requires_grad=False)
        linear.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        for source, deltas in lora_updates:
            merge_lora(self.model, deltas, source=source)
        return linear.weight.detach()


def load_layers(
    model: H3DiT,
    base_info,
    branch_info,
    loras,
    *,
    device,
    dtype: torch.dtype,
    linears: str,
    held: str = "auto",
    run_device=None,
) -> None:
    """Fill ``model`` (``meta_model``, LoRAs already checked against it) from the described checkpoints, the
    layers built one at a time (module docstring), and merge ``loras`` (``(source, deltas)`` in merge order).
    Sets ``model.layout``, ``model.linears`` (one line for the user), ``model.fp8_layers`` and
    ``model.quantized_layers`` (each such layer's name → how it was made). Onto a GPU the files are read straight
    there (``staged_read``)."""
    device = torch.device(device)
    with reader_for(device) as reader:
        _load_layers(model, base_info, branch_info, loras, device, dtype, linears, held, run_device, reader)


def _load_layers(model, base_info, branch_info, loras, device, dtype, linears, held, run_device, reader) -> None:
    run_device = device if run_device is None else torch.device(run_device)
    # comfy-kitchen dequantises on the GPU the model will run on, when there is one
    work = run_device if run_device.type == "cuda" and torch.cuda.is_available() else device
    planned, layout = _plan_keys(model, base_info, branch_info, work, reader)
    names = {id(module): name for name, module in model.named_modules()}
    if linears == "fp8":
        targets = quantization_targets(model, frozenset(FP8_LAYERS))
        build, how_kept = _fp8_layer, None
        _report_requantised(planned, dtype, run_device)
    else:
        targets, build = _quantized_targets(model, planned, names), _quantized_layer
        how_kept = _hold(model, planned, held, dtype, run_device)
    layers = [(names[id(linear)], parent, attribute, linear) for parent, attribute, linear in targets]
    by_layer: dict[str, list[tuple[str, list[LoraDelta]]]] = {name: [] for name, *_ in layers}
    elsewhere = []
    for source, lora_deltas in loras:
        for name in by_layer:
            hits = [d for d in lora_deltas if d.module == name]
            if hits:
                by_layer[name].append((source, hits))
        elsewhere.append((source, [d for d in lora_deltas if d.module not in by_layer]))
    shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    own_keys = {f"{name}.{p}" for name, *_ in layers for p in ("weight", "bias")} & set(shapes)
    if reader is not None:
        reader.expect(_expected_reads(planned, own_keys, layers if linears == "fp8" else [], by_layer))
    state = {}
    for key, entry in planned.items():
        if key in own_keys:
            continue
        value = _read_planned(key, entry, shapes[key])
        target = torch.float32 if entry.fp32 else dtype
        state[key] = value.to(device=device, dtype=target if value.is_floating_point() else value.dtype)
        del value
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.unexpected_keys or set(result.missing_keys) != own_keys:
        raise AssertionError(f"layered load left {sorted(set(result.missing_keys) ^ own_keys)[:_SHOW]}")
    del state
    context = _Context(model, planned, shapes, device, dtype, work)
    how = {}
    for name, parent, attribute, linear in layers:
        layer, how[name] = build(context, name, linear, by_layer[name], how_kept)
        setattr(parent, attribute, layer)
        del layer
    _check_scales(model, planned, [name for name, *_ in layers if how[name] == FROM_FILE])
    for source, lora_deltas in elsewhere:
        if lora_deltas:
            merge_lora(model, lora_deltas, source=source)
    model.layout = layout
    model.fp8_layers = how if linears == "fp8" else {}
    model.quantized_layers = {} if linears == "fp8" else how
    model.linears = _describe_fp8(how) if linears == "fp8" else _describe_held(how, dtype)
    model.eval()


def _check_scales(model: H3DiT, planned: dict, names: list[str]) -> None:
    """The file's scales of the fp8 layers ``names`` (taken as they are) are finite: one check for them all,
    so a load to a GPU waits for the device once rather than once a layer."""
    if not names:
        return
    scales = [model.get_submodule(name).weight_scale for name in names]
    finite = torch.stack([torch.isfinite(scale).all() for scale in scales]).tolist()
    bad = [name for name, ok in zip(names, finite) if not ok]
    if bad:
        path = planned[f"{bad[0]}.weight"].files.path
        raise H3InputError(
            f"{path}: the fp8 scales of {len(bad)} layer(s) are not finite (first: {bad[0]!r}); the file is "
            "damaged: download it again"
        )


def _expected_reads(planned: dict, own_keys: set, fp8_layers: list, by_layer: dict) -> list[tuple]:
    """The file ranges the load reads through its reader, in the order it reads them (``StagedReader.expect``):
    every key outside the layers, then each fp8 layer's bias and its weight's codes and scale. Layers built
    otherwise (LoRAs merged, comfy-kitchen's formats) are left out: their reads are simply not read ahead."""
    keys = [(entry.files, source) for key, entry in planned.items() if key not in own_keys for source in entry.sources]
    for name, *_ in fp8_layers:
        if by_layer[name]:
            continue
        for key in (f"{name}.bias", f"{name}.weight"):
            if key in planned:
                keys += [(planned[key].files, source) for source in planned[key].sources]
    return spans_of(keys)


def _target_dtype(context: _Context, key: str) -> torch.dtype:
    return torch.float32 if context.planned[key].fp32 else context.dtype


def _bias(context: _Context, name: str):
    key = f"{name}.bias"
    return context.read(key, _target_dtype(context, key)) if key in context.planned else None


@torch.no_grad()
def _fp8_layer(context: _Context, name: str, linear: nn.Linear, lora_updates, _how_kept) -> tuple[Fp8Linear, str]:
    """One of the ``FP8_LAYERS`` as an ``Fp8Linear`` and how it was made: the file's codes as they are, or its
    weight read in fp32, merged with ``lora_updates`` (``(source, deltas)`` in merge order) and quantised."""
    weight_key = f"{name}.weight"
    entry, bias = context.planned[weight_key], _bias(context, name)
    if lora_updates:
        why = "LoRA merged"
    else:
        found = layer_codes(entry.files, entry.sources, entry.combine, context.shapes[weight_key])
        if isinstance(found, LayerCodes):
            layer = Fp8Linear.from_scaled(
                found.codes.to(context.device), found.scale, bias, context.dtype, check_finite=False
            )
            return layer, FROM_FILE
        why = found
    context.merged_fp32(name, linear, bias, lora_updates)
    layer = Fp8Linear.from_linear(linear, context.dtype).to(context.device)
    linear.weight = nn.Parameter(torch.empty(context.shapes[weight_key], device="meta"), requires_grad=False)
    return layer, f"{AT_LOAD} ({why})"


def _views(planned: dict) -> list[QuantizedView]:
    return list({id(e.files): e.files for e in planned.values() if isinstance(e.files, QuantizedView)}.values())


def _report_requantised(planned: dict, dtype, run_device) -> None:
    """The one log line per file of a ``linears="fp8"`` load whose files quantise layers in another format."""
    for view in _views(planned):
        quants = [q for q in view.layers.values() if not q.format.startswith("float8")]
        why = f"linears='fp8' requantises the big linears to e4m3 and holds the rest in {_short(dtype)}"
        if quants:
            hold_layers(view.path, quants, "dequantize", dtype, run_device, {q.weight: why for q in quants})


def _quantized_targets(model: H3DiT, planned: dict, names: dict) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) for every ``nn.Linear`` whose weight its file quantises."""
    targets = []
    for parent in model.modules():
        for attribute, child in parent.named_children():
            if not isinstance(child, nn.Linear):
                continue
            entry = planned[f"{names[id(child)]}.weight"]
            if isinstance(entry.files, QuantizedView) and any(entry.files.quant(s) for s in entry.sources):
                targets.append((parent, attribute, child))
    return targets


def _hold(model: H3DiT, planned: dict, held: str, dtype, run_device) -> dict:
    """Decide, per file, which quantised layers stay comfy-kitchen layers (one log line per file); returns the
    weight keys kept, each with its ``LayerQuant``."""
    kept = {}
    for view in _views(planned):
        plan = {key: (e.sources, e.combine) for key, e in planned.items() if e.files is view}
        fp32 = {key for key, e in planned.items() if e.fp32}
        candidates, forced, quants = quantized_plan(model, plan, view, fp32.__contains__)
        holding = hold_layers(view.path, quants, held, dtype, run_device, forced)
        kept.update({key: (quant, holding) for key, quant in candidates.items() if quant.weight in holding.kept})
    return kept


@torch.no_grad()
def _quantized_layer(context: _Context, name: str, linear: nn.Linear, lora_updates, kept: dict):
    """A linear whose weight its file quantises, as ``_hold`` decided: the file's codes as a comfy-kitchen
    weight, or the weight comfy-kitchen dequantises; with LoRAs, merged in fp32 first (module docstring)."""
    weight_key = f"{name}.weight"
    entry, bias = context.planned[weight_key], _bias(context, name)
    shape = context.shapes[weight_key]
    if weight_key in kept:
        quant, holding = kept[weight_key]
        if not lora_updates:
            weight, how = holding.kitchen_weight(entry.files, quant, context.device, shape), KEPT
        else:
            merged = context.merged_fp32(name, linear, bias, lora_updates)
            like = kitchen_tensor(entry.files, quant, context.dtype, context.work, shape)
            weight, how = requantize(like, merged, context.dtype).to(context.device), REQUANTISED
    elif lora_updates:
        weight = context.merged_fp32(name, linear, bias, lora_updates)
        weight, how = weight.to(context.device, _target_dtype(context, weight_key)), "dequantised, LoRA merged in fp32"
    else:
        weight, how = context.read(weight_key, _target_dtype(context, weight_key)), "dequantised"
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    return linear, how


def _layers(count: int) -> str:
    return f"{count} layer" + ("" if count == 1 else "s")


def _describe_fp8(how: dict[str, str]) -> str:
    """One line for the user from each fp8 layer's origin."""
    from_file = sum(v == FROM_FILE for v in how.values())
    at_load = len(how) - from_file
    if not at_load:
        return f"fp8 ({FROM_FILE})"
    if not from_file:
        return f"fp8 ({AT_LOAD})"
    return f"fp8 ({FROM_FILE}: {_layers(from_file)}; {AT_LOAD}: {_layers(at_load)})"


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe_held(how: dict[str, str], dtype: torch.dtype) -> str:
    """One line for the user from each quantised layer's origin, e.g. "bfloat16; quantised layers: kept as a
    comfy-kitchen layer: 200 layers"."""
    counts: dict[str, int] = {}
    for value in how.values():
        counts[value] = counts.get(value, 0) + 1
    parts = "; ".join(f"{value}: {_layers(n)}" for value, n in counts.items())
    return f"{_short(dtype)}; quantised layers: {parts}"
