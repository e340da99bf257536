"""Quantised safetensors checkpoints as ComfyUI writes them: which format each layer is in, from the header,
and each layer read back, dequantised by the library that defines the format.

ComfyUI's per-layer form (``comfy/ops.py`` ``_load_quantized_module`` / ``_quantized_weight_state_dict`` at
Comfy-Org/ComfyUI 5522e4f, its formats in ``comfy/quant_ops.py`` ``QUANT_ALGOS`` at cd9452e, their storage in
comfy-kitchen 0.2.40's ``tensor/int8.py``, ``tensor/nvfp4.py``): a quantised linear ``<layer>`` stores

  ``<layer>.comfy_quant``  U8, the bytes of a JSON object ``{"format": ..., options}``
  ``<layer>.weight``       the codes, and beside them, by format:

  * ``float8_e4m3fn`` / ``float8_e5m2``: F8 codes ``[N, K]``; ``weight_scale`` F32, one per tensor or per row
    (``[N]``, ``[N, 1]``); an optional ``input_scale``. Weight = ``codes · scale``.
  * ``int8_tensorwise``: I8 codes ``[N, K]``; ``weight_scale`` F32 per tensor or per row. With ``"convrot":
    true`` (top level or under ``"params"``) and ``"convrot_groupsize": g`` (default 256, a power of 4 that
    divides K) the codes are of the weight rotated by a regular Hadamard matrix in groups of g input columns
    (comfy-kitchen's ConvRot), its scale per row ``[N, 1]``: ``int8_convrot`` below, the format of H3's
    ``*_int8_convrot`` files (``{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 256}``).
  * ``nvfp4``: U8 ``[N, K/2]``, two e2m1 codes per byte, the even column in the high nibble; ``weight_scale``
    F8_E4M3 (or U8) block scales, one per 16 codes, in cuBLAS's swizzled 128×4 tiles, ``[⌈N/128⌉·128,
    ⌈K/64⌉·4]``; ``weight_scale_2`` F32, the per-tensor scale; an optional ``input_scale``; an optional
    ``pre_quant_scale`` ``[K]`` (ModelOpt's AWQ smoothing: the layer's input is multiplied by it first, as
    ComfyUI's ``MixedPrecisionOps.Linear.forward`` does): ``nvfp4_awq`` below.
  * ``"full_precision_matrix_mult": true`` asks for the matmul in the compute dtype, the weight dequantised.

The older fp8 form marks the file with a ``scaled_fp8`` tensor and stores ``<layer>.scale_weight`` (and
``scale_input``) beside each fp8 weight. Anything else (another ``format``, a GGUF file) is refused naming the
format, the file and the layer.

Reading (``QuantizedView``, the reading side of ``CheckpointFiles``): the sidecars are hidden; a quantised
weight reads as the fp32 tensor it stands for, dequantised by comfy-kitchen's own layouts
(``TensorWiseINT8Layout`` / ``TensorCoreNVFP4Layout`` through ``QuantizedTensor.dequantize``,
``h3_core.formats.kitchen``);
fp8 as ``codes.float() · scale``, the product ComfyUI's ``TensorCoreFP8Layout.dequantize`` forms. Where a model
keeps the codes instead, ``h3_core.formats.kitchen`` builds the library's ``QuantizedTensor`` from the stored tensors.
``read_state_dict`` reads a chosen set of keys either way, for any model (the text encoder's entry point).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ..errors import H3InputError
from .files import CheckpointFiles
from .kitchen import dequantize, hold_layers
from .quant_layers import HELD, SHOW, LayerQuant, count_kinds, layer_quants

__all__ = ["QuantizedState", "QuantizedView", "quantized_view", "read_state_dict"]


class QuantizedView:
    """The reading side of ``CheckpointFiles`` over a quantised file: sidecars hidden, each quantised weight
    read as the fp32 tensor it stands for (module docstring). ``work_device`` is where weights are dequantised
    (comfy-kitchen runs its CUDA kernels there when it is a GPU); results come back on the CPU."""

    def __init__(self, files: CheckpointFiles, layers: dict[str, LayerQuant], work_device="cpu"):
        self._files, self.layers = files, layers
        self._scales = {weight: quant.scale for weight, quant in layers.items()}  # weight key -> its scale key
        self.path, self.metadata, self.files = files.path, files.metadata, files.files
        hidden = {key for quant in layers.values() for key in quant.sidecars}
        if "scaled_fp8" in files.keys:
            hidden.add("scaled_fp8")
        self.keys = files.keys - hidden
        self.dtypes = {k: ("F32" if k in layers else d) for k, d in files.dtypes.items() if k in self.keys}
        self.work_device = torch.device(work_device)

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of the tensor ``key`` stands for (an nvfp4 weight's columns are twice its bytes)."""
        shape = tuple(self._files.shape(key))
        quant = self.layers.get(key)
        return (shape[0], 2 * shape[1]) if quant is not None and quant.format == "nvfp4" else shape

    def config(self) -> dict:
        return self._files.config()

    def latent_stats(self):
        return self._files.latent_stats()

    def quant(self, key: str) -> LayerQuant | None:
        """How ``key`` is stored, or None when it is not a quantised weight."""
        return self.layers.get(key)

    def raw(self, key: str) -> torch.Tensor:
        """A tensor exactly as the file stores it (sidecars included)."""
        return self._files.get(key)

    def get(self, key: str) -> torch.Tensor:
        quant = self.layers.get(key)
        if quant is None:
            return self._files.get(key)
        if quant.format.startswith("float8"):
            codes, scale = self.stored(key)
            scale = scale.float()
            if scale.dim() == 1 and scale.numel() == codes.shape[0] and codes.dim() > 1:
                scale = scale.view(-1, *([1] * (codes.dim() - 1)))
            return codes.float() * scale

        return dequantize(self, quant, torch.float32, self.work_device).cpu()

    def span(self, key: str):
        """Where the reader reads the stored ``key`` (``CheckpointFiles.span``)."""
        return self._files.span(key)

    def read_keys(self, key: str) -> tuple[str, ...] | None:
        """The stored keys ``get(key)`` and ``stored(key)`` read, in order; None for a layer dequantised by
        comfy-kitchen (its reads are the library's)."""
        quant = self.layers.get(key)
        if quant is None:
            return (key,)
        return (key, quant.scale) if quant.format.startswith("float8") else None

    def stored(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``key``'s fp8 codes and their scale exactly as the file stores them, or None for a key that is not an
        fp8 weight (``fp8_scaled.layer_codes`` takes these as they are)."""
        quant = self.layers.get(key)
        if quant is None or not quant.format.startswith("float8"):
            return None
        return self._files.get(key), self._files.get(quant.scale)

    def formats(self) -> dict[str, int]:
        """How many layers each format (``LayerQuant.kind``) has."""
        return count_kinds(self.layers.values())


def quantized_view(files: CheckpointFiles, work_device="cpu"):
    """``files`` itself when it has no quantised layer, else a ``QuantizedView`` of it. Raises ``H3InputError``
    for a format this pack does not read or malformed sidecars (``layer_quants``)."""
    layers = layer_quants(files)
    return QuantizedView(files, layers, work_device) if layers else files


@dataclass
class QuantizedState:
    """What ``read_state_dict`` read: ``state`` (key → tensor, or comfy-kitchen ``QuantizedTensor`` for a weight
    kept quantised), ``kept`` / ``dequantised`` (the quantised weight keys held each way) and ``report``, the one
    line it logged (empty for a file with no quantised layer)."""

    state: dict[str, torch.Tensor]
    kept: tuple[str, ...]
    dequantised: tuple[str, ...]
    report: str


def read_state_dict(
    path,
    keys: Iterable[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    held: str = "auto",
    run_device=None,
    may_keep: Callable[[str], bool] = lambda key: True,
) -> QuantizedState:
    """Read ``keys`` of the safetensors checkpoint ``path`` (a file, a folder of shards or a ``CheckpointFiles``)
    into a state dict, any quantised weight among them dequantised or kept as a comfy-kitchen layer weight.

    Floating-point tensors come in ``dtype``, others as stored, all on ``device``. A quantised weight is, by
    ``held`` (``HELD``): a comfy-kitchen ``QuantizedTensor`` (logical dtype ``dtype``; ``F.linear`` with it runs
    the library's registered matmul) where comfy-kitchen has kernels for ``run_device`` (default ``device``) and
    the format, else the tensor it stands for dequantised by comfy-kitchen to ``dtype`` ("auto"); always the
    latter ("dequantize"); always the former, or ``H3BackendUnavailable`` naming why not ("kitchen"). An nvfp4
    layer's ``pre_quant_scale`` (AWQ) and ``input_scale`` are added under their own keys, in ``dtype`` and fp32:
    its input must be multiplied by the former before the layer, as ComfyUI does. An nvfp4 weight reads at its
    stored size (rows and columns padded to 16 by comfy-kitchen's quantiser; the released files need none).
    ``may_keep(key)`` False keeps that weight dense whatever ``held`` says (one the caller does not run through
    ``F.linear``, such as an embedding table). One line says which way the quantised weights went
    (``QuantizedState.report``, also logged).

    Raises ``H3InputError`` naming the file and the first keys it lacks, or a format it cannot read."""

    files = path if isinstance(path, CheckpointFiles) else CheckpointFiles(path)
    keys = list(dict.fromkeys(keys))
    if held not in HELD:
        raise H3InputError(f"held: got {held!r}; allowed: {', '.join(map(repr, HELD))}")
    device = torch.device(device)
    run_device = device if run_device is None else torch.device(run_device)
    # comfy-kitchen dequantises on the GPU the model will run on, when there is one
    work = run_device if run_device.type == "cuda" and torch.cuda.is_available() else "cpu"
    view = quantized_view(files, work_device=work)
    missing = [k for k in keys if k not in view.keys]
    if missing:
        raise H3InputError(
            f"{files.path}: has no {len(missing)} of the {len(keys)} keys asked for, first {missing[:SHOW]}"
        )
    quants = [view.quant(k) for k in keys if view.quant(k) is not None] if isinstance(view, QuantizedView) else []
    dense = {q.weight: "the caller holds it dense (it runs no F.linear)" for q in quants if not may_keep(q.weight)}
    holding = hold_layers(files.path, quants, held, dtype, run_device, dense)
    state: dict[str, torch.Tensor] = {}
    for key in keys:
        quant = view.quant(key) if isinstance(view, QuantizedView) else None
        if quant is not None and quant.weight in holding.kept:
            state[key] = holding.kitchen_weight(view, quant, device)
        elif quant is not None and not quant.format.startswith("float8"):
            state[key] = dequantize(view, quant, dtype, view.work_device).to(device)
        else:
            value = view.get(key)
            state[key] = value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
        if quant is not None and quant.pre_quant_scale is not None:
            state[quant.pre_quant_scale] = view.raw(quant.pre_quant_scale).to(device=device, dtype=dtype)
        if quant is not None and quant.input_scale is not None and quant.format == "nvfp4":
            state[quant.input_scale] = view.raw(quant.input_scale).to(device=device, dtype=torch.float32)
    return QuantizedState(state, tuple(sorted(holding.kept)), tuple(sorted(holding.dequantised)), holding.report)
