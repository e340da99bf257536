"""Quantised block linears for the native H3 model with the VDN-H3 patch (``tests/unit/test_native_patch_quantized``):
the host's own fp8 layers (``comfy.ops`` of the test host, ComfyUI 0.3.75), comfy-kitchen int8 ConvRot weights,
a guard that counts each layer's calls and records any read of its ``weight`` made from outside its own forward,
and one request run through the patched native model and through the pack's VDN-H3 DiT (fp32, no masks).

How the host holds fp8 weights (``comfy/ops.py`` at 0.3.75), both on the manual-cast path on a CPU (no fp8
matmuls there, ``model_management.supports_fp8_compute`` is False):
  * ``scaled_fp8``, the older file marker: ``pick_operations(..., scaled_fp8=e4m3)`` gives ``scaled_fp8_ops``,
    whose ``Linear`` holds ``weight`` in e4m3 and a per-tensor ``scale_weight``; its forward casts the weight up
    to the input's dtype (``cast_bias_weight``) and multiplies the scale into the smaller of weight and input.
  * ``comfy_quant``, the per-layer marker: ``pick_operations(..., model_config=...)`` with a
    ``layer_quant_config`` gives ``mixed_precision_ops``, whose ``Linear`` loads ``weight`` + ``weight_scale`` as
    a ``QuantizedTensor`` (``TensorCoreFP8Layout``); without fp8 compute its forward casts through
    ``cast_bias_weight``, which dequantises (``codes.to(dtype) · scale``) and runs ``F.linear``.
Both are built as the host's loader builds them: the ops class picked by ``pick_operations``, the layers made by
it and the model's state (codes and scales from the host's own ``TensorCoreFP8Layout.quantize``) loaded into it.

int8 ConvRot (comfy-kitchen ``TensorWiseINT8Layout``, per-row scales, Hadamard groups of 4 so that the tiny
model's 24- and 40-wide inputs hold them): a ``QuantizedTensor`` weight in a ``MixedPrecisionOps.Linear``, whose
forward, where comfy-kitchen has kernels (not ``full_precision_mm``), is ``F.linear(x, weight, bias)``:
comfy-kitchen's int8 matmul (``x`` rotated and rounded to int8 per row). The pack's own DiT holds the same
tensor as its loader keeps a comfy-kitchen layer (``formats.dit_layers``): an ``nn.Linear`` whose weight it is.
"""

from __future__ import annotations

import copy
import sys
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from native_h3_protocol import audio_to_rows, native_for, pad_circular, shifted_sigma, split_pack_state, to_rows
from qkv_through_layer import qkv_through_layer

from h3_core.formats.vdn import BranchWeights
from h3_core.models.hybrid import HybridContext
from h3_core.pipeline.noise import row_timesteps

# The linears of a block the released quantised files quantise (``formats.dit_layers``' int8 files, the fp8-scaled
# ones): (submodule, name).
BLOCK_LINEARS = (("attn", "qkv_proj"), ("attn", "out_proj"), ("mlp", "fc1"), ("mlp", "fc2"))
E4M3 = torch.float8_e4m3fn
CONVROT_GROUP = 4  # a power of 4 dividing every block linear's input width in the tiny model (24, 48, 40)


def host_comfy():
    """The test host's ``comfy.ops`` and ``comfy.quant_ops`` (its CPU mode set, as the host tests set it), or a skip
    when no host is installed."""
    from comfy_host import comfyui_root

    try:
        root = comfyui_root()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import comfy.options

    comfy.options.enable_args_parsing(False)
    from comfy.cli_args import args

    args.cpu = True
    import comfy.ops
    import comfy.quant_ops

    for name in ("scaled_fp8_ops", "mixed_precision_ops", "pick_operations"):
        if not hasattr(comfy.ops, name):
            pytest.skip(f"the host at {root} has no comfy.ops.{name} (these tests read ComfyUI 0.3.75's ops)")
    return comfy.ops, comfy.quant_ops


def block_layer_names(layers: int) -> list[str]:
    return [f"blocks.{i}.{part}.{name}" for i in range(layers) for part, name in BLOCK_LINEARS]


def set_layer(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent), attribute, layer)


# ---- the guard --------------------------------------------------------------------------------------------------


@dataclass
class Guard:
    """What a guarded layer saw: ``calls`` of its forward, and where its ``weight`` was read from outside it."""

    calls: int = 0
    depth: int = 0
    outside: list[str] = field(default_factory=list)


class _Guarded:
    """Mixin of a quantised layer: counts its calls and records each read of its ``weight`` made from anywhere but
    its own forward (the patch must run the layer as the host does, never take its weight)."""

    def forward(self, *args, **kwargs):
        guard = self.__dict__["_guard"]
        guard.calls += 1
        guard.depth += 1
        try:
            return super().forward(*args, **kwargs)
        finally:
            guard.depth -= 1

    def __getattr__(self, name):
        value = super().__getattr__(name)
        guard = self.__dict__.get("_guard")
        if name == "weight" and guard is not None and guard.depth == 0:
            caller = traceback.extract_stack(limit=2)[0]
            guard.outside.append(f"{caller.filename}:{caller.lineno} ({caller.name})")
        return value


_guarded_classes: dict[type, type] = {}


def guard(layer: nn.Module) -> Guard:
    """Turn ``layer`` into a guarded one of its own class (same state, same forward) and return its ``Guard``."""
    cls = type(layer)
    if cls not in _guarded_classes:
        _guarded_classes[cls] = type(f"Guarded{cls.__name__}", (_Guarded, cls), {})
    layer.__class__ = _guarded_classes[cls]
    layer.__dict__["_guard"] = Guard()
    return layer.__dict__["_guard"]


# ---- quantised models -------------------------------------------------------------------------------------------


@dataclass
class Quantised:
    """One format's models over the same weights: ``native`` (the native model, fp32, its block linears the
    quantised layers, each guarded: ``guards`` by name), ``held`` (the pack's DiT holding the same quantised layers
    or tensors), ``dequantised`` and ``native_dequantised`` (the pack's DiT and the native model with the weights
    those layers stand for, as plain fp32 linears)."""

    native: nn.Module
    held: nn.Module
    dequantised: nn.Module
    native_dequantised: nn.Module
    guards: dict[str, Guard]


def _native(pack: nn.Module, cfg) -> nn.Module:
    native = native_for(cfg).float()
    native.load_state_dict(split_pack_state(pack.state_dict())[0])
    return native


def fp32_models(pack64: nn.Module, cfg):
    """The fp32 pack DiT, the native model and the branch weights holding its weights (unquantised)."""
    pack = copy.deepcopy(pack64).float()
    branch = BranchWeights(cfg).float()
    branch.load_state_dict(split_pack_state(pack.state_dict())[1])
    return pack, _native(pack, cfg), branch


def _with_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, weight in weights.items():
            out.get_parameter(f"{name}.weight").copy_(weight)
    return out


def host_fp8(pack: nn.Module, cfg, form: str) -> Quantised:
    """The block linears quantised to e4m3 with a per-tensor scale by the host's ``TensorCoreFP8Layout.quantize``,
    held by the host's ``form`` ops (``"scaled_fp8"`` or ``"comfy_quant"``, module docstring)."""
    ops_module, quant_ops = host_comfy()
    names = block_layer_names(cfg.layers)
    if form == "scaled_fp8":
        ops = ops_module.pick_operations(torch.float32, torch.float32, load_device=torch.device("cpu"), scaled_fp8=E4M3)
        scale_key = "scale_weight"
    else:
        config = SimpleNamespace(layer_quant_config={name: {"format": "float8_e4m3fn"} for name in names})
        ops = ops_module.pick_operations(
            torch.float32, torch.float32, load_device=torch.device("cpu"), model_config=config
        )
        scale_key = "weight_scale"
    native = native_for(cfg).float()
    state, _ = split_pack_state(pack.state_dict())
    dequantised = {}
    for name in names:
        weight = state[f"{name}.weight"]
        codes, params = quant_ops.TensorCoreFP8Layout.quantize(weight.clone())
        assert codes.dtype == E4M3 and params["scale"].numel() == 1
        state[f"{name}.weight"], state[f"{name}.{scale_key}"] = codes, params["scale"]
        dequantised[name] = quant_ops.TensorCoreFP8Layout.dequantize(codes, params["scale"], torch.float32)
        out_features, in_features = weight.shape
        set_layer(native, name, ops.Linear(in_features, out_features, bias=False, device="cpu", dtype=torch.float32))
    native.load_state_dict(state)  # as the host's loader fills the model its ops built
    guards = {}
    for name in names:
        layer = native.get_submodule(name)
        stored = layer.weight
        if form == "scaled_fp8":
            assert type(stored) is nn.Parameter and stored.dtype == E4M3 and layer.comfy_cast_weights
        else:
            assert isinstance(stored, quant_ops.QuantizedTensor) and stored._qdata.dtype == E4M3
        guards[name] = guard(layer)
    held = copy.deepcopy(pack)
    for name in names:
        set_layer(held, name, native.get_submodule(name))  # the very same layer objects
    dense = (_with_weights(pack, dequantised), _with_weights(_native(pack, cfg), dequantised))
    return Quantised(native, stacked(held), *dense, guards)


def kitchen_int8(pack: nn.Module, cfg) -> Quantised:
    """The block linears quantised by comfy-kitchen to int8 ConvRot (per-row scales), each ``QuantizedTensor``
    held by a host ``MixedPrecisionOps.Linear`` in the native model and by the pack's own ``nn.Linear`` in its DiT
    (module docstring)."""
    from comfy_kitchen.tensor import QuantizedTensor

    ops_module, _ = host_comfy()
    ops = ops_module.mixed_precision_ops({}, torch.float32, full_precision_mm=False)
    names = block_layer_names(cfg.layers)
    native = _native(pack, cfg)
    state, _ = split_pack_state(pack.state_dict())
    held, dequantised, guards = copy.deepcopy(pack), {}, {}
    for name in names:
        weight = state[f"{name}.weight"]
        qt = QuantizedTensor.from_float(
            weight, "TensorWiseINT8Layout", per_channel=True, convrot=True, convrot_groupsize=CONVROT_GROUP
        )
        assert qt.dtype == torch.float32 and qt.layout_cls.get_plain_tensors(qt)[0].dtype == torch.int8
        dequantised[name] = qt.dequantize()
        out_features, in_features = weight.shape
        layer = ops.Linear(in_features, out_features, bias=False, device="cpu", dtype=torch.float32)
        layer.weight = nn.Parameter(qt, requires_grad=False)
        set_layer(native, name, layer)
        guards[name] = guard(layer)
        held.get_submodule(name).weight = nn.Parameter(qt, requires_grad=False)  # the same tensor, the pack's form
    dense = (_with_weights(pack, dequantised), _with_weights(_native(pack, cfg), dequantised))
    return Quantised(native, stacked(held), *dense, guards)


def stacked(pack: nn.Module) -> nn.Module:
    """The pack's DiT computing q, k and v in one call of ``qkv_proj`` (its forward), as the native block does. Its
    own form reads row slices of ``qkv_proj.weight`` (``low_memory.linear_rows``): a ``scaled_fp8`` layer's raw
    e4m3 codes (``F.linear`` refuses fp32 × e4m3, and the scale would be left out), and from a comfy-kitchen int8
    weight a dequantised slice, so its q, k and v would skip the int8 matmul the host runs."""
    return qkv_through_layer(pack)


# ---- one request through both models ----------------------------------------------------------------------------


@dataclass
class Request:
    """A native request (latents ``[1, C, T, H, W]`` / ``[1, 32, 2, Ta]``, text ``[1, L, text_dim]``, fp32; an even
    latent grid; no denoise masks) and the pack's ``PackedSequence`` of the same layout."""

    video: torch.Tensor
    audio: torch.Tensor
    text: torch.Tensor
    sigma: float
    packed: object
    payload: dict

    def native_rows(self, native, branch, patch_options) -> tuple[torch.Tensor, torch.Tensor]:
        """The patched native model's velocities as the pack's target rows: video ``[Nv, 96]``, audio ``[Na, 32]``."""
        timestep = torch.tensor([self.sigma * 1000.0], dtype=torch.float32)
        with torch.no_grad():
            out_video, out_audio = native(
                [self.video, self.audio], timestep, self.text, patch_options(native, branch), dict(self.payload)
            )
        return to_rows(pad_circular(-out_video)), audio_to_rows(-out_audio)

    def pack_rows(self, pack, native, window, shifts) -> tuple[torch.Tensor, torch.Tensor]:
        """The pack's VDN-H3 DiT on the same request (``test_native_patch.compare``'s inputs, without masks): the
        velocities of its target rows."""
        payload = self.payload
        cond_video = native.condition_rows(
            payload, "cond_video_latents", lambda z: to_rows(z.float()), "visual_cond_noise_aug", 0.999, 0
        )
        cond_audio = native.condition_rows(
            payload, "cond_audio_latents", lambda z: audio_to_rows(z.float()), "audio_cond_noise_aug", 1.0, 1
        )
        target_video, target_audio = to_rows(pad_circular(self.video)), audio_to_rows(self.audio)
        video_rows = torch.cat([r for r in (cond_video, target_video) if r is not None])
        audio_rows = torch.cat([r for r in (cond_audio, target_audio) if r is not None])
        n_cond_v, n_cond_a = video_rows.shape[0] - target_video.shape[0], audio_rows.shape[0] - target_audio.shape[0]
        t_v = 1.0 - self.sigma
        t_a = 1.0 - shifted_sigma(self.sigma, *shifts)
        timesteps, index = row_timesteps(
            self.packed, t_v, t_a, condition_audio_rows=n_cond_a,
            condition_video_t=max(t_v, payload.get("visual_cond_noise_aug", 0.999)),
            condition_audio_t=max(t_a, payload.get("audio_cond_noise_aug", 1.0)),
        )  # fmt: skip
        args = (video_rows, audio_rows, self.text[0], timesteps, index, *self.packed.model_inputs("cpu"))
        ctx = HybridContext(self.packed.layout, window, "ref", (0, self.text.shape[1]))
        with torch.no_grad():
            v_rows, a_rows = pack(*args, hybrid=ctx)
        return v_rows[n_cond_v:], a_rows[n_cond_a:]


@contextmanager
def layer_inputs(model: nn.Module, names, given: dict[str, torch.Tensor] | None = None):
    """Record what each layer ``names`` of ``model`` is called with (one call each, by name); with ``given``, the
    layer computes on ``given[name]`` instead of what it was called with."""
    seen: dict[str, torch.Tensor] = {}

    def hook(name):
        def pre(module, args):
            assert name not in seen, f"{name} called more than once in one evaluation"
            seen[name] = args[0].detach().clone()
            if given is not None:
                assert given[name].shape == args[0].shape, name
                return (given[name], *args[1:])
            return None

        return pre

    handles = [model.get_submodule(name).register_forward_pre_hook(hook(name)) for name in names]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def relative(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> float:
    """The largest difference of video and audio velocities, each relative to its own largest magnitude."""
    return max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want))
