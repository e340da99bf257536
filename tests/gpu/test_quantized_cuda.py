"""comfy-kitchen layers on a CUDA GPU (skipped without one): H3's int8 ConvRot files kept quantised, their
``F.linear`` running comfy-kitchen's int8 matmul, against the same files dequantised on load.

Files are written as ComfyUI writes them: each block linear quantised by comfy-kitchen's
``TensorWiseINT8Layout`` with ConvRot in groups of 256 (the released files' group), stored through the
``QuantizedTensor``'s ``state_dict`` beside its ``comfy_quant`` JSON bytes.

Tolerance of one linear, against the exact product with the dequantised weight ``W`` (fp64): the kernel rotates
each group of 256 activations by a normalised Hadamard matrix ``H`` (entries ±1/16) and quantises each row to
int8 with the scale ``s = amax|x H| / 127``, then multiplies exact integer codes. So each rotated activation is
off by at most ``s / 2`` (rounding) plus the rounding of the rotation in the activation dtype, at most
``2^-6 · r`` where ``r = Σ_group |x| / 16`` bounds ``|x H|``; the stored weight rows ``codes · scale`` are exact,
and the output is rounded once to bf16 (``2^-8`` relative). Per element,
``|y − y_exact| ≤ Σ_k (s / 2 + 2^-6 · r_k) · |codes_jk · scale_j| + 2^-8 · |y_exact|``, with ``s`` bounded by
``max r / 127``. A whole model is bounded looser, by a relative error of the outputs (5 %), and must differ
from the dequantised one (the kernel ran).
"""

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from h3_core.formats.checkpoints import load_h3_model
from h3_core.formats.dit_layers import KEPT
from h3_core.formats.kitchen import kitchen_support
from h3_core.formats.quantized_files import read_state_dict
from h3_core.formats.video_vae import load_video_vae
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.models.video_vae import VideoVAE, VideoVAEConfig
from h3_core.pipeline.packing import pack_sequence

# a GPU machine without comfy-kitchen runs the other GPU tests
QuantizedTensor = pytest.importorskip("comfy_kitchen.tensor", reason="comfy-kitchen is not installed").QuantizedTensor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = torch.device("cuda")
GROUP = 256
MARKER = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": GROUP}
CFG = DiTConfig(
    hidden=256,
    layers=2,
    heads=2,
    head_dim=128,
    ffn=512,
    text_dim=20,
    freq_dim=8,
    time_hidden=12,
    time_embed=10,
    rope_freqs=2,
)
VAE_CFG = VideoVAEConfig(
    decoder_layers=2, decoder_heads=2, decoder_head_dim=128, block_out_channels=(8,) * 6, norm_groups=4
)


def quantized_file(path, state: dict, layers) -> dict:
    """Save ``state`` with ``layers`` (weight keys) in ComfyUI's int8 ConvRot form; returns their QuantizedTensors."""
    out, oracle = {}, {}
    for key, value in state.items():
        if key in layers:
            qt = QuantizedTensor.from_float(
                value, "TensorWiseINT8Layout", per_channel=True, convrot=True, convrot_groupsize=GROUP
            )
            out.update({k: v.cpu() for k, v in qt.state_dict(key).items()})
            out[key.removesuffix(".weight") + ".comfy_quant"] = torch.tensor(
                list(json.dumps(MARKER).encode()), dtype=torch.uint8
            )
            oracle[key] = qt
        else:
            out[key] = value.cpu()
    save_file(out, str(path))
    return oracle


def random_state(module, seed, dtype):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.05)
    return {k: v.detach().to(dtype).contiguous() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def supported():
    ok, how = kitchen_support(
        "int8_tensorwise", "int8_convrot", torch.bfloat16, torch.device("cuda", torch.cuda.current_device())
    )
    if not ok:
        pytest.skip(f"comfy-kitchen keeps no int8 ConvRot layers on this GPU: {how}")
    return how


def linear_bound(x, codes, scale, exact):
    """The per-element bound of the module docstring for ``x @ (codes · scale)ᵀ`` against ``exact``."""
    r = x.double().abs().view(x.shape[0], -1, GROUP).sum(-1, keepdim=True) / GROUP**0.5
    r = r.expand(-1, -1, GROUP).reshape(x.shape)
    s = r.amax(dim=-1, keepdim=True) / 127
    weight = (codes.double() * scale.double().view(-1, 1)).abs()
    return (s / 2 + 2.0**-6 * r) @ weight.t() + 2.0**-8 * exact.abs()


def test_a_dit_linear_runs_the_int8_kernel_within_its_bound(tmp_path, supported):
    torch.manual_seed(0)
    weight = (torch.randn(2048, 5376) * 0.02).to(torch.bfloat16)
    path = tmp_path / "fc.safetensors"
    oracle = quantized_file(path, {"blocks.0.mlp.fc2.weight": weight}, {"blocks.0.mlp.fc2.weight"})
    kept = read_state_dict(path, ["blocks.0.mlp.fc2.weight"], device=DEV, held="kitchen").state
    dense = read_state_dict(path, ["blocks.0.mlp.fc2.weight"], device=DEV, held="dequantize").state
    w_kept, w_dense = kept["blocks.0.mlp.fc2.weight"], dense["blocks.0.mlp.fc2.weight"]
    assert isinstance(w_kept, QuantizedTensor) and not isinstance(w_dense, QuantizedTensor)
    codes, scale = w_kept.layout_cls.get_plain_tensors(w_kept)
    qt = oracle["blocks.0.mlp.fc2.weight"]
    assert torch.equal(codes.cpu(), qt.layout_cls.get_plain_tensors(qt)[0].cpu())
    x = (torch.randn(333, 5376, device=DEV) * torch.rand(1, 5376, device=DEV) * 3).to(torch.bfloat16)
    y = F.linear(x, w_kept)
    exact = x.double() @ w_kept.dequantize().double().t()  # the fp64 product with the weight the codes stand for
    error = (y.double() - exact).abs()
    assert (error <= linear_bound(x, codes, scale, exact)).all()
    assert not torch.equal(y, F.linear(x, w_dense))  # the int8 kernel ran, not a dequantised matmul
    assert torch.equal(w_dense, w_kept.dequantize())  # both paths dequantise alike


def packed_inputs(dtype):
    packed = pack_sequence(torch.ones(4, dtype=torch.long), 12, 2, 4, 5)
    g = torch.Generator().manual_seed(1)
    args = (
        torch.randn(packed.video_index.numel(), 96, generator=g),
        torch.randn(packed.audio_index.numel(), 32, generator=g),
        torch.randn(4, 20, generator=g),
        torch.tensor([0.3, 0.999]),
        torch.arange(packed.positions.shape[0]) % 2,
        packed.tags,
        packed.positions,
        packed.video_index,
        packed.audio_index,
        packed.text_index,
    )
    return tuple((a.to(dtype) if a.is_floating_point() else a).to(DEV) for a in args)


def relative(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("cfg", [CFG, replace(CFG, adaln_curve_grid=9, time_embed=8)], ids=["full", "pruned"])
def test_a_whole_tiny_model_kept_against_dequantised(tmp_path, supported, cfg):
    state = random_state(H3DiT(cfg), 0, torch.bfloat16)
    layers = {
        k
        for k in state
        if k.startswith("blocks.")
        and k.endswith(("attn.qkv_proj.weight", "attn.out_proj.weight", "mlp.fc1.weight", "mlp.fc2.weight"))
    }
    path = tmp_path / "minimax_h3_fl2va_int8_convrot.safetensors"
    quantized_file(path, state, layers)
    dtype = torch.float32 if cfg.adaln_curve_grid else torch.bfloat16  # a pruned model does not run in bf16 yet
    kept = load_h3_model(path, cfg=CFG, device=DEV, dtype=dtype)
    assert set(kept.quantized_layers.values()) == {KEPT} and len(kept.quantized_layers) == len(layers)
    dense = load_h3_model(path, cfg=CFG, device=DEV, dtype=dtype, held="dequantize")
    moved = load_h3_model(path, cfg=CFG, device="cpu", dtype=dtype, run_device=DEV).to(DEV)
    assert isinstance(moved.get_parameter(sorted(layers)[0]), QuantizedTensor)
    args = packed_inputs(dtype)
    with torch.no_grad():
        outputs = [m(*args) for m in (kept, dense, moved)]
    for got, want, again in zip(*outputs):
        assert 0 < relative(got, want) < 0.05
        assert torch.equal(got, again)


def test_the_video_vae_kept_against_dequantised(tmp_path, supported):
    state = random_state(VideoVAE(VAE_CFG), 3, torch.float16)
    layers = {
        k
        for k in state
        if k.startswith("decoder.transformer_blocks.")
        and k.endswith(("to_qkv.weight", "to_out.weight", "w1.weight", "w2.weight"))
    }
    path = tmp_path / "minimax_h3_video_vae_int8_convrot.safetensors"
    quantized_file(path, state, layers)
    kept = load_video_vae(path, device=DEV, dtype=torch.float16, cfg=VAE_CFG)
    assert all(isinstance(kept.get_parameter(k), QuantizedTensor) for k in layers)
    dense = load_video_vae(path, device="cpu", dtype=torch.float16, cfg=VAE_CFG).to(DEV)
    z = torch.randn(1, 24, 2, 4, 3, generator=torch.Generator().manual_seed(4)).to(DEV)
    with torch.no_grad():
        pixels = kept.decode_tiles(z)
        assert 0 < relative(pixels, dense.decode_tiles(z)) < 0.05
        kept.offload_decoder_blocks()  # the lowest-memory decode streams the kept layers from pinned host memory
        assert isinstance(kept.get_parameter(sorted(layers)[0]), QuantizedTensor)
        assert torch.equal(kept.decode_tiles(z), pixels)
