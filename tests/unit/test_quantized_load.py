"""H3's quantised files loaded by the DiT and video VAE loaders (h3_core.formats.checkpoints,
h3_core.formats.dit_layers,
h3_core.models.video_vae): ``minimax_h3_*_int8_convrot`` (full and pruned) and
``minimax_h3_video_vae_int8_convrot``, written here as ComfyUI writes them (the released files' four block
linears ``qkv_proj``, ``out_proj``, ``fc1``, ``fc2`` and the VAE decoder blocks' linears quantised by
comfy-kitchen's ``TensorWiseINT8Layout`` with ConvRot, ``{"format": "int8_tensorwise", "convrot": true,
"convrot_groupsize": g}`` beside them; the group is 16 so that tiny layers hold it).

Dequantised on load (the CPU): every weight equals comfy-kitchen's own dequantisation of the file's tensors bit
for bit, so the model equals, output for output, the one loaded from those dequantised weights saved as a bf16
file. Kept as comfy-kitchen layers (the library's eager backend, the GPU-only device policy replaced by one that
allows the CPU): the codes are the file's, and the outputs differ from the dequantised model's by the int8
rounding of the activations only. LoRAs merge in fp32 into the dequantised weight, which is then rounded or
requantised by comfy-kitchen.
"""

import logging
from dataclasses import replace

import pytest
import torch
from comfy_kitchen.tensor import QuantizedTensor
from safetensors.torch import save_file
from test_quantized_files import INT8_CONVROT, quantized_layer
from tiny_dit import request

from h3_core.errors import H3BackendUnavailable, H3InputError
from h3_core.formats import kitchen
from h3_core.formats.checkpoints import describe_dit_checkpoint, load_h3_model
from h3_core.formats.dit_layers import KEPT, REQUANTISED
from h3_core.formats.video_vae import load_video_vae
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.models.video_vae import VideoVAE, VideoVAEConfig

CFG = DiTConfig(
    hidden=32,
    layers=2,
    heads=2,
    head_dim=16,
    ffn=64,
    text_dim=20,
    freq_dim=8,
    time_hidden=12,
    time_embed=10,
    rope_freqs=2,
)
PRUNED = replace(CFG, adaln_curve_grid=9, time_embed=4)
BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
VAE_CFG = VideoVAEConfig(
    decoder_layers=2, decoder_heads=2, decoder_head_dim=16, block_out_channels=(8,) * 6, norm_groups=4
)
VAE_LINEARS = ("attn.to_qkv", "attn.to_out", "ff.w1", "ff.w2")


def random_state(module: torch.nn.Module, seed: int, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
    return {
        k: v.detach().to(dtype if v.is_floating_point() else v.dtype).contiguous()
        for k, v in module.state_dict().items()
    }


def int8_convrot(state: dict, layers: list[str], prefix: str = "") -> tuple[dict, dict, dict]:
    """The file's tensors, the same state with those layers dequantised by comfy-kitchen (in the state's dtype),
    and each layer's ``QuantizedTensor``."""
    out, dequantised, oracle = {}, dict(state), {}
    for key, value in state.items():
        layer = key.removesuffix(".weight")
        if layer in layers:
            tensors, oracle[key] = quantized_layer(prefix + layer, value, INT8_CONVROT)
            out.update(tensors)
            dequantised[key] = oracle[key].dequantize()
        else:
            out[prefix + key] = value
    return out, dequantised, oracle


def dequantized(qt: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """comfy-kitchen's dequantisation of ``qt`` standing for a ``dtype`` weight."""
    codes = qt.layout_cls.get_plain_tensors(qt)[0]
    return QuantizedTensor(codes, qt.layout_cls.__name__, replace(qt.params, orig_dtype=dtype)).dequantize()


def block_layers(cfg: DiTConfig) -> list[str]:
    return [f"blocks.{i}.{name}" for i in range(cfg.layers) for name in BLOCK_LINEARS]


@pytest.fixture(scope="module")
def dit_files(tmp_path_factory):
    """By name: (int8_convrot file, dequantised bf16 file, oracle QuantizedTensors by weight key, config)."""
    root = tmp_path_factory.mktemp("int8")
    files = {}
    for name, cfg, prefix in (("full", CFG, ""), ("pruned", PRUNED, ""), ("prefixed", CFG, "model.diffusion_model.")):
        state = random_state(H3DiT(cfg), {"full": 0, "pruned": 1, "prefixed": 0}[name])
        quantized, dequantised, oracle = int8_convrot(state, block_layers(cfg), prefix)
        save_file(quantized, str(root / f"minimax_h3_fl2va_{name}_int8_convrot.safetensors"))
        save_file(dequantised, str(root / f"minimax_h3_fl2va_{name}_dequantised_bf16.safetensors"))
        files[name] = (
            root / f"minimax_h3_fl2va_{name}_int8_convrot.safetensors",
            root / f"minimax_h3_fl2va_{name}_dequantised_bf16.safetensors",
            oracle,
            cfg,
        )
    return files


@pytest.fixture
def allow_cpu_kernels(monkeypatch):
    monkeypatch.setattr(
        kitchen, "kitchen_support", lambda fmt, kind, dtype, device: (True, "comfy-kitchen's eager backend (test)")
    )


def run(model, dtype=torch.float32):
    _, args = request()
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    with torch.no_grad():
        return model(*args)


@pytest.mark.parametrize("name", ["full", "pruned", "prefixed"])
def test_described_from_the_header(dit_files, name):
    path, _, _, cfg = dit_files[name]
    info = describe_dit_checkpoint(path, cfg=CFG)
    assert info.quantization == (("int8_convrot", 8),) and not info.fp8_scaled
    assert info.curve == ((9, 4) if name == "pruned" else None) and info.layout == "ComfyUI"
    assert info.summary().endswith("quantised: int8_convrot (8 layers), 1 file(s)")


@pytest.mark.parametrize("name", ["full", "pruned", "prefixed"])
def test_dequantised_on_load_equals_comfy_kitchen_and_the_bf16_model(dit_files, name, caplog):
    path, plain, oracle, cfg = dit_files[name]
    with caplog.at_level(logging.INFO, logger="h3_core.formats.kitchen"):
        model = load_h3_model(path, cfg=CFG, dtype=torch.bfloat16)
    assert (
        f"{path.name}: int8_convrot (8 layers) dequantised on load to bfloat16: comfy-kitchen has no "
        f"int8_convrot kernels for cpu" in caplog.text
    )
    reference = load_h3_model(plain, cfg=CFG, dtype=torch.bfloat16)
    state, expected = model.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys()
    for key in state:
        assert state[key].dtype == expected[key].dtype and torch.equal(state[key], expected[key]), key
    for key, qt in oracle.items():
        assert torch.equal(state[key], qt.dequantize()), key
    assert model.quantized_layers == {k.removesuffix(".weight"): "dequantised" for k in oracle}
    assert model.linears == "bfloat16; quantised layers: dequantised: 8 layers"
    if name != "pruned":  # a pruned model does not run in bf16 yet
        for got, want in zip(run(model, torch.bfloat16), run(reference, torch.bfloat16)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["full", "pruned"])
def test_kept_as_comfy_kitchen_layers_runs_within_int8_activation_rounding(dit_files, name, allow_cpu_kernels):
    path, plain, oracle, cfg = dit_files[name]
    model = load_h3_model(path, cfg=CFG, dtype=torch.float32)
    reference = load_h3_model(plain, cfg=CFG, dtype=torch.float32)
    assert set(model.quantized_layers.values()) == {KEPT}
    for key, qt in oracle.items():
        weight = model.get_parameter(key)
        assert isinstance(weight, QuantizedTensor) and not weight.requires_grad
        assert torch.equal(weight.layout_cls.get_plain_tensors(weight)[0], qt.layout_cls.get_plain_tensors(qt)[0])
        assert torch.equal(weight.dequantize(), dequantized(qt, torch.float32)), key
    for got, want in zip(run(model), run(reference)):
        # each int8 matmul rounds its activations to 8 bits per row (a step of amax/127): a few per cent of the
        # output through two blocks, and not zero (the kernel ran, not a dequantised matmul)
        error = (got - want).norm() / want.norm()
        assert 0 < error < 0.05, error.item()


def write_lora(path, layers: dict[str, tuple[torch.Tensor, torch.Tensor]], alpha=None):
    tensors = {}
    for layer, (down, up) in layers.items():
        tensors[f"diffusion_model.{layer}.lora_down.weight"] = down
        tensors[f"diffusion_model.{layer}.lora_up.weight"] = up
        if alpha is not None:
            tensors[f"diffusion_model.{layer}.alpha"] = torch.tensor(float(alpha))
    save_file(tensors, str(path))
    return path


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    """Two LoRAs on a quantised layer (in merge order) and one also on a layer the file does not quantise."""
    root, g = tmp_path_factory.mktemp("loras"), torch.Generator().manual_seed(5)

    def pair(out, inp, rank=2):
        return torch.randn(rank, inp, generator=g) * 0.3, torch.randn(out, rank, generator=g) * 0.3

    first = write_lora(
        root / "first.safetensors",
        {"blocks.0.mlp.fc1": pair(2 * CFG.ffn, CFG.hidden), "condition_proj": pair(CFG.hidden, CFG.text_dim)},
    )
    second = write_lora(root / "second.safetensors", {"blocks.0.mlp.fc1": pair(2 * CFG.ffn, CFG.hidden)}, alpha=1)
    return [(first, 0.7), (second, -1.5)]


def merged_fp32(oracle, loras, layer="blocks.0.mlp.fc1"):
    """The layer's weight as comfy-kitchen dequantises it, in fp32, plus each LoRA's update, in order."""
    from safetensors.torch import load_file

    weight = dequantized(oracle[f"{layer}.weight"], torch.float32)
    for path, strength in loras:
        tensors = load_file(str(path))
        stem = f"diffusion_model.{layer}"
        down, up = tensors[f"{stem}.lora_down.weight"], tensors[f"{stem}.lora_up.weight"]
        scale = strength * float(tensors.get(f"{stem}.alpha", torch.tensor(down.shape[0]))) / down.shape[0]
        weight = weight + (up.float() @ down.float()) * scale
    return weight


def test_loras_merge_in_fp32_into_the_dequantised_weight(dit_files, loras):
    path, plain, oracle, _ = dit_files["full"]
    model = load_h3_model(path, cfg=CFG, dtype=torch.bfloat16, loras=loras)
    assert model.quantized_layers["blocks.0.mlp.fc1"] == "dequantised, LoRA merged in fp32"
    assert torch.equal(model.get_parameter("blocks.0.mlp.fc1.weight"), merged_fp32(oracle, loras).to(torch.bfloat16))
    # a layer the file does not quantise merges as in any bf16 model
    reference = load_h3_model(plain, cfg=CFG, dtype=torch.bfloat16, loras=loras)
    assert torch.equal(model.state_dict()["condition_proj.weight"], reference.state_dict()["condition_proj.weight"])
    assert [m.weights for m in model.merged_loras] == [2, 1]


def test_loras_on_kept_layers_are_requantised_by_comfy_kitchen(dit_files, loras, allow_cpu_kernels):
    path, _, oracle, _ = dit_files["full"]
    model = load_h3_model(path, cfg=CFG, dtype=torch.bfloat16, loras=loras)
    assert model.quantized_layers["blocks.0.mlp.fc1"] == REQUANTISED
    assert sum(v == KEPT for v in model.quantized_layers.values()) == 7
    weight = model.get_parameter("blocks.0.mlp.fc1.weight")
    expected = oracle["blocks.0.mlp.fc1.weight"].requantize_from_float(merged_fp32(oracle, loras))
    assert isinstance(weight, QuantizedTensor) and weight.dtype == torch.bfloat16 and weight.params.convrot
    plain = weight.layout_cls.get_plain_tensors
    for mine, theirs in zip(plain(weight), plain(expected)):
        assert torch.equal(mine, theirs)
    assert "requantised by comfy-kitchen after its LoRA merge: 1 layer" in model.linears


def test_loaded_to_the_cpu_for_a_gpu_keeps_the_decision_for_the_run_device(dit_files, monkeypatch):
    seen = []
    monkeypatch.setattr(
        kitchen,
        "kitchen_support",
        lambda fmt, kind, dtype, device: seen.append(device) or (False, f"nothing for {device}"),
    )
    path = dit_files["full"][0]
    load_h3_model(path, cfg=CFG, dtype=torch.bfloat16, run_device="cuda:0")
    assert seen and all(d == torch.device("cuda:0") for d in seen)


def test_fp8_linears_from_an_int8_file_are_quantised_at_load(dit_files, caplog):
    path, _, oracle, _ = dit_files["full"]
    with caplog.at_level(logging.INFO, logger="h3_core.formats.kitchen"):
        model = load_h3_model(path, cfg=CFG, dtype=torch.bfloat16, linears="fp8")
    assert "linears='fp8' requantises the big linears to e4m3" in caplog.text
    assert (
        model.fp8_layers["blocks.0.attn.qkv_proj"]
        == "quantised at load ('blocks.0.attn.qkv_proj.weight' is not fp8 in the file)"
    )
    assert model.linears == "fp8 (quantised at load)"


def test_vdn_h3_on_a_quantised_base(tmp_path, allow_cpu_kernels):
    from test_checkpoints import split_vdn

    state = random_state(H3DiT(replace(CFG, hybrid=True)), 4)
    base, branch = split_vdn(state)
    quantized, dequantised, oracle = int8_convrot(base, block_layers(CFG))
    for name, tensors in (("base", quantized), ("plain", dequantised), ("branch", branch)):
        save_file(tensors, str(tmp_path / f"{name}.safetensors"))
    model = load_h3_model(
        tmp_path / "base.safetensors",
        branch=tmp_path / "branch.safetensors",
        cfg=CFG,
        dtype=torch.float32,
        held="dequantize",
    )
    reference = load_h3_model(
        tmp_path / "plain.safetensors", branch=tmp_path / "branch.safetensors", cfg=CFG, dtype=torch.float32
    )
    assert model.layout == "ComfyUI + VDN-H3 v2" and model.cfg.hybrid
    for key, value in reference.state_dict().items():
        expected = dequantized(oracle[key], torch.float32) if key in oracle else value
        assert torch.equal(model.state_dict()[key], expected), key
    kept = load_h3_model(
        tmp_path / "base.safetensors", branch=tmp_path / "branch.safetensors", cfg=CFG, dtype=torch.float32
    )
    assert set(kept.quantized_layers) == {k.removesuffix(".weight") for k in oracle}
    assert not isinstance(kept.get_parameter("blocks.0.attn.to_out_linear.weight"), QuantizedTensor)


def test_held_choices_are_checked(dit_files):
    path = dit_files["full"][0]
    with pytest.raises(H3InputError, match=r"held: got 'int8'; allowed: 'auto' \(comfy-kitchen layers where"):
        load_h3_model(path, cfg=CFG, held="int8")
    with pytest.raises(
        H3BackendUnavailable,
        match=r"layer 'blocks\.0\.attn\.qkv_proj' \(int8_convrot\) cannot be "
        r"kept as a comfy-kitchen layer: comfy-kitchen has no int8_convrot "
        r"kernels for cpu",
    ):
        load_h3_model(path, cfg=CFG, held="kitchen")


def test_a_quantised_file_for_another_model_size_is_refused_before_loading(dit_files):
    path = dit_files["full"][0]
    with pytest.raises(H3InputError, match=r"do not fit the MiniMax H3 DiT of this config \(hidden 48"):
        describe_dit_checkpoint(path, cfg=replace(CFG, hidden=48))


# ---- the video VAE --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vae_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("vae")
    state = random_state(VideoVAE(VAE_CFG), 3, torch.float16)
    layers = [f"decoder.transformer_blocks.{i}.{n}" for i in range(VAE_CFG.decoder_layers) for n in VAE_LINEARS]
    quantized, dequantised, oracle = int8_convrot(state, layers)
    save_file(quantized, str(root / "minimax_h3_video_vae_int8_convrot.safetensors"))
    save_file(dequantised, str(root / "minimax_h3_video_vae_dequantised_fp16.safetensors"))
    return (
        root / "minimax_h3_video_vae_int8_convrot.safetensors",
        root / "minimax_h3_video_vae_dequantised_fp16.safetensors",
        oracle,
    )


def latents():
    return torch.randn(1, 24, 2, 3, 2, generator=torch.Generator().manual_seed(4))


def test_video_vae_dequantised_on_load_equals_the_fp16_vae(vae_files, caplog):
    path, plain, oracle = vae_files
    with caplog.at_level(logging.INFO, logger="h3_core.formats.kitchen"):
        vae = load_video_vae(path, dtype=torch.float16, cfg=VAE_CFG)
    assert (
        "int8_convrot (8 layers) dequantised on load to float16: comfy-kitchen has no int8_convrot kernels "
        "for cpu" in caplog.text
    )
    reference = load_video_vae(plain, dtype=torch.float16, cfg=VAE_CFG)
    for key, value in reference.state_dict().items():
        assert torch.equal(vae.state_dict()[key], value), key
    for key, qt in oracle.items():
        assert torch.equal(vae.state_dict()[key], qt.dequantize())
    with torch.no_grad():
        assert torch.equal(vae.decode_tiles(latents()), reference.decode_tiles(latents()))


def test_video_vae_kept_as_comfy_kitchen_layers(vae_files, allow_cpu_kernels):
    path, plain, oracle = vae_files
    vae = load_video_vae(path, dtype=torch.float32, cfg=VAE_CFG)
    reference = load_video_vae(plain, dtype=torch.float32, cfg=VAE_CFG)
    for key in oracle:
        assert isinstance(vae.get_parameter(key), QuantizedTensor), key
    with torch.no_grad():
        got, want = vae.decode_tiles(latents()), reference.decode_tiles(latents())
    error = (got - want).norm() / want.norm()
    assert 0 < error < 0.05, error.item()


def test_a_quantised_vae_read_later_keeps_its_comfy_kitchen_layers(vae_files, allow_cpu_kernels):
    """A quantised file left on the meta device (as the loader node leaves it) is read at the host's first load
    into the same comfy-kitchen layers a direct load keeps."""
    from h3_core.formats.vae import read_weights

    path, _, oracle = vae_files
    direct = load_video_vae(path, dtype=torch.float32, cfg=VAE_CFG)
    deferred = load_video_vae(path, device="meta", dtype=torch.float32, cfg=VAE_CFG)
    assert read_weights(deferred, "cpu")
    for key in oracle:
        assert isinstance(deferred.get_parameter(key), QuantizedTensor), key
    with torch.no_grad():
        assert torch.equal(deferred.decode_tiles(latents()), direct.decode_tiles(latents()))


def test_kept_qkv_runs_its_own_kernel_for_all_heads(dit_files, allow_cpu_kernels):
    """q, k and v of a comfy-kitchen ``qkv_proj``: with all heads, the layer's own int8 kernel once, its columns
    copied out (a slice of a ``QuantizedTensor`` is a plain dequantised tensor, so slices would multiply by the
    dequantised weight); a head group's rows still come from slices of the weight."""
    path, _, _, _ = dit_files["full"]
    model = load_h3_model(path, cfg=CFG, dtype=torch.float32)
    attn = model.blocks[0].attn
    x = torch.randn(5, CFG.hidden, generator=torch.Generator().manual_seed(3))
    inner = CFG.heads * CFG.head_dim
    with torch.no_grad():
        kernel = attn.qkv_proj(x)
        dequantised = torch.nn.functional.linear(x, attn.qkv_proj.weight.dequantize(), attn.qkv_proj.bias)
        q, k, v = attn.project(x)
        for i, got in enumerate((q, k, v)):
            assert got.is_contiguous() and torch.equal(got.reshape(5, inner), kernel[:, i * inner : (i + 1) * inner])
        assert not torch.equal(kernel, dequantised)  # the kernel rounds its activations
        q1, _, v1 = attn.project(x, heads=slice(1, 2))
        d = CFG.head_dim
        torch.testing.assert_close(q1.reshape(5, d), dequantised[:, d : 2 * d], rtol=0, atol=1e-5)
        torch.testing.assert_close(
            v1.reshape(5, d), dequantised[:, 2 * inner + d : 2 * inner + 2 * d], rtol=0, atol=1e-5
        )
