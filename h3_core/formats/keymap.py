"""Loading safetensors weights into our modules through table-driven key maps.

A ``KeyMap`` names one checkpoint layout. Each ``Rule`` matches keys of OUR module (a full-match regex)
and names the file keys that produce it (templates filled from the regex's groups), with an optional
``combine`` for keys that are fused or reshaped on the way in; a module key no rule matches is read
under its own name. The map is checked against the module itself: every module key must be produced,
every file key consumed, every shape must fit, or the file is refused with a message naming it, the
layout it resembled and the first offending keys. Files are memory-mapped and each tensor goes straight
to the target device and dtype; the module is built on the meta device, so nothing is held twice.

Quantised files (ComfyUI's ``comfy_quant`` layers, ``h3_core.formats.quantized_files``) are read through their view: a
quantised weight that is an ``nn.Linear``'s, read under a plain rule (one file key, no ``combine``) and not an
fp32 island, is kept as a comfy-kitchen ``QuantizedTensor`` where comfy-kitchen has kernels for the device
(``h3_core.formats.kitchen``), else dequantised into the target dtype; one log line per load says which.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
from safetensors import safe_open

from ..errors import H3InputError
from .quantized_files import FORMATS, HELD, QuantizedView, quantized_view

__all__ = ["Rule", "KeyMap", "CheckpointFiles", "load_into", "match_layout", "quantized_plan", "swap_halves",
           "QUANTIZED_DTYPES"]

QUANTIZED_DTYPES = {"I8", "U8", "F8_E4M3", "F8_E5M2", "I4", "U4"}
_SHOW = 5


def swap_halves(parts: list[torch.Tensor]) -> torch.Tensor:
    """``combine`` for a gated MLP whose file stores its input projection ``[up; gate]`` while the module
    wants ``[gate; up]`` (or the reverse): swap the two row halves."""
    first, second = parts[0].chunk(2, dim=0)
    return torch.cat([second, first])


@dataclass(frozen=True)
class Rule:
    target: str
    sources: tuple[str, ...]
    combine: Callable[[list[torch.Tensor]], torch.Tensor] | None = None

    def match(self, key: str):
        return re.fullmatch(self.target, key)


@dataclass(frozen=True)
class KeyMap:
    name: str
    rules: tuple[Rule, ...] = ()
    prefix: str = ""  # a prefix every file key carries (e.g. "vae."), stripped before matching
    ignore: tuple[str, ...] = ()  # file keys (full-match regexes) that may be present and are not weights

    def sources_for(self, key: str) -> tuple[tuple[str, ...], Callable | None]:
        for rule in self.rules:
            m = rule.match(key)
            if m:
                groups = m.groupdict()
                return tuple(self.prefix + s.format(**groups) for s in rule.sources), rule.combine
        return (self.prefix + key,), None


class CheckpointFiles:
    """The safetensors files of one checkpoint (a file, or a folder of shards), opened lazily."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if self.path.is_dir():
            # The official video VAE folder keeps its weights in source/ beside a config.json.
            files = sorted(self.path.glob("*.safetensors")) or sorted(self.path.glob("source/*.safetensors"))
        elif self.path.suffix == ".safetensors" and self.path.is_file():
            files = [self.path]
        elif self.path.suffix == ".gguf":
            raise H3InputError(f"{self.path}: GGUF checkpoints are not supported yet; use the .safetensors file")
        else:
            raise H3InputError(f"{self.path}: not a .safetensors file or a folder holding them")
        if not files:
            raise H3InputError(f"{self.path}: the folder holds no .safetensors files")
        self.files = files
        self._where: dict[str, Path] = {}
        self.dtypes: dict[str, str] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.metadata: dict[str, str] = {}
        for f in files:
            header = _read_header(f)
            self.metadata.update(header.pop("__metadata__", None) or {})
            for key, info in header.items():
                self._where[key] = f
                self.dtypes[key] = info["dtype"]
                self._shapes[key] = tuple(info["shape"])
        self._handles: dict[Path, object] = {}

    @property
    def keys(self) -> set[str]:
        return set(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        """A tensor's shape, from the header (nothing is read)."""
        return self._shapes[key]

    def config(self) -> dict:
        """``config.json`` beside the weights (a diffusers folder), or {}."""
        folder = self.path if self.path.is_dir() else self.path.parent
        cfg = folder / "config.json"
        return json.loads(cfg.read_text()) if self.path.is_dir() and cfg.is_file() else {}

    def latent_stats(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """Per-channel latent mean and std, from tensors in the file or a folder's ``config.json``."""
        if {"latents_mean", "latents_std"} <= self.keys:
            return tuple(tuple(self.get(k).double().tolist()) for k in ("latents_mean", "latents_std"))
        cfg = self.config()
        if cfg.get("latents_mean") and cfg.get("latents_std"):
            return tuple(cfg["latents_mean"]), tuple(cfg["latents_std"])
        return None

    def get(self, key: str) -> torch.Tensor:
        f = self._where[key]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt", device="cpu")
        return self._handles[f].get_tensor(key)


def _read_header(path: Path) -> dict:
    """The JSON header of a safetensors file, read without touching the tensors."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise H3InputError(f"{path}: too short to be a safetensors file")
        if head[:4] == b"GGUF":
            raise H3InputError(f"{path}: a GGUF file (named .safetensors); GGUF checkpoints are not supported yet, "
                               f"use the .safetensors file")
        size = int.from_bytes(head, "little")
        if size <= 0 or size > 100 * 2**20:
            raise H3InputError(f"{path}: not a safetensors file (header size {size})")
        try:
            header = json.loads(fh.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise H3InputError(f"{path}: not a safetensors file ({exc.__class__.__name__} in its header)") from None
    if not isinstance(header, dict):
        raise H3InputError(f"{path}: not a safetensors file (its header is not a table of tensors)")
    needed = 8 + size + max((info["data_offsets"][1] for k, info in header.items() if k != "__metadata__"), default=0)
    actual = path.stat().st_size
    if actual < needed:
        raise H3InputError(f"{path}: truncated: the header describes {needed} bytes but the file has {actual}; "
                           f"download it again")
    return header


def _plan(keymap: KeyMap, targets: Iterable[str], available: set[str]):
    plan, missing = {}, []
    for key in targets:
        sources, combine = keymap.sources_for(key)
        plan[key] = (sources, combine)
        missing += [s for s in sources if s not in available]
    used = {s for sources, _ in plan.values() for s in sources}
    unexpected = sorted(k for k in available - used if not any(re.fullmatch(p, k) for p in keymap.ignore))
    return plan, missing, unexpected


def match_layout(files: CheckpointFiles, targets: Sequence[str], keymaps: Sequence[KeyMap], what: str):
    """The key map whose plan the file fits exactly, or an error naming the closest one."""
    available = files.keys
    stray = sorted(k for k, d in files.dtypes.items() if d in QUANTIZED_DTYPES)
    if stray:
        kinds = sorted({files.dtypes[k] for k in stray})
        raise H3InputError(
            f"{files.path}: holds {', '.join(kinds)} tensors that no ComfyUI quantization sidecar (comfy_quant) "
            f"describes, first {stray[:_SHOW]}; a {what} loads from bf16/fp16/fp32 files or ComfyUI's quantised "
            f"ones ({', '.join(FORMATS)})"
        )
    scored = []
    for keymap in keymaps:
        plan, missing, unexpected = _plan(keymap, targets, available)
        if not missing and not unexpected:
            return keymap, plan
        scored.append((len(missing) + len(unexpected), keymap.name, missing, unexpected))
    _, name, missing, unexpected = min(scored, key=lambda s: s[0])
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} keys, first {missing[:_SHOW]}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected keys, first {unexpected[:_SHOW]}")
    raise H3InputError(
        f"{files.path}: not a {what} checkpoint this pack can load; it is closest to the {name} layout but "
        + " and ".join(parts)
    )


def quantized_plan(module: torch.nn.Module, plan: dict, files, keep_fp32: Callable[[str], bool]):
    """For a plan read from a ``QuantizedView``: ``(candidates, forced, quants)``. ``candidates`` maps each module key
    that may hold a comfy-kitchen weight (an ``nn.Linear``'s weight, read from one quantised file key under no
    ``combine``, not an fp32 island) to its ``LayerQuant``; ``forced`` gives the file keys that are dequantised
    whatever the device allows, with the reason; ``quants`` is every quantised layer the plan reads."""
    candidates, forced, quants = {}, {}, {}
    for key, (sources, combine) in plan.items():
        for source in sources:
            quant = files.quant(source)
            if quant is None:
                continue
            quants[source] = quant
            owner = key.rpartition(".")[0]
            if keep_fp32(key):
                forced[source] = "kept in fp32, as released"
            elif combine is not None or len(sources) > 1:
                forced[source] = "the layout's key map re-lays it out"
            elif not (key.endswith(".weight") and isinstance(module.get_submodule(owner), torch.nn.Linear)):
                forced[source] = "not a linear layer's weight"
            else:
                candidates[key] = quant
    return candidates, forced, list(quants.values())


def load_into(
    module: torch.nn.Module,
    path: str | Path | CheckpointFiles,
    keymaps: Sequence[KeyMap],
    *,
    what: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    keep_fp32: Callable[[str], bool] = lambda key: False,
    held: str = "auto",
    run_device: torch.device | str | None = None,
) -> str:
    """Fill ``module`` (built on the meta device) from ``path``; return the layout's name.

    Floating-point tensors go to ``dtype`` (default: as stored), except keys ``keep_fp32`` selects. A quantised
    file's linear weights are held by ``held`` (``quantized_files.HELD``: "auto" keeps them as comfy-kitchen
    weights where it has kernels for ``run_device``, default ``device``, else dequantises them; see the module
    docstring); they then compute in ``dtype`` (fp32 when None). A kept weight is a ``QuantizedTensor``: LoRAs
    cannot be merged into it afterwards (``h3_core.formats.checkpoints.load_h3_model`` merges them first)."""
    from .kitchen import hold_layers

    if held not in HELD:
        raise H3InputError(f"held: got {held!r}; allowed: {', '.join(map(repr, HELD))}")
    device = torch.device(device)
    run_device = device if run_device is None else torch.device(run_device)
    # comfy-kitchen dequantises on the GPU the model will run on, when there is one
    work = run_device if run_device.type == "cuda" and torch.cuda.is_available() else device
    files = quantized_view(path if isinstance(path, CheckpointFiles) else CheckpointFiles(path), work_device=work)
    expected = module.state_dict()
    keymap, plan = match_layout(files, list(expected), keymaps, what)
    candidates, kept = {}, []
    if isinstance(files, QuantizedView):
        candidates, forced, quants = quantized_plan(module, plan, files, keep_fp32)
        holding = hold_layers(files.path, quants, held, dtype or torch.float32, run_device, forced)
        candidates = {k: q for k, q in candidates.items() if q.weight in holding.kept}
    state = {}
    for key, (sources, combine) in plan.items():
        if key in candidates:
            state[key] = holding.kitchen_weight(files, candidates[key], device, tuple(expected[key].shape))
            kept.append(key)
            continue
        tensors = [files.get(s) for s in sources]
        value = tensors[0] if combine is None else combine(tensors)
        if tuple(value.shape) != tuple(expected[key].shape):
            raise H3InputError(
                f"{files.path}: {what} key {sources[0]!r} has shape {tuple(value.shape)}, the {keymap.name} "
                f"layout needs {tuple(expected[key].shape)} for {key!r}"
            )
        target_dtype = torch.float32 if keep_fp32(key) else (dtype or value.dtype)
        state[key] = value.to(device=device, dtype=target_dtype if value.is_floating_point() else value.dtype)
        del tensors, value
    module.load_state_dict(state, strict=True, assign=True)
    for key in kept:
        module.get_parameter(key).requires_grad_(False)
    return keymap.name
