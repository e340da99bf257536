"""fp8-scaled checkpoints read as ordinary ones: every fp8 weight multiplied by its scale on the way in.

Two spellings exist. ComfyUI's per-layer form stores ``<layer>.weight`` in float8 (e4m3fn or e5m2) with a
``<layer>.weight_scale`` (fp32, per tensor or per row), an optional ``<layer>.input_scale`` and a JSON
``<layer>.comfy_quant`` naming the format. The older form marks the file with a ``scaled_fp8`` tensor and
stores ``<layer>.scale_weight`` (and ``<layer>.scale_input``). Either way the dequantised weight is
``weight.float() · scale``; input scales only matter to fp8 matmuls and are dropped. A file that mixes in
any other quantisation is left as it is, so the loader refuses it naming the format.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .keymap import CheckpointFiles

__all__ = ["fp8_scaled_view", "FP8_FORMATS"]

FP8_FORMATS = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_FP8_DTYPES = set(FP8_FORMATS.values())


class Fp8ScaledView:
    """The reading side of ``CheckpointFiles`` over an fp8-scaled file: scale and sidecar keys hidden,
    fp8 weights returned dequantised in fp32."""

    def __init__(self, files: CheckpointFiles, scales: dict[str, str], hidden: set[str]):
        self._files, self._scales = files, scales  # weight key -> its scale key
        self.path, self.metadata = files.path, files.metadata
        self.keys = files.keys - hidden
        self.dtypes = {k: ("F32" if k in scales else d) for k, d in files.dtypes.items() if k in self.keys}

    def shape(self, key: str) -> tuple[int, ...]:
        return self._files.shape(key)

    def config(self) -> dict:
        return self._files.config()

    def latent_stats(self):
        return self._files.latent_stats()

    def get(self, key: str) -> torch.Tensor:
        value = self._files.get(key)
        if key not in self._scales:
            return value
        scale = self._files.get(self._scales[key]).float()
        if scale.dim() == 1 and scale.numel() == value.shape[0] and value.dim() > 1:
            scale = scale.view(-1, *([1] * (value.dim() - 1)))
        return value.float() * scale


def _layer_formats(files: CheckpointFiles) -> dict[str, str] | None:
    formats = {}
    for key in files.keys:
        if key.endswith(".comfy_quant"):
            try:
                spec = json.loads(bytes(files.get(key).tolist()).decode())
            except (UnicodeDecodeError, json.JSONDecodeError, TypeError):
                return None
            formats[key.removesuffix(".comfy_quant")] = str(spec.get("format"))
    return formats


def fp8_scaled_view(files: CheckpointFiles):
    """``files`` itself, or a dequantising view when the file is fp8-scaled and nothing else."""
    scales: dict[str, str] = {}
    hidden: set[str] = set()
    if "scaled_fp8" in files.keys:  # the older form
        hidden.add("scaled_fp8")
        for key in files.keys:
            if key.endswith(".scale_weight"):
                layer = key.removesuffix(".scale_weight")
                scales[layer + ".weight"] = key
                hidden |= {key, layer + ".scale_input"}
    formats = _layer_formats(files)
    if formats is None or any(f not in FP8_FORMATS for f in formats.values()):
        return files
    for layer in formats:
        scales[layer + ".weight"] = layer + ".weight_scale"
        hidden |= {layer + ".comfy_quant", layer + ".weight_scale", layer + ".input_scale"}
    if not scales or any(w not in files.keys or s not in files.keys for w, s in scales.items()):
        return files
    hidden &= files.keys
    fp8_left = {k for k, d in files.dtypes.items() if d in _FP8_DTYPES and k not in scales and k not in hidden}
    if fp8_left:
        return files  # fp8 tensors without a scale: not this format
    return Fp8ScaledView(files, scales, hidden)
