"""ComfyUI's single-file Qwen3-VL text encoder read into the truncated text model (``text_encoder``): the bf16
file, or a quantised one (``qwen3vl_32b_minimax_h3_int8_convrot`` / ``_nvfp4_awq``, ``qwen3vl_checkpoint``).

Every tensor the truncated model holds (the embeddings, the decoder layers below the conditioning layer, the vision
tower; never the later layers, the final norm or an output head) is read under its ComfyUI name by
``h3_core.formats.quantized_files.read_state_dict``, memory-mapped, into host memory, floats in the model's dtype. A
quantised weight is, by ``held`` (``quantized_files.HELD``):

* an ``nn.Linear``'s: a comfy-kitchen ``QuantizedTensor`` built from the file's codes and scales where comfy-kitchen
  has kernels for ``run_device`` (``h3_core.formats.kitchen``; ``F.linear`` then runs the library's matmul: int8
  with its
  activations quantised per row, nvfp4 with the weight dequantised for a plain input), else the tensor comfy-kitchen
  dequantises, in the model's dtype;
* anything else (an embedding table, which looks rows up and runs no ``F.linear``): dequantised.

One log line per load says which layers went which way (``QuantizedState.report``).

AWQ: an nvfp4_awq layer's ``pre_quant_scale [K]`` multiplies the layer's input before the matmul. The layer is a
``PreScaledLinear`` holding the scale as a buffer under the file's own name, and multiplies its input by the scale
cast to the input's dtype, the product ComfyUI's ``MixedPrecisionOps.Linear.forward`` forms (``comfy/ops.py`` at
Comfy-Org/ComfyUI 5522e4f). The scale is not folded into the weight's columns: a kept layer's codes are the file's
and cannot take it, and for a dequantised one the fold would round ``W·s`` where ComfyUI rounds ``x·s``, so the
weight would no longer be comfy-kitchen's dequantisation and the outputs would differ from ComfyUI's in the last
bits.
"""

from __future__ import annotations

import torch
from torch import nn

from .quantized_files import QuantizedState, read_state_dict

__all__ = ["PreScaledLinear", "read_text_encoder_file"]


class PreScaledLinear(nn.Linear):
    """An ``nn.Linear`` whose input is first multiplied by ``pre_quant_scale`` (``[in_features]``, ModelOpt's AWQ
    smoothing), in the input's dtype, as ComfyUI does."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.register_buffer("pre_quant_scale", torch.ones(in_features, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * self.pre_quant_scale.to(x.dtype))


def _prescale(model: nn.Module, names: list[str]) -> None:
    """Replace the ``nn.Linear`` modules ``names`` of ``model`` (built on the meta device) by ``PreScaledLinear``
    layers of the same shape, on the meta device."""
    for name in names:
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, attribute)
        if not isinstance(linear, nn.Linear):  # the checkpoint's description refuses scales on anything else
            raise AssertionError(f"{name} is a {type(linear).__name__}, not a linear layer")
        setattr(
            parent,
            attribute,
            PreScaledLinear(linear.in_features, linear.out_features, linear.bias is not None, device="meta"),
        )


def read_text_encoder_file(
    model: nn.Module, described, *, dtype: torch.dtype, held: str = "auto", run_device=None
) -> QuantizedState:
    """Fill ``model`` (the truncated ``Qwen3VLForConditionalGeneration``, built on the meta device) from the file
    ``described`` (``qwen3vl_checkpoint.TextEncoderCheckpoint``) in host memory (module docstring). Returns what
    ``read_state_dict`` read, less the state: the quantised weights kept and dequantised (file keys) and the
    report line."""
    layout = described.layout
    modules = dict(model.named_modules())
    prescaled = [layout.model_key(layer) for layer in described.prescaled]
    _prescale(model, [name for name in prescaled if name in modules])  # the later layers' are not held
    file_keys = {layout.file_key(key): key for key in model.state_dict()}
    scales = {f for f in file_keys if f.endswith(".pre_quant_scale")}  # read beside their layers' weights
    linears = {
        layout.file_key(f"{name}.weight") for name, module in model.named_modules() if isinstance(module, nn.Linear)
    }
    read = read_state_dict(
        described.path,
        [f for f in file_keys if f not in scales],
        dtype=dtype,
        device="cpu",
        held=held,
        run_device=run_device,
        may_keep=linears.__contains__,
    )
    # an nvfp4 layer's input_scale quantises its input for an nvfp4 x nvfp4 matmul; the encoder's inputs stay plain
    state = {file_keys[f]: value for f, value in read.state.items() if f in file_keys}
    model.load_state_dict(state, strict=True, assign=True)
    for key in read.kept:
        model.get_parameter(file_keys[key]).requires_grad_(False)
    return QuantizedState({}, read.kept, read.dequantised, read.report)
