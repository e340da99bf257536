"""The DiT's one entry point: say what a checkpoint is from its header, then load H3 or VDN-H3 with LoRAs.

It composes what exists: ``CheckpointFiles`` and ``match_layout`` (keymap), ``fp8_scaled_view``,
``load_dit`` / ``curve_grid`` / ``layouts`` (models.dit), ``load_vdn`` / ``branch_layouts`` (models.vdn) and
``read_lora`` / ``merge_lora`` (lora). The key maps decide every layout; this module adds what the keys
alone cannot say (official shards or ComfyUI's file, base or branch, a complete set of shards) and checks a
checkpoint's shapes against the model before any weight is read.

How a path is recognised (``describe_dit_checkpoint``):
  * a missing path is refused, and so are GGUF and anything that is neither a ``.safetensors`` file nor a
    folder of them (``CheckpointFiles``);
  * a folder with no ``.safetensors`` of its own but a ``transformer/`` subfolder (the official per-task
    folder ``FL2VA/`` or ``Ref2VA/``, or a diffusers root, whose ``transformer/`` is FL2VA) is read from
    ``transformer/``;
  * a folder's shards must be complete: when it has a ``*.safetensors.index.json``, exactly the files that
    index names; shards named ``*-0000k-of-0000n.safetensors`` must number n; a single such shard of
    several is refused, asking for its folder;
  * a VDN-H3 linear-branch file holds keys that a branch layout reads (``transformer_blocks.{i}.attn.
    softmax_gate`` ...) and none that a DiT layout reads; anything else is described as a base DiT;
  * the layout is the key map whose keys the file fits exactly: ComfyUI (native names, with or without
    ``model.diffusion_model.``) or diffusers; a quantized file (int8 convrot, nvfp4, ...) or one that fits
    no map is refused naming the file, the layout it came closest to and its first offending keys;
  * **official shards**: native names without a prefix, in a folder. Their keys and shapes equal ComfyUI's;
    only their ``qkv_proj`` rows differ (interleaved per head), which no header shows. What does differ is
    the packaging: ComfyUI ships one file per model (``diffusion_models/minimax_h3_*.safetensors``), the
    official release a ``transformer/`` folder of shards. A native single file is therefore read as
    ComfyUI's, a native folder as the official shards; ``qkv_interleaved=True/False`` overrides the rule
    (a consolidated official file, or ComfyUI's file in a folder of its own);
  * pruned (AdaLN curves): an ``adaln_t_table`` ``[grid, width]``; fp8-scaled: every fp8 weight has its
    scale (ComfyUI's ``comfy_quant`` form or the older ``scaled_fp8`` one); both still load.
Describing reads headers only (and the few-byte JSON ``comfy_quant`` sidecars of ComfyUI-quantized files),
including every tensor's shape, checked against the model the config builds: a 66 GB file is described
in well under a second, and a file for another model size is refused before anything is loaded.

How the big linears are held (``load_h3_model(linears=...)``): "dtype" puts every weight in ``dtype`` (an
fp8-scaled file dequantised as it is read); "fp8" makes the ``FP8_LAYERS`` (qkv_proj, out_proj, fc1, fc2,
to_out_linear, the refiner's included) ``Fp8Linear`` layers computing in ``dtype``, one layer at a time:
  * a layer no LoRA touches whose weight the file stores in e4m3 with a scale per tensor or per row takes the
    file's codes and scales as they are, re-laid out by the layout's rule (``fp8_scaled.layer_codes``: the
    official shards' qkv interleave, diffusers' q, k, v and FFN halves, each source's scale spread to its
    rows), so the layer's ``codes · scale`` is bit for bit the file's dequantised weight;
  * any other layer (touched by a LoRA, not fp8 in the file, e5m2, or a layout that cannot keep the codes
    exact) is read in fp32 (dequantised where the file is fp8), has its LoRA updates merged in fp32, in
    order, and is quantised with ``Fp8Linear.from_linear``: LoRAs always merge before quantisation.
Only one layer's weight is ever held in fp32 at a time; everything else goes, memory-mapped, straight to
the target device as the "dtype" path does.
"""

from __future__ import annotations

import json
import math
import os
import numbers
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence, Union

import torch
import torch.nn as nn

from .errors import H3InputError
from .fp8_linear import FP8_LAYERS, Fp8Linear, quantization_targets
from .fp8_scaled import LayerCodes, fp8_scaled_view, layer_codes
from .keymap import CheckpointFiles, KeyMap, match_layout
from .lora import LoraDelta, merge_lora, read_lora
from .models.dit import DiTConfig, H3DiT, curve_grid, keeps_fp32, layouts, load_dit, native_layout
from .models.vdn import BranchWeights, branch_layouts, load_vdn
from .sizes import sizes_from_metadata

__all__ = ["DiTCheckpointInfo", "LoraSpec", "MergedLora", "LINEARS", "describe_dit_checkpoint", "load_h3_model"]

DIT = "MiniMax H3 DiT"
BRANCH = "VDN-H3 linear branch"
LOAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
LINEARS = ("dtype", "fp8")
FP8_COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FROM_FILE, AT_LOAD = "codes from the file", "quantised at load"
_SHARD_NAME = re.compile(r".+-(?P<k>\d{5})-of-(?P<n>\d{5})\.safetensors")
_ADAPTER_KEY = re.compile(r".+\.lora_[AB]\.(?P<adapter>[^.]+)\.weight")
_SHOW = 5


@dataclass(frozen=True)
class DiTCheckpointInfo:
    """What a DiT checkpoint is, read from its headers.

    ``path`` is where the weights are (a task folder resolved to its ``transformer/``), ``files`` its
    safetensors files. ``layout`` is the key map's name: "ComfyUI", "diffusers" or "official" for a base
    model, "VDN-H3 v2" or "VDN-H3 pre-v2" for a branch file; ``key_prefix`` is the prefix every key carries
    ("" or "model.diffusion_model."). ``curve`` is the pruned form's ``(grid, width)``, None for the full
    form. ``cfg`` is the config the weights fit (the given one, with the curve's grid and width)."""

    path: Path
    files: tuple[Path, ...]
    is_branch: bool
    layout: str
    key_prefix: str
    qkv_interleaved: bool
    curve: tuple[int, int] | None
    fp8_scaled: bool
    cfg: DiTConfig

    @property
    def pruned(self) -> bool:
        return self.curve is not None

    def summary(self) -> str:
        """One line for a user: what the file is, as the loader will read it."""
        kind = BRANCH if self.is_branch else DIT
        parts = [f"{kind}, {self.layout} layout"]
        if self.key_prefix:
            parts.append(f"keys under '{self.key_prefix}'")
        if self.qkv_interleaved:
            parts.append("qkv interleaved per head")
        if self.curve is not None:
            parts.append(f"pruned (AdaLN curves, grid {self.curve[0]} x width {self.curve[1]})")
        if self.fp8_scaled:
            parts.append("fp8-scaled")
        return ", ".join(parts) + f", {len(self.files)} file(s)"


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA to merge: its file (or a peft adapter folder holding ``adapter_model.safetensors``), the
    strength it merges at, and which adapter of a peft file (None: the file's only one)."""

    path: Path
    strength: float = 1.0
    adapter: str | None = None


@dataclass(frozen=True)
class MergedLora:
    """A LoRA ``load_h3_model`` merged and how many of the model's weights it changed."""

    lora: LoraSpec
    weights: int


LoraInput = Union[LoraSpec, tuple, list]


def describe_dit_checkpoint(path, *, cfg: DiTConfig | None = None,
                            qkv_interleaved: bool | None = None) -> DiTCheckpointInfo:
    """What the checkpoint at ``path`` is (module docstring for the rules), from its headers only.

    Args:
        path: a ``.safetensors`` file, a folder of shards, or a folder with a ``transformer/`` subfolder.
        cfg: the model's sizes; key names and shapes are checked against it. Default: the sizes in the
            file's metadata (``h3_core.sizes``), else the released model.
        qkv_interleaved: None decides by the rule (a native folder is the official shards); True or False
            says it, for native names without a prefix only. A branch file ignores it.
    Returns:
        A ``DiTCheckpointInfo``. Raises ``H3InputError`` for anything the loader would refuse.
    """
    where = _resolve(Path(path))
    files = CheckpointFiles(where)
    cfg = replace(cfg or sizes_from_metadata(files.metadata, DiTConfig, where) or DiTConfig(), hybrid=False)
    view = fp8_scaled_view(files)
    curve = curve_grid(files)
    if curve is not None:
        cfg = replace(cfg, adaln_curve_grid=curve[0], time_embed=curve[1])
    base_targets, branch_targets = _meta_shapes(H3DiT, cfg), _meta_shapes(BranchWeights, cfg)
    is_branch = _is_branch_file(view.keys, base_targets, branch_targets, cfg)
    if is_branch:
        targets, keymaps, what, interleaved = branch_targets, branch_layouts(), BRANCH, False
    else:
        targets, what = base_targets, DIT
        native, _ = match_layout(view, list(targets), layouts(cfg), what)
        interleaved = _official_shards(native, where, qkv_interleaved)
        keymaps = layouts(cfg, interleaved)
    keymap, plan = match_layout(view, list(targets), keymaps, what)
    _check_header_shapes(view, keymap, plan, targets, what, cfg)
    return DiTCheckpointInfo(path=where, files=tuple(files.files), is_branch=is_branch, layout=keymap.name,
                             key_prefix=keymap.prefix, qkv_interleaved=interleaved, curve=curve,
                             fp8_scaled=view is not files, cfg=cfg)


def load_h3_model(base, *, branch=None, loras: Sequence[LoraInput] = (), device="cpu",
                  dtype: torch.dtype = torch.bfloat16, cfg: DiTConfig | None = None,
                  qkv_interleaved: bool | None = None, linears: str = "dtype") -> H3DiT:
    """MiniMax H3 (``base`` alone) or VDN-H3 (``base`` + ``branch``) with ``loras`` merged, in order.

    Every input is checked first (paths, strengths, both checkpoints' headers, the LoRA files), so a bad
    input fails before gigabytes are read. With ``linears="dtype"`` the base loads through ``load_dit`` (or
    ``load_vdn`` with a branch) in any layout ``describe_dit_checkpoint`` accepts; each LoRA then merges
    through ``merge_lora``: ``W += strength · (alpha / rank) · B @ A`` computed in fp32 and stored in W's
    dtype, one LoRA after the other, so with bf16 weights the order given is the rounding order; every
    weight is in ``dtype`` (fp32 islands in fp32). With ``linears="fp8"`` the same tensors load, except that
    the ``FP8_LAYERS`` become ``Fp8Linear`` layers computing in ``dtype``, layer by layer (module docstring):
    a layer no LoRA touches keeps an fp8-scaled file's e4m3 codes and scales as they are; any other is read
    in fp32, merged with its LoRA updates in fp32 (in the order given) and then quantised, so LoRAs always
    merge before quantisation. With ``"fp8"`` the LoRAs are also checked against the model before any
    weight is read.

    Args:
        base: the H3 DiT checkpoint (file or folder). branch: VDN-H3's ``linear_branch/model.safetensors``.
        loras: ``(path, strength)`` or ``(path, strength, adapter)`` tuples or ``LoraSpec``s; ``path`` a LoRA
            ``.safetensors`` file or a peft adapter folder, ``strength`` any finite number.
        device, dtype: where and in which dtype (bf16, fp16, fp32 or fp64) the weights are placed; with
            ``linears="fp8"`` the fp8 layers' compute dtype (bf16, fp16 or fp32).
        cfg: the model's sizes (default: released). qkv_interleaved: as ``describe_dit_checkpoint``.
        linears: "dtype" (every weight in ``dtype``) or "fp8" (the big linears in e4m3). Default: "dtype".
    Returns:
        The model in eval mode, with ``layout`` (as the loaders set it), ``checkpoint`` and
        ``branch_checkpoint`` (``DiTCheckpointInfo``, the latter None without a branch), ``merged_loras`` (a
        tuple of ``MergedLora`` in merge order), ``linears`` (one line for the user: "dtype (bfloat16)",
        "fp8 (codes from the file)", "fp8 (quantised at load)" or, mixed, "fp8 (codes from the file: n
        layers; quantised at load: m layers)") and ``fp8_layers`` (each fp8 layer's name → "codes from the
        file" or "quantised at load (why)"; empty with "dtype").
    """
    _check_dtype(dtype)
    _check_linears(linears, dtype)
    base_info = _describe_role("base", base, cfg, qkv_interleaved, want_branch=False)
    branch_info = None if branch is None else _describe_role("branch", branch, cfg, None, want_branch=True)
    if not isinstance(loras, (list, tuple)):
        raise H3InputError(f"loras: expected a list of (path, strength) or (path, strength, adapter), got {loras!r}")
    read = [_read_lora_input(i, entry) for i, entry in enumerate(loras)]
    if linears == "fp8":
        model, merged = _load_fp8(base_info, branch_info, read, device, dtype)
    else:
        if branch_info is None:
            model = load_dit(base_info.path, device=device, dtype=dtype, cfg=base_info.cfg,
                             qkv_interleaved=base_info.qkv_interleaved)
        else:
            # base_info.cfg carries a pruned base's curve size, which load_vdn needs to build the hybrid model
            model = load_vdn(base_info.path, branch_info.path, device=device, dtype=dtype, cfg=base_info.cfg,
                             qkv_interleaved=base_info.qkv_interleaved)
        merged = []
        for i, (spec, lora_deltas) in enumerate(read):
            source = f"loras[{i}] ({spec.path})"
            _check_lora_hits(model, lora_deltas, source)
            merged.append(MergedLora(spec, merge_lora(model, lora_deltas, source=source)))
        model.linears, model.fp8_layers = f"dtype ({str(dtype).removeprefix('torch.')})", {}
    model.checkpoint, model.branch_checkpoint, model.merged_loras = base_info, branch_info, tuple(merged)
    return model


def _check_linears(linears, dtype) -> None:
    if not isinstance(linears, str) or linears not in LINEARS:
        raise H3InputError(f"linears: got {linears!r}; allowed: 'dtype' (every weight in dtype) or 'fp8' (the big "
                           f"linears as e4m3 codes with a scale per output channel)")
    if linears == "fp8" and not any(dtype is allowed for allowed in FP8_COMPUTE_DTYPES):
        raise H3InputError(f"dtype: got {dtype!r} with linears='fp8'; fp8 layers compute in "
                           f"{', '.join(str(d) for d in FP8_COMPUTE_DTYPES)}")


@dataclass(frozen=True)
class _Planned:
    """How one key of the model is read: from which (possibly dequantising) files, which file keys, combined
    how, and whether it is an fp32 island."""

    files: object
    sources: tuple[str, ...]
    combine: object
    fp32: bool


def _plan_keys(model: H3DiT, base_info: DiTCheckpointInfo, branch_info: DiTCheckpointInfo | None) -> tuple[dict, str]:
    """Every key of ``model`` (built on meta) with how it is read, and the layout's name as ``load_dit`` /
    ``load_vdn`` give it."""
    cfg = base_info.cfg
    curve = cfg.adaln_curve_grid > 0
    base_files = fp8_scaled_view(CheckpointFiles(base_info.path))
    base_map, base_plan = match_layout(base_files, list(_meta_shapes(H3DiT, cfg)),
                                       layouts(cfg, base_info.qkv_interleaved), DIT)
    planned = {key: _Planned(base_files, sources, combine, keeps_fp32(key, curve))
               for key, (sources, combine) in base_plan.items()}
    layout = base_map.name + (" (pruned AdaLN curves)" if curve else "")
    if branch_info is not None:
        branch_files = fp8_scaled_view(CheckpointFiles(branch_info.path))
        branch_map, branch_plan = match_layout(branch_files, list(_meta_shapes(BranchWeights, cfg)),
                                               branch_layouts(), BRANCH)
        for key, (sources, combine) in branch_plan.items():
            planned["blocks." + key.removeprefix("transformer_blocks.")] = _Planned(branch_files, sources, combine,
                                                                                    False)
        layout += f" + {branch_map.name}"
    expected = set(model.state_dict())
    if set(planned) != expected:  # the key maps and the model disagree: a bug here, not in the file
        raise AssertionError(f"planned keys differ from the model's: {sorted(set(planned) ^ expected)[:_SHOW]}")
    return planned, layout


def _read_planned(key: str, entry: _Planned, shape: tuple[int, ...]) -> torch.Tensor:
    """One model tensor as the key map builds it (dequantised where the file is fp8), on the CPU."""
    tensors = [entry.files.get(s) for s in entry.sources]
    value = tensors[0] if entry.combine is None else entry.combine(tensors)
    if tuple(value.shape) != tuple(shape):
        raise H3InputError(f"{entry.files.path}: key {entry.sources[0]!r} has shape {tuple(value.shape)}, the model "
                           f"needs {tuple(shape)} for {key!r}")
    return value


def _load_fp8(base_info: DiTCheckpointInfo, branch_info: DiTCheckpointInfo | None, read, device, dtype):
    """``load_h3_model(linears="fp8")``: the model with its ``FP8_LAYERS`` as ``Fp8Linear`` (module docstring)
    and the LoRAs merged; returns ``(model, merged)``."""
    cfg = replace(base_info.cfg, hybrid=branch_info is not None)
    with torch.device("meta"):
        # .to("meta"): the LoRA check below needs every weight on meta, even where torch.empty is wrapped (the
        # device context then misses it and builds on the CPU)
        model = H3DiT(cfg).to("meta")
    planned, layout = _plan_keys(model, base_info, branch_info)
    names = {id(module): name for name, module in model.named_modules()}
    layers = [(names[id(linear)], parent, attribute, linear)
              for parent, attribute, linear in quantization_targets(model, frozenset(FP8_LAYERS))]
    merged = _check_loras_on_meta(model, read)
    by_layer: dict[str, list[tuple[str, list[LoraDelta]]]] = {name: [] for name, *_ in layers}
    elsewhere = []
    for i, (spec, lora_deltas) in enumerate(read):
        source = f"loras[{i}] ({spec.path})"
        for name in by_layer:
            hits = [d for d in lora_deltas if d.module == name]
            if hits:
                by_layer[name].append((source, hits))
        elsewhere.append((source, [d for d in lora_deltas if d.module not in by_layer]))
    shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    fp8_keys = {f"{name}.{p}" for name, *_ in layers for p in ("weight", "bias")} & set(shapes)
    state = {}
    for key, entry in planned.items():
        if key in fp8_keys:
            continue
        value = _read_planned(key, entry, shapes[key])
        target = torch.float32 if entry.fp32 else dtype
        state[key] = value.to(device=device, dtype=target if value.is_floating_point() else value.dtype)
        del value
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.unexpected_keys or set(result.missing_keys) != fp8_keys:
        raise AssertionError(f"fp8 load left {sorted(set(result.missing_keys) ^ fp8_keys)[:_SHOW]}")
    del state
    how = {}
    for name, parent, attribute, linear in layers:
        layer, how[name] = _fp8_layer(model, name, linear, planned, shapes, by_layer[name], device, dtype)
        setattr(parent, attribute, layer)
        del layer
    for source, lora_deltas in elsewhere:
        if lora_deltas:
            merge_lora(model, lora_deltas, source=source)
    model.layout, model.fp8_layers = layout, how
    model.linears = _describe_linears(how)
    return model.eval(), merged


def _check_loras_on_meta(model: H3DiT, read) -> list[MergedLora]:
    """Every LoRA checked against ``model`` while it is still on the meta device: each ``merge_lora`` check
    runs, on meta copies of the updates, so a bad LoRA is refused before any weight is read."""
    merged = []
    for i, (spec, lora_deltas) in enumerate(read):
        source = f"loras[{i}] ({spec.path})"
        _check_lora_hits(model, lora_deltas, source)
        on_meta = [replace(d, down=torch.empty_like(d.down, device="meta"), up=torch.empty_like(d.up, device="meta"))
                   for d in lora_deltas]
        merged.append(MergedLora(spec, merge_lora(model, on_meta, source=source)))
    return merged


@torch.no_grad()
def _fp8_layer(model: H3DiT, name: str, linear: nn.Linear, planned: dict, shapes: dict, lora_updates, device,
               dtype) -> tuple[Fp8Linear, str]:
    """One of the ``FP8_LAYERS`` as an ``Fp8Linear`` and how it was made: the file's codes as they are, or its
    weight read in fp32, merged with ``lora_updates`` (``(source, deltas)`` in merge order) and quantised."""
    weight_key, bias_key = f"{name}.weight", f"{name}.bias"
    entry = planned[weight_key]
    bias = None
    if bias_key in planned:
        bias = _read_planned(bias_key, planned[bias_key], shapes[bias_key]).to(device=device, dtype=dtype)
    if lora_updates:
        why = "LoRA merged"
    else:
        found = layer_codes(entry.files, entry.sources, entry.combine, shapes[weight_key])
        if isinstance(found, LayerCodes):
            return Fp8Linear.from_scaled(found.codes.to(device), found.scale, bias, dtype), FROM_FILE
        why = found
    weight = _read_planned(weight_key, entry, shapes[weight_key]).to(device=device, dtype=torch.float32)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    del weight
    for source, deltas in lora_updates:
        merge_lora(model, deltas, source=source)
    layer = Fp8Linear.from_linear(linear, dtype)
    linear.weight = nn.Parameter(torch.empty(shapes[weight_key], device="meta"), requires_grad=False)
    return layer, f"{AT_LOAD} ({why})"


def _describe_linears(how: dict[str, str]) -> str:
    """One line for the user from each fp8 layer's origin."""
    from_file = sum(v == FROM_FILE for v in how.values())
    at_load = len(how) - from_file
    if not at_load:
        return f"fp8 ({FROM_FILE})"
    if not from_file:
        return f"fp8 ({AT_LOAD})"
    return f"fp8 ({FROM_FILE}: {_layers(from_file)}; {AT_LOAD}: {_layers(at_load)})"


def _layers(count: int) -> str:
    return f"{count} layer" + ("" if count == 1 else "s")


def _resolve(path: Path) -> Path:
    """The file or folder holding the weights: a task folder's ``transformer/``, shard sets checked."""
    if not path.exists():
        raise H3InputError(f"{path}: no such file or folder")
    if path.is_dir() and not any(path.glob("*.safetensors")) and (path / "transformer").is_dir():
        path = path / "transformer"
    _check_shard_set(path)
    return path


def _check_shard_set(path: Path) -> None:
    """Refuse an incomplete or mixed set of shards naming the files, which the missing keys would say less
    clearly."""
    if path.is_file():
        m = _SHARD_NAME.fullmatch(path.name)
        if m and int(m["n"]) > 1:
            raise H3InputError(f"{path}: one shard of {int(m['n'])}; give the folder {path.parent} that holds them all")
        return
    present = {f.name for f in path.glob("*.safetensors")}
    for index in sorted(path.glob("*.safetensors.index.json")):
        try:
            listed = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise H3InputError(f"{index}: not a safetensors index (a JSON object with a 'weight_map')") from None
        if listed - present:
            raise H3InputError(f"{path}: {index.name} names shards the folder lacks, first "
                               f"{sorted(listed - present)[:_SHOW]}; the download is incomplete")
        if present - listed:
            raise H3InputError(f"{path}: holds .safetensors files {index.name} does not name, first "
                               f"{sorted(present - listed)[:_SHOW]}; move them out of the folder")
    totals = [int(m["n"]) for m in map(_SHARD_NAME.fullmatch, present) if m]
    if totals and (len(set(totals)) > 1 or len(totals) != totals[0]):
        raise H3InputError(f"{path}: holds {len(totals)} shards named '-of-' totals {sorted(set(totals))}; "
                           f"the set is incomplete or mixed")


def _meta_shapes(build, cfg: DiTConfig) -> dict[str, tuple[int, ...]]:
    """The state-dict shapes of ``build(cfg)``, built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        module = build(cfg)
    return {key: tuple(value.shape) for key, value in module.state_dict().items()}


def _source_keys(keymaps: Sequence[KeyMap], targets) -> set[str]:
    """Every file key any of ``keymaps`` would read for ``targets``."""
    return {source for keymap in keymaps for key in targets for source in keymap.sources_for(key)[0]}


def _is_branch_file(keys: set[str], base_targets, branch_targets, cfg: DiTConfig) -> bool:
    """A branch file holds keys a branch layout reads and none that a DiT layout reads."""
    base_keys = _source_keys(layouts(cfg), base_targets)
    return bool(keys & _source_keys(branch_layouts(), branch_targets)) and not keys & base_keys


def _official_shards(native: KeyMap, where: Path, override: bool | None) -> bool:
    """Whether a base checkpoint whose keys fit ``native`` is the official shards (module docstring)."""
    unprefixed_native = native == native_layout()
    if override is None:
        return unprefixed_native and where.is_dir()
    if override and not unprefixed_native:
        under = f" under '{native.prefix}'" if native.prefix else ""
        raise H3InputError(f"{where}: qkv_interleaved=True is for native names without a prefix (the official "
                           f"shards); this checkpoint is in the {native.name} layout{under}")
    return bool(override)


def _check_header_shapes(files, keymap: KeyMap, plan, expected, what: str, cfg: DiTConfig) -> None:
    """Every target's shape as the header gives it, passed through the key map's ``combine`` on meta tensors,
    so a checkpoint for another model size is refused before any weight is read."""
    wrong = []
    for key, (sources, combine) in plan.items():
        parts = [torch.empty(files.shape(s), device="meta") for s in sources]
        try:
            shape = tuple((parts[0] if combine is None else combine(parts)).shape)
        except RuntimeError:  # a combine that cannot even reshape the stored tensor
            shape = None
        if shape != expected[key]:
            stored = [list(files.shape(s)) for s in sources]
            wrong.append(f"{sources[0]!r} {stored[0] if len(stored) == 1 else stored} for {key!r} "
                         f"{list(expected[key])}")
    if wrong:
        raise H3InputError(
            f"{files.path}: {len(wrong)} tensors do not fit the {what} of this config (hidden {cfg.hidden}, "
            f"{cfg.layers} layers, {cfg.heads} heads of {cfg.head_dim}) in the {keymap.name} layout, first: "
            + "; ".join(wrong[:_SHOW]) + "; is it made for another model size?"
        )


def _describe_role(role: str, path, cfg, qkv_interleaved, *, want_branch: bool) -> DiTCheckpointInfo:
    """``describe_dit_checkpoint`` for one input of ``load_h3_model``, its errors prefixed with the input's
    name, and the kind (base or branch) checked."""
    allowed = "VDN-H3's linear_branch/model.safetensors" if want_branch else \
        "a MiniMax H3 DiT checkpoint (.safetensors file, folder of shards, or a folder with transformer/)"
    if not isinstance(path, (str, os.PathLike)) or not Path(path).exists():
        raise H3InputError(f"{role}: no file or folder at {str(path)!r}; give {allowed}")
    try:
        info = describe_dit_checkpoint(path, cfg=cfg, qkv_interleaved=qkv_interleaved)
    except H3InputError as exc:
        raise H3InputError(f"{role}: {exc}") from None
    if info.is_branch and not want_branch:
        raise H3InputError(f"{role}: {info.path} is a {BRANCH} file, not a DiT; pass it as branch= with the H3 DiT "
                           f"checkpoint as base")
    if want_branch and not info.is_branch:
        raise H3InputError(f"{role}: {info.path} is a {DIT} ({info.layout} layout), not a {BRANCH} file; "
                           f"give {allowed}")
    return info


def _check_dtype(dtype) -> None:
    if not any(dtype is allowed for allowed in LOAD_DTYPES):
        raise H3InputError(f"dtype: got {dtype!r}; allowed: {', '.join(str(d) for d in LOAD_DTYPES)}")


def _read_lora_input(index: int, entry: LoraInput) -> tuple[LoraSpec, list[LoraDelta]]:
    """One ``loras`` entry checked and read, every error naming it (``loras[i]``)."""
    name = f"loras[{index}]"
    spec = _lora_spec(name, entry)
    try:
        return spec, read_lora(spec.path, spec.strength, spec.adapter)
    except H3InputError as exc:
        raise H3InputError(f"{name}: {exc}") from None


def _lora_spec(name: str, entry: LoraInput) -> LoraSpec:
    """One ``loras`` entry checked: an existing safetensors file, a finite strength, an adapter it holds."""
    if isinstance(entry, LoraSpec):
        path, strength, adapter = entry.path, entry.strength, entry.adapter
    elif isinstance(entry, (tuple, list)) and len(entry) in (2, 3):
        path, strength, adapter = (*entry, None)[:3]
    else:
        raise H3InputError(f"{name}: expected (path, strength) or (path, strength, adapter), got {entry!r}")
    path = _lora_file(name, path)
    if isinstance(strength, bool) or not isinstance(strength, numbers.Real) or not math.isfinite(strength):
        raise H3InputError(f"{name} ({path}): strength must be a finite number (1 as trained, 0 merges nothing, "
                           f"negative subtracts), got {strength!r}")
    return LoraSpec(path, float(strength), _check_adapter(name, path, adapter))


def _lora_file(name: str, path) -> Path:
    """The LoRA's safetensors file; a peft adapter folder stands for its ``adapter_model.safetensors``."""
    if not isinstance(path, (str, os.PathLike)):
        raise H3InputError(f"{name}: the path must be a str or Path, got {path!r}")
    path = Path(path)
    if path.is_dir() and (path / "adapter_model.safetensors").is_file():
        return path / "adapter_model.safetensors"
    if not path.is_file():
        raise H3InputError(f"{name}: no LoRA file at '{path}'; give a .safetensors LoRA or a peft adapter folder "
                           f"holding adapter_model.safetensors")
    if path.suffix != ".safetensors":
        raise H3InputError(f"{name}: '{path}' is not a .safetensors file; LoRAs are read from safetensors only")
    return path


def _check_adapter(name: str, path: Path, adapter) -> str | None:
    """The adapter to read: one the file holds. A peft file with several needs the choice made, since their
    pairs share module names and reading them all would mix them."""
    if adapter is not None and not (isinstance(adapter, str) and adapter):
        raise H3InputError(f"{name} ({path}): adapter must be a non-empty name or None, got {adapter!r}")
    try:
        keys = CheckpointFiles(path).keys
    except H3InputError as exc:
        raise H3InputError(f"{name}: {exc}") from None
    held = sorted({m["adapter"] for m in map(_ADAPTER_KEY.fullmatch, keys) if m})
    if adapter is None and len(held) > 1:
        raise H3InputError(f"{name} ({path}): holds the peft adapters {held}; name the one to merge as the third "
                           f"item, e.g. ('{path}', 1.0, {held[0]!r})")
    if adapter is not None and held and adapter not in held:
        raise H3InputError(f"{name} ({path}): has no adapter {adapter!r}; it holds {held}")
    return adapter


def _check_lora_hits(model: torch.nn.Module, deltas: list[LoraDelta], source: str) -> None:
    """Refuse a LoRA none of whose targets this model has: it was made for another model. (A LoRA missing
    only some is refused by ``merge_lora``, naming the first.)"""
    modules = dict(model.named_modules())
    targets = sorted({d.module for d in deltas})
    if not any(t in modules for t in targets):
        raise H3InputError(f"{source}: none of its {len(targets)} target modules is in this model, first "
                           f"{targets[:_SHOW]}; a MiniMax H3 LoRA targets modules such as 'blocks.0.attn.qkv_proj' "
                           f"(native) or 'transformer_blocks.0.attn.to_q' (diffusers)")
