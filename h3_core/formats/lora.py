"""Merging LoRAs into the DiT's weights: ``W += strength · (alpha / rank) · B @ A``, computed in fp32 and
added in W's dtype, before any quantisation.

Accepted files (safetensors):
  * peft adapters (the VDN-H3 ``default`` and ``turbo`` adapters): ``<module>.lora_A[.<adapter>].weight``,
    ``<module>.lora_B[.<adapter>].weight``, with ``lora_alpha`` and ``r`` from the ``adapter_config.json``
    beside the file (alpha == rank when it is absent);
  * ComfyUI-style LoRAs: ``diffusion_model.<module>.lora_{A,B}.weight`` or ``.lora_{down,up}.weight`` with an
    optional ``.alpha`` scalar per module, the module names with or without the ``diffusion_model.`` prefix (what
    ComfyUI's own H3 LoRA keys map: comfy/lora.py ``model_lora_keys_unet`` at Comfy-Org/ComfyUI 17358c8f), and
    full differences beside them as that file's ``load_lora`` reads them: ``<module>.diff`` added to the weight,
    ``<module>.diff_b`` to the bias (``W += strength · diff``).
Module names may be native (``blocks.{i}.attn.qkv_proj``) or diffusers' (``transformer_blocks.{i}.attn.to_q``,
also under VDN's ``.attn.orig.``): a LoRA on ``to_q`` / ``to_k`` / ``to_v`` lands on its third of the fused
``qkv_proj`` rows, one on ``ff.net.0.proj`` has its ``B`` rows swapped to the native ``[gate; up]`` order.
A module the model does not have is an error that names it; nothing is merged partially.

Besides merging, ``lora_patches`` lays the same updates out as per-weight patches (a weight key, the rows it
updates, ``up``, ``down`` and ``alpha / rank``) for a weight patcher that applies them when the model is loaded
to its device and can take them off again; ``describe_lora_file`` says from a file's header alone whether it
is a LoRA for this DiT.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import H3InputError
from .files import CheckpointFiles

__all__ = ["LoraDelta", "LoraPatch", "read_lora", "merge_lora", "lora_patches", "describe_lora_file"]

_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.", "model.")
_PAIR = re.compile(r"(?P<module>.+?)\.(?P<which>lora_A|lora_B|lora_down|lora_up)(\.(?P<adapter>[^.]+))?\.weight")
_DIFF = re.compile(r"(?P<module>.+)\.(?P<which>diff|diff_b)")

# diffusers module names → ours
_RENAMES = (
    (r"transformer_blocks\.(\d+)\.", r"blocks.\1."),
    (r"token_refiner\.refiner_blocks\.(\d+)\.", r"token_refiner.blocks.\1."),
    (r"\.attn\.orig\.", ".attn."),
    (r"\.attn\.to_out\.0$", ".attn.out_proj"),
    (r"\.ff\.net\.0\.proj$", ".mlp.fc1"),
    (r"\.ff\.net\.2$", ".mlp.fc2"),
    (r"^norm_out\.linear$", "final_layer.adaln_proj.linear"),
    (r"^proj_out$", "final_layer.video_out"),
    (r"^audio_proj_out$", "final_layer.audio_out"),
    (r"^proj_in$", "video_patch_proj"),
    (r"^audio_proj_in$", "audio_patch_proj"),
    (r"^context_embedder$", "condition_proj"),
)


@dataclass
class LoraDelta:
    """One low-rank update of ``module``'s weight, rows ``part`` of 3 (q, k, v of a fused qkv) or all."""

    module: str
    down: torch.Tensor  # A [rank, in]
    up: torch.Tensor  # B [out_part, rank]
    scale: float
    part: int | None = None  # 0, 1, 2 for q, k, v rows of qkv_proj
    swap_halves: bool = False  # B stored [up; gate] (diffusers) for the native [gate; up]
    diff: torch.Tensor | None = None  # a full difference in place of up @ down (down and up then empty)
    param: str = "weight"  # what it updates: the module's "weight" or (a diff only) its "bias"


def _native(module: str) -> tuple[str, int | None]:
    """Our module name for a LoRA target, and which third of the fused qkv it updates (None: all rows)."""
    for prefix in _PREFIXES:
        if module.startswith(prefix):
            module = module[len(prefix) :]
            break
    for pattern, repl in _RENAMES:
        module = re.sub(pattern, repl, module)
    # diffusers' split q / k / v: to_q in the blocks, q_proj in the token refiner
    m = re.fullmatch(r"(?P<stem>.+\.attn)\.(to_(?P<x>[qkv])|(?P<y>[qkv])_proj)", module)
    if m:
        return m.group("stem") + ".qkv_proj", "qkv".index(m.group("x") or m.group("y"))
    return module, None


def read_lora(path: str | Path, strength: float = 1.0, adapter: str | None = None) -> list[LoraDelta]:
    """The low-rank updates of one LoRA file (module docstring), scaled by ``strength``."""
    path = Path(path)
    if path.suffix != ".safetensors" or not path.is_file():
        raise H3InputError(f"{path}: a LoRA must be a .safetensors file")
    config = {}
    cfg_path = path.parent / "adapter_config.json"
    if cfg_path.is_file():
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    pairs: dict[str, dict] = {}
    diffs: list[tuple[str, str, torch.Tensor]] = []
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        for key in keys:
            m = _PAIR.fullmatch(key)
            if m is None:
                d = _DIFF.fullmatch(key)
                if d is not None:
                    diffs.append(
                        (d.group("module"), "bias" if d.group("which") == "diff_b" else "weight", f.get_tensor(key))
                    )
                    continue
                if key.endswith(".alpha"):
                    continue
                raise H3InputError(
                    f"{path}: '{key}' is not a LoRA weight (expected <module>.lora_A / lora_B / "
                    f"lora_down / lora_up .weight, or <module>.diff / .diff_b)"
                )
            if adapter is not None and m.group("adapter") not in (None, adapter):
                continue
            entry = pairs.setdefault(m.group("module"), {})
            entry["down" if m.group("which") in ("lora_A", "lora_down") else "up"] = f.get_tensor(key)
            if f"{m.group('module')}.alpha" in keys:
                entry["alpha"] = float(f.get_tensor(f"{m.group('module')}.alpha"))
    deltas = []
    for module, entry in sorted(pairs.items()):
        if "down" not in entry or "up" not in entry:
            raise H3InputError(f"{path}: module '{module}' has only one half of its LoRA pair")
        rank = entry["down"].shape[0]
        alpha = entry.get("alpha", config.get("lora_alpha", rank))
        rank_cfg = config.get("r", rank)
        native, part = _native(module)
        deltas.append(
            LoraDelta(native, entry["down"], entry["up"], strength * alpha / rank_cfg, part, _swapped(module))
        )
    for module, param, diff in sorted(diffs, key=lambda item: item[:2]):
        native, part = _native(module)
        empty = diff.new_empty(0, 0)
        deltas.append(LoraDelta(native, empty, empty, strength, part, _swapped(module), diff, param))
    if not deltas:
        raise H3InputError(f"{path}: holds no LoRA weights" + (f" for adapter '{adapter}'" if adapter else ""))
    return deltas


def _swapped(module: str) -> bool:
    """Whether ``module`` is diffusers' FFN input projection, whose rows are ``[up; gate]``."""
    return bool(re.search(r"\.ff\.net\.0\.proj$", module))


def _check_targets(model: torch.nn.Module, deltas: list[LoraDelta], source: str) -> list:
    """Each update's module, checked against ``model`` (it exists, has a weight, the shapes fit)."""
    modules = dict(model.named_modules())
    targets = []
    for d in deltas:
        target = modules.get(d.module)
        if target is None or not isinstance(getattr(target, "weight", None), torch.Tensor):
            raise H3InputError(f"{source}: targets '{d.module}', which this model does not have")
        rows = target.weight.shape[0] // 3 if d.part is not None else target.weight.shape[0]
        if d.diff is not None:
            _check_diff(target, d, rows, source)
            targets.append(target)
            continue
        if d.up.shape[0] != rows or d.down.shape[1] != target.weight.shape[1] or d.up.shape[1] != d.down.shape[0]:
            hint = ""
            if "adaln_proj" in d.module and getattr(getattr(model, "cfg", None), "adaln_curve_grid", 0):
                hint = (
                    "; this model is the pruned (AdaLN curve) form, whose AdaLN projections are rank-reduced, so "
                    "a LoRA made for the full model's AdaLN cannot merge into them: use the full (bf16) model"
                )
            raise H3InputError(
                f"{source}: the update of '{d.module}' is {tuple(d.up.shape)} @ {tuple(d.down.shape)}, "
                f"the weight is {tuple(target.weight.shape)}{hint}"
            )
        targets.append(target)
    return targets


def _check_diff(target, d: LoraDelta, rows: int, source: str) -> None:
    """A full difference fits what it updates: the module's weight rows, or its bias (which it must have)."""
    param = getattr(target, d.param, None)
    if not isinstance(param, torch.Tensor):
        raise H3InputError(f"{source}: adds to the {d.param} of '{d.module}', which has none in this model")
    want = (rows, *param.shape[1:])
    if tuple(d.diff.shape) != want:
        raise H3InputError(
            f"{source}: the difference for the {d.param} of '{d.module}' is {tuple(d.diff.shape)}, the "
            f"{d.param} is {want}"
        )


def _native_rows(rows: torch.Tensor, swap: bool) -> torch.Tensor:
    """``rows`` in the model's order: a diffusers ``[up; gate]`` input projection's halves swapped."""
    if not swap:
        return rows
    up_half, gate_half = rows.chunk(2)
    return torch.cat([gate_half, up_half])


def _native_up(d: LoraDelta) -> torch.Tensor:
    """``d.up`` with its rows in the model's order."""
    return _native_rows(d.up, d.swap_halves)


@dataclass(frozen=True)
class LoraPatch:
    """One update as a weight patch: ``weight[rows] += strength · scale · up @ down``, or ``+= strength · diff``
    (also for a bias)."""

    key: str  # the model's state-dict key of what it updates, "<module>.weight" or "<module>.bias"
    rows: tuple[int, int] | None  # (first row, row count) of the weight it updates; None: every row
    up: torch.Tensor  # [row count, rank], rows in the model's order (empty for a full difference)
    down: torch.Tensor  # [rank, in] (empty for a full difference)
    scale: float  # alpha / rank (1 for a full difference); the strength is the patcher's
    diff: torch.Tensor | None = None  # a full difference of the weight rows or the bias, rows in the model's order


def lora_patches(model: torch.nn.Module, deltas: list[LoraDelta], *, source: str = "LoRA") -> list[LoraPatch]:
    """``deltas`` (read with strength 1) as weight patches for ``model``, all checked first: a module the model
    lacks or a shape that does not fit is an error naming it, and no patch is returned."""
    targets = _check_targets(model, deltas, source)
    patches = []
    for target, d in zip(targets, deltas):
        rows = None
        if d.part is not None:
            third = target.weight.shape[0] // 3
            rows = (d.part * third, third)
        if d.diff is not None:
            patches.append(
                LoraPatch(f"{d.module}.{d.param}", rows, d.up, d.down, 1.0, _native_rows(d.diff, d.swap_halves))
            )
            continue
        patches.append(LoraPatch(f"{d.module}.weight", rows, _native_up(d), d.down, d.scale))
    return patches


# Where the DiT's modules live (``H3DiT``'s children): a LoRA target outside them is another model's.
_DIT_STEMS = (
    "blocks.",
    "token_refiner.",
    "final_layer.",
    "time_embedder.",
    "video_patch_proj",
    "audio_patch_proj",
    "condition_proj",
)


def describe_lora_file(path: str | Path) -> str:
    """What the LoRA at ``path`` targets, from its header alone (e.g. "100 modules, e.g. blocks.0.attn.qkv_proj");
    an ``H3InputError`` naming the file when it is not a safetensors LoRA or targets another model's modules."""
    path = Path(path)
    files = CheckpointFiles(path)
    modules, other = set(), []
    for key in sorted(files.keys):
        m = _PAIR.fullmatch(key) or _DIFF.fullmatch(key)
        if m is None:
            if not key.endswith(".alpha"):
                other.append(key)
            continue
        modules.add(_native(m.group("module"))[0])
    if other or not modules:
        shown = other[:3] or sorted(files.keys)[:3]
        raise H3InputError(
            f"{path.name}: not a LoRA (a LoRA holds <module>.lora_A / lora_B / lora_down / lora_up "
            f"weights); found keys such as {shown}"
        )
    foreign = sorted(m for m in modules if not m.startswith(_DIT_STEMS))
    if foreign:
        raise H3InputError(
            f"{path.name}: a LoRA for another model: it targets {len(foreign)} modules this DiT does not "
            f"have, e.g. {foreign[:3]}; a MiniMax H3 LoRA targets modules such as "
            "'blocks.0.attn.qkv_proj' (native) or 'transformer_blocks.0.attn.to_q' (diffusers)"
        )
    return f"{len(modules)} modules, e.g. {sorted(modules)[0]}"


@torch.no_grad()
def merge_lora(model: torch.nn.Module, deltas: list[LoraDelta], *, source: str = "LoRA") -> int:
    """Add every update to ``model``'s weights (all checked first, so a bad file merges nothing);
    returns the number of weights changed."""
    plans = list(zip(_check_targets(model, deltas, source), deltas))
    for target, d in plans:
        if d.diff is not None:
            update = _native_rows(d.diff, d.swap_halves).float() * d.scale
        else:
            update = (_native_up(d).float() @ d.down.float()) * d.scale
        weight = getattr(target, d.param)
        rows = (
            slice(None) if d.part is None else slice(d.part * weight.shape[0] // 3, (d.part + 1) * weight.shape[0] // 3)
        )
        weight[rows] = (weight[rows].float() + update.to(weight.device)).to(weight.dtype)
    return len(plans)
