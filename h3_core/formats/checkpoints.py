"""The DiT's one entry point: say what a checkpoint is from its header, then load H3 or VDN-H3 with LoRAs.

It composes what exists: ``CheckpointFiles`` and ``match_layout`` (keymap), ``quantized_view``
(quantized_files), ``curve_grid`` / ``layouts`` (formats.dit), ``branch_layouts`` (formats.vdn), ``load_layers``
(dit_layers) and ``read_lora`` / ``merge_lora`` (lora). The key maps decide every
layout; this module adds what the keys alone cannot say (official shards or ComfyUI's file, base or branch, a
complete set of shards) and checks a checkpoint's shapes against the model before any weight is read.

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
    ``model.diffusion_model.``) or diffusers; one that fits no map is refused naming the file, the layout
    it came closest to and its first offending keys;
  * **official shards**: native names without a prefix, in a folder. Their keys and shapes equal ComfyUI's;
    only their ``qkv_proj`` rows differ (interleaved per head), which no header shows. What does differ is
    the packaging: ComfyUI ships one file per model (``diffusion_models/minimax_h3_*.safetensors``), the
    official release a ``transformer/`` folder of shards. A native single file is therefore read as
    ComfyUI's, a native folder as the official shards; ``qkv_interleaved=True/False`` overrides the rule
    (a consolidated official file, or ComfyUI's file in a folder of its own);
  * pruned (AdaLN curves): an ``adaln_t_table`` ``[grid, width]``;
  * quantised: ComfyUI's per-layer ``comfy_quant`` layers (``h3_core.formats.quantized_files``): fp8-scaled (also the
    older ``scaled_fp8`` form), ``int8_convrot`` (the ``*_int8_convrot`` files, full and pruned), int8
    without rotation, nvfp4; each layer's sidecars are checked against its weight. Another format, or GGUF,
    is refused naming the format, the file and the layer.
Describing reads headers only (and the few-byte JSON ``comfy_quant`` sidecars of ComfyUI-quantized files),
including every tensor's shape, checked against the model the config builds: a 66 GB file is described
in well under a second, and a file for another model size is refused before anything is loaded.

How the big linears are held (``load_h3_model(linears=..., held=...)``): "dtype" puts every weight in
``dtype`` (an fp8-scaled file dequantised as it is read), except that a file quantised in another format
(int8_convrot, nvfp4) keeps its quantised linears as comfy-kitchen layers where comfy-kitchen has kernels for
the run device, else dequantises them (``held``, ``h3_core.formats.kitchen``); "fp8" makes the ``FP8_LAYERS``
``Fp8Linear`` layers computing in ``dtype``. Both build those layers one at a time (``h3_core.formats.dit_layers``),
taking the file's codes as they are where they can and merging LoRAs in fp32 before any (re)quantisation.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence, Union

import torch

from ..errors import H3InputError
from ..models.dit import DiTConfig, H3DiT
from ..models.precision import keeps_fp32
from .dit import curve_grid, layouts, native_layout
from .dit_layers import BRANCH, DIT, load_layers, meta_model, meta_shapes, needs_layers
from .files import CheckpointFiles
from .keymap import KeyMap, load_into, match_layout
from .lora import LoraDelta, merge_lora, read_lora
from .quant_layers import HELD, describe_formats
from .quantized_files import QuantizedView, quantized_view
from .sizes import sizes_from_metadata
from .vdn import BranchWeights, branch_layouts

__all__ = [
    "DiTCheckpointInfo",
    "LoraSpec",
    "MergedLora",
    "LINEARS",
    "describe_dit_checkpoint",
    "load_h3_model",
    "load_branch_weights",
]

LOAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
LINEARS = ("dtype", "fp8")
FP8_COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
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
    form. ``fp8_scaled``: every quantised layer is fp8; ``quantization``: ``(format, layers)`` for each format the
    file's quantised layers are in (``LayerQuant.kind``: "int8_convrot", "nvfp4", "float8_e4m3fn", ...), () for
    a plain file. ``cfg`` is the config the weights fit (the given one, with the curve's grid and width)."""

    path: Path
    files: tuple[Path, ...]
    is_branch: bool
    layout: str
    key_prefix: str
    qkv_interleaved: bool
    curve: tuple[int, int] | None
    fp8_scaled: bool
    cfg: DiTConfig
    quantization: tuple[tuple[str, int], ...] = ()

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
        elif self.quantization:
            parts.append("quantised: " + describe_formats(dict(self.quantization)))
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


def describe_dit_checkpoint(
    path, *, cfg: DiTConfig | None = None, qkv_interleaved: bool | None = None
) -> DiTCheckpointInfo:
    """What the checkpoint at ``path`` is (module docstring for the rules), from its headers only.

    Args:
        path: a ``.safetensors`` file, a folder of shards, or a folder with a ``transformer/`` subfolder.
        cfg: the model's sizes; key names and shapes are checked against it. Default: the sizes in the
            file's metadata (``h3_core.formats.sizes``), else the released model.
        qkv_interleaved: None decides by the rule (a native folder is the official shards); True or False
            says it, for native names without a prefix only. A branch file ignores it.
    Returns:
        A ``DiTCheckpointInfo``. Raises ``H3InputError`` for anything the loader would refuse.
    """
    where = _resolve(Path(path))
    files = CheckpointFiles(where)
    cfg = replace(cfg or sizes_from_metadata(files.metadata, DiTConfig, where) or DiTConfig(), hybrid=False)
    view = quantized_view(files)
    curve = curve_grid(files)
    if curve is not None:
        cfg = replace(cfg, adaln_curve_grid=curve[0], time_embed=curve[1])
    base_targets, branch_targets = meta_shapes(H3DiT, cfg), meta_shapes(BranchWeights, cfg)
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
    formats = view.formats() if isinstance(view, QuantizedView) else {}
    return DiTCheckpointInfo(
        path=where,
        files=tuple(files.files),
        is_branch=is_branch,
        layout=keymap.name,
        key_prefix=keymap.prefix,
        qkv_interleaved=interleaved,
        curve=curve,
        fp8_scaled=bool(formats) and all(k.startswith("float8") for k in formats),
        cfg=cfg,
        quantization=tuple(formats.items()),
    )


def load_h3_model(
    base,
    *,
    branch=None,
    loras: Sequence[LoraInput] = (),
    device="cpu",
    dtype: torch.dtype = torch.bfloat16,
    cfg: DiTConfig | None = None,
    qkv_interleaved: bool | None = None,
    linears: str = "dtype",
    held: str = "auto",
    run_device=None,
) -> H3DiT:
    """MiniMax H3 (``base`` alone) or VDN-H3 (``base`` + ``branch``) with ``loras`` merged, in order.

    Every input is checked first (paths, strengths, both checkpoints' headers, the LoRA files), so a bad
    input fails before gigabytes are read. With ``linears="dtype"`` the base loads through ``_load_dit`` (or
    ``_load_vdn`` with a branch) in any layout ``describe_dit_checkpoint`` accepts; each LoRA then merges
    through ``merge_lora``: ``W += strength · (alpha / rank) · B @ A`` computed in fp32 and stored in W's
    dtype, one LoRA after the other, so with bf16 weights the order given is the rounding order; every
    weight is in ``dtype`` (fp32 islands in fp32). With ``linears="fp8"`` the same tensors load, except that
    the ``FP8_LAYERS`` become ``Fp8Linear`` layers computing in ``dtype``, layer by layer (module docstring):
    a layer no LoRA touches keeps an fp8-scaled file's e4m3 codes and scales as they are; any other is read
    in fp32, merged with its LoRA updates in fp32 (in the order given) and then quantised, so LoRAs always
    merge before quantisation. A file quantised in another format (``*_int8_convrot``, nvfp4) loads layer by
    layer too (``h3_core.formats.dit_layers``), its quantised linears held by ``held``: comfy-kitchen layers (their
    weights comfy-kitchen ``QuantizedTensor``s, ``F.linear`` running the library's matmul) where comfy-kitchen
    has kernels for ``run_device`` and the format, else dequantised by comfy-kitchen into ``dtype`` ("auto");
    always dequantised ("dequantize"); comfy-kitchen layers or ``H3BackendUnavailable`` ("kitchen"). One log
    line per file says which. A LoRA touching such a layer merges in fp32 into its dequantised weight, which is
    then requantised by comfy-kitchen into the file's layout (kept) or rounded to ``dtype``. On that path and
    with ``"fp8"`` the LoRAs are checked against the model before any weight is read.

    Args:
        base: the H3 DiT checkpoint (file or folder). branch: VDN-H3's ``linear_branch/model.safetensors``.
        loras: ``(path, strength)`` or ``(path, strength, adapter)`` tuples or ``LoraSpec``s; ``path`` a LoRA
            ``.safetensors`` file or a peft adapter folder, ``strength`` any finite number.
        device, dtype: where and in which dtype (bf16, fp16, fp32 or fp64) the weights are placed; with
            ``linears="fp8"`` the fp8 layers' compute dtype (bf16, fp16 or fp32).
        cfg: the model's sizes (default: released). qkv_interleaved: as ``describe_dit_checkpoint``.
        linears: "dtype" (every weight in ``dtype``) or "fp8" (the big linears in e4m3). Default: "dtype".
        held: how a quantised file's layers are held with ``linears="dtype"`` (``quantized_files.HELD``).
        run_device: the device the model will run on, which decides ``held="auto"`` (default ``device``): a
            model loaded to the CPU and moved to a GPU later keeps comfy-kitchen layers for that GPU.
    Returns:
        The model in eval mode, with ``layout`` (as the loaders set it), ``checkpoint`` and
        ``branch_checkpoint`` (``DiTCheckpointInfo``, the latter None without a branch), ``merged_loras`` (a
        tuple of ``MergedLora`` in merge order), ``linears`` (one line for the user: "dtype (bfloat16)",
        "fp8 (codes from the file)", "fp8 (quantised at load)" or, mixed, "fp8 (codes from the file: n
        layers; quantised at load: m layers)", for a quantised file "bfloat16; quantised layers: kept as a
        comfy-kitchen layer: n layers; ..."), ``fp8_layers`` (each fp8 layer's name → "codes from the file" or
        "quantised at load (why)"; empty with "dtype") and ``quantized_layers`` (each of a quantised file's
        linears → "kept as a comfy-kitchen layer", "requantised by comfy-kitchen after its LoRA merge",
        "dequantised", "dequantised, LoRA merged in fp32"; empty otherwise).
    """
    _check_dtype(dtype)
    _check_linears(linears, dtype)
    if not isinstance(held, str) or held not in HELD:
        raise H3InputError(
            f"held: got {held!r}; allowed: 'auto' (comfy-kitchen layers where it has kernels for the "
            f"run device, else dequantised), 'dequantize' or 'kitchen'"
        )
    base_info = _describe_role("base", base, cfg, qkv_interleaved, want_branch=False)
    branch_info = None if branch is None else _describe_role("branch", branch, cfg, None, want_branch=True)
    if not isinstance(loras, (list, tuple)):
        raise H3InputError(f"loras: expected a list of (path, strength) or (path, strength, adapter), got {loras!r}")
    read = [_read_lora_input(i, entry) for i, entry in enumerate(loras)]
    if linears == "fp8" or needs_layers(base_info) or needs_layers(branch_info):
        model = meta_model(base_info, branch_info)
        merged = _check_loras_on_meta(model, read)
        named = [(f"loras[{i}] ({spec.path})", lora_deltas) for i, (spec, lora_deltas) in enumerate(read)]
        load_layers(
            model,
            base_info,
            branch_info,
            named,
            device=device,
            dtype=dtype,
            linears=linears,
            held=held,
            run_device=run_device,
        )
    else:
        if branch_info is None:
            model = _load_dit(
                base_info.path, device=device, dtype=dtype, cfg=base_info.cfg, qkv_interleaved=base_info.qkv_interleaved
            )
        else:
            # base_info.cfg carries a pruned base's curve size, which _load_vdn needs to build the hybrid model
            model = _load_vdn(
                base_info.path,
                branch_info.path,
                device=device,
                dtype=dtype,
                cfg=base_info.cfg,
                qkv_interleaved=base_info.qkv_interleaved,
            )
        merged = []
        for i, (spec, lora_deltas) in enumerate(read):
            source = f"loras[{i}] ({spec.path})"
            _check_lora_hits(model, lora_deltas, source)
            merged.append(MergedLora(spec, merge_lora(model, lora_deltas, source=source)))
        model.linears = f"dtype ({str(dtype).removeprefix('torch.')})"
        model.fp8_layers, model.quantized_layers = {}, {}
    model.checkpoint, model.branch_checkpoint, model.merged_loras = base_info, branch_info, tuple(merged)
    return model


def _check_linears(linears, dtype) -> None:
    if not isinstance(linears, str) or linears not in LINEARS:
        raise H3InputError(
            f"linears: got {linears!r}; allowed: 'dtype' (every weight in dtype) or 'fp8' (the big "
            f"linears as e4m3 codes with a scale per output channel)"
        )
    if linears == "fp8" and not any(dtype is allowed for allowed in FP8_COMPUTE_DTYPES):
        raise H3InputError(
            f"dtype: got {dtype!r} with linears='fp8'; fp8 layers compute in "
            f"{', '.join(str(d) for d in FP8_COMPUTE_DTYPES)}"
        )


def _check_loras_on_meta(model: H3DiT, read) -> list[MergedLora]:
    """Every LoRA checked against ``model`` while it is still on the meta device: each ``merge_lora`` check
    runs, on meta copies of the updates, so a bad LoRA is refused before any weight is read."""
    merged = []
    for i, (spec, lora_deltas) in enumerate(read):
        source = f"loras[{i}] ({spec.path})"
        _check_lora_hits(model, lora_deltas, source)
        on_meta = [
            replace(d, down=torch.empty_like(d.down, device="meta"), up=torch.empty_like(d.up, device="meta"))
            for d in lora_deltas
        ]
        merged.append(MergedLora(spec, merge_lora(model, on_meta, source=source)))
    return merged


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
            listed = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise H3InputError(f"{index}: not a safetensors index (a JSON object with a 'weight_map')") from None
        if listed - present:
            raise H3InputError(
                f"{path}: {index.name} names shards the folder lacks, first "
                f"{sorted(listed - present)[:_SHOW]}; the download is incomplete"
            )
        if present - listed:
            raise H3InputError(
                f"{path}: holds .safetensors files {index.name} does not name, first "
                f"{sorted(present - listed)[:_SHOW]}; move them out of the folder"
            )
    totals = [int(m["n"]) for m in map(_SHARD_NAME.fullmatch, present) if m]
    if totals and (len(set(totals)) > 1 or len(totals) != totals[0]):
        raise H3InputError(
            f"{path}: holds {len(totals)} shards named '-of-' totals {sorted(set(totals))}; "
            f"the set is incomplete or mixed"
        )


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
        raise H3InputError(
            f"{where}: qkv_interleaved=True is for native names without a prefix (the official "
            f"shards); this checkpoint is in the {native.name} layout{under}"
        )
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
            wrong.append(
                f"{sources[0]!r} {stored[0] if len(stored) == 1 else stored} for {key!r} {list(expected[key])}"
            )
    if wrong:
        raise H3InputError(
            f"{files.path}: {len(wrong)} tensors do not fit the {what} of this config (hidden {cfg.hidden}, "
            f"{cfg.layers} layers, {cfg.heads} heads of {cfg.head_dim}) in the {keymap.name} layout, first: "
            + "; ".join(wrong[:_SHOW])
            + "; is it made for another model size?"
        )


def _describe_role(role: str, path, cfg, qkv_interleaved, *, want_branch: bool) -> DiTCheckpointInfo:
    """``describe_dit_checkpoint`` for one input of ``load_h3_model``, its errors prefixed with the input's
    name, and the kind (base or branch) checked."""
    allowed = (
        "VDN-H3's linear_branch/model.safetensors"
        if want_branch
        else "a MiniMax H3 DiT checkpoint (.safetensors file, folder of shards, or a folder with transformer/)"
    )
    if not isinstance(path, (str, os.PathLike)) or not Path(path).exists():
        raise H3InputError(f"{role}: no file or folder at {str(path)!r}; give {allowed}")
    try:
        info = describe_dit_checkpoint(path, cfg=cfg, qkv_interleaved=qkv_interleaved)
    except H3InputError as exc:
        raise H3InputError(f"{role}: {exc}") from None
    if info.is_branch and not want_branch:
        raise H3InputError(
            f"{role}: {info.path} is a {BRANCH} file, not a DiT; pass it as branch= with the H3 DiT checkpoint as base"
        )
    if want_branch and not info.is_branch:
        raise H3InputError(
            f"{role}: {info.path} is a {DIT} ({info.layout} layout), not a {BRANCH} file; give {allowed}"
        )
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
        raise H3InputError(
            f"{name} ({path}): strength must be a finite number (1 as trained, 0 merges nothing, "
            f"negative subtracts), got {strength!r}"
        )
    return LoraSpec(path, float(strength), _check_adapter(name, path, adapter))


def _lora_file(name: str, path) -> Path:
    """The LoRA's safetensors file; a peft adapter folder stands for its ``adapter_model.safetensors``."""
    if not isinstance(path, (str, os.PathLike)):
        raise H3InputError(f"{name}: the path must be a str or Path, got {path!r}")
    path = Path(path)
    if path.is_dir() and (path / "adapter_model.safetensors").is_file():
        return path / "adapter_model.safetensors"
    if not path.is_file():
        raise H3InputError(
            f"{name}: no LoRA file at '{path}'; give a .safetensors LoRA or a peft adapter folder "
            f"holding adapter_model.safetensors"
        )
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
        raise H3InputError(
            f"{name} ({path}): holds the peft adapters {held}; name the one to merge as the third "
            f"item, e.g. ('{path}', 1.0, {held[0]!r})"
        )
    if adapter is not None and held and adapter not in held:
        raise H3InputError(f"{name} ({path}): has no adapter {adapter!r}; it holds {held}")
    return adapter


def _check_lora_hits(model: torch.nn.Module, deltas: list[LoraDelta], source: str) -> None:
    """Refuse a LoRA none of whose targets this model has: it was made for another model. (A LoRA missing
    only some is refused by ``merge_lora``, naming the first.)"""
    modules = dict(model.named_modules())
    targets = sorted({d.module for d in deltas})
    if not any(t in modules for t in targets):
        raise H3InputError(
            f"{source}: none of its {len(targets)} target modules is in this model, first "
            f"{targets[:_SHOW]}; a MiniMax H3 LoRA targets modules such as 'blocks.0.attn.qkv_proj' "
            f"(native) or 'transformer_blocks.0.attn.to_q' (diffusers)"
        )


def _load_dit(
    path,
    *,
    device="cpu",
    dtype: torch.dtype = torch.bfloat16,
    cfg: DiTConfig | None = None,
    qkv_interleaved: bool = False,
) -> H3DiT:
    """Load a DiT checkpoint (a file or a folder of shards) in any supported layout; blocks in ``dtype``,
    the fp32 islands in fp32. ``qkv_interleaved`` marks the official shards, whose keys match ComfyUI's
    but whose ``qkv_proj`` rows are interleaved per head. A pruned ("curve") file is recognised by its
    ``adaln_t_table``, whose shape sets ``cfg.adaln_curve_grid`` and ``cfg.time_embed``. Without ``cfg`` the
    sizes are those in the file's metadata (``h3_core.formats.sizes``), else the released model's."""
    files = path if isinstance(path, CheckpointFiles) else CheckpointFiles(path)
    cfg = cfg or sizes_from_metadata(files.metadata, DiTConfig, files.path) or DiTConfig()
    curve = curve_grid(files)
    if curve is not None:
        cfg = replace(cfg, adaln_curve_grid=curve[0], time_embed=curve[1])
    with torch.device("meta"):
        model = H3DiT(cfg)
    model.layout = load_into(
        model,
        files,
        layouts(cfg, qkv_interleaved),
        what="MiniMax H3 DiT",
        device=device,
        dtype=dtype,
        keep_fp32=lambda key: keeps_fp32(key, curve is not None),
    )
    if curve is not None:
        model.layout += " (pruned AdaLN curves)"
    return model.eval()


def load_branch_weights(path, cfg: DiTConfig, *, device="cpu", dtype: torch.dtype = torch.bfloat16) -> BranchWeights:
    """VDN-H3's branch file alone (``BranchWeights``, named as the file names them), for a DiT of ``cfg``'s sizes
    that is held elsewhere (a host's native H3 model). Checked from its header first: a DiT, another model size or
    a file that is no branch is refused naming the input ``linear_branch``."""
    _check_dtype(dtype)
    info = _describe_role("linear_branch", path, replace(cfg, hybrid=False), None, want_branch=True)
    if needs_layers(info):
        raise H3InputError(
            f"linear_branch: {info.path} is quantised ({', '.join(f'{k}: {n}' for k, n in info.quantization)}); "
            "the branch loads from a bf16, fp16 or fp32 file"
        )
    with torch.device("meta"):
        branch = BranchWeights(replace(cfg, hybrid=False))
    branch.layout = load_into(
        branch, info.path, branch_layouts(), what="VDN-H3 linear branch", device=device, dtype=dtype
    )
    return branch.eval()


def _load_vdn(
    base,
    branch,
    *,
    device="cpu",
    dtype: torch.dtype = torch.bfloat16,
    cfg: DiTConfig | None = None,
    qkv_interleaved: bool = False,
) -> H3DiT:
    """A VDN-H3 model: the DiT from ``base`` (file or folder, as ``_load_dit``) with the hybrid attention's
    weights from ``branch``. The branch loads in ``dtype``; its scans accumulate in fp32 regardless."""
    cfg = replace(cfg, hybrid=False) if cfg is not None else None
    dense = _load_dit(base, device=device, dtype=dtype, cfg=cfg, qkv_interleaved=qkv_interleaved)
    cfg = dense.cfg  # a pruned base sets its curve sizes
    with torch.device("meta"):
        added = BranchWeights(cfg)
        model = H3DiT(replace(cfg, hybrid=True))
    branch_layout = load_into(added, branch, branch_layouts(), what="VDN-H3 linear branch", device=device, dtype=dtype)
    state = dense.state_dict()
    for key, value in added.state_dict().items():
        state["blocks." + key.removeprefix("transformer_blocks.")] = value
    model.load_state_dict(state, strict=True, assign=True)
    model.layout = f"{dense.layout} + {branch_layout}"
    return model.eval()
