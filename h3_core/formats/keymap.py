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

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from ..errors import H3InputError
from .files import CheckpointFiles, spans_of
from .kitchen import hold_layers
from .quant_layers import FORMATS, HELD
from .quantized_files import QuantizedView, quantized_view
from .staged_read import reader_for

__all__ = [
    "Rule",
    "KeyMap",
    "CheckpointFiles",
    "load_into",
    "match_layout",
    "quantized_plan",
    "swap_halves",
    "QUANTIZED_DTYPES",
]

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
    cannot be merged into it afterwards (``h3_core.formats.checkpoints.load_h3_model`` merges them first). Onto
    a GPU the file is read straight there (``staged_read``)."""
    if held not in HELD:
        raise H3InputError(f"held: got {held!r}; allowed: {', '.join(map(repr, HELD))}")
    device = torch.device(device)
    run_device = device if run_device is None else torch.device(run_device)
    # comfy-kitchen dequantises on the GPU the model will run on, when there is one
    work = run_device if run_device.type == "cuda" and torch.cuda.is_available() else device
    with reader_for(device) as reader:
        if isinstance(path, CheckpointFiles):
            files = path if reader is None else CheckpointFiles(path.path, reader)
        else:
            files = CheckpointFiles(path, reader)
        return _load_into(
            module,
            quantized_view(files, work_device=work),
            keymaps,
            what,
            device,
            dtype,
            keep_fp32,
            held,
            run_device,
            files.reader,
        )


def _load_into(module, files, keymaps, what, device, dtype, keep_fp32, held, run_device, reader=None) -> str:
    expected = module.state_dict()
    keymap, plan = match_layout(files, list(expected), keymaps, what)
    candidates, kept = {}, []
    if isinstance(files, QuantizedView):
        candidates, forced, quants = quantized_plan(module, plan, files, keep_fp32)
        holding = hold_layers(files.path, quants, held, dtype or torch.float32, run_device, forced)
        candidates = {k: q for k, q in candidates.items() if q.weight in holding.kept}
    if reader is not None:  # the tensors below read ahead, in the order the loop asks for them
        reader.expect(
            spans_of((files, s) for key, (sources, _) in plan.items() if key not in candidates for s in sources)
        )
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
