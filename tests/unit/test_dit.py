"""The H3 DiT (h3_core.models.dit) against diffusers 0.42.1's MiniMaxH3Transformer3DModel on the same random
weights, loaded through our key maps, and its native (ComfyUI) layout."""

import pytest
import torch
from safetensors.torch import save_file

from h3_core.errors import H3InputError
from h3_core.formats.checkpoints import load_h3_model
from h3_core.models.dit import DiTConfig, timestep_embedding
from h3_core.models.precision import keeps_fp32

diffusers = pytest.importorskip("diffusers")

TINY = dict(
    hidden=48,
    layers=2,
    heads=2,
    head_dim=32,
    ffn=64,
    refiner_layers=2,
    text_dim=40,
    freq_dim=16,
    time_hidden=24,
    time_embed=20,
    rope_freqs=4,
)
TINY_DIFFUSERS = dict(
    num_attention_heads=2,
    attention_head_dim=32,
    hidden_size=48,
    num_layers=2,
    num_refiner_layers=2,
    ffn_dim=64,
    text_dim=40,
    freq_dim=16,
    time_embed_hidden_dim=24,
    time_embed_dim=20,
    rope_freq_dim=4,
)


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    model = diffusers.MiniMaxH3Transformer3DModel(**TINY_DIFFUSERS).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def folder(reference, tmp_path_factory):
    path = tmp_path_factory.mktemp("transformer")
    reference.save_pretrained(path)
    return path


def packed(seed=0, L=5, Na=6, Nv=8):
    """A T2VA-like sequence [text | audio | video] with the audio at another timestep than the video."""
    g = torch.Generator().manual_seed(seed)
    T = L + Na + Nv
    text_index, audio_index, video_index = torch.arange(L), torch.arange(L, L + Na), torch.arange(L + Na, T)
    tags = torch.zeros(T, dtype=torch.long)
    tags[text_index], tags[audio_index] = 1, 2
    timestep_index = torch.zeros(T, dtype=torch.long)
    timestep_index[audio_index] = 1
    return dict(
        video_rows=torch.randn(Nv, 96, generator=g),
        audio_rows=torch.randn(Na, 32, generator=g),
        text_rows=torch.randn(L, 40, generator=g),
        timesteps=torch.tensor([0.3, 0.8]),
        timestep_index=timestep_index,
        tags=tags,
        positions=torch.randn(T, 3, generator=g) * 5,
        video_index=video_index,
        audio_index=audio_index,
        text_index=text_index,
    )


def reference_forward(reference, x):
    with torch.no_grad():
        out = reference(
            x["video_rows"][None],
            x["audio_rows"][None],
            x["text_rows"][None],
            x["timesteps"],
            x["timestep_index"],
            x["tags"],
            x["positions"],
            x["video_index"],
            x["audio_index"],
            x["text_index"],
        )
    return out.sample[0], out.audio_sample[0]


def test_released_defaults():
    cfg = DiTConfig()
    assert (cfg.inner, cfg.video_row, cfg.layers, cfg.heads) == (7168, 96, 50, 56)


def test_timestep_embedding_puts_cosines_first():
    emb = timestep_embedding(torch.tensor([0.0, 0.5]), 8)
    assert torch.equal(emb[0], torch.tensor([1.0] * 4 + [0.0] * 4))
    assert torch.allclose(emb[1, 0], torch.cos(torch.tensor(0.5)))


@pytest.mark.parametrize("seed", [0, 1])
def test_forward_equals_diffusers(reference, folder, seed):
    model = load_h3_model(folder, dtype=torch.float32, cfg=DiTConfig(**TINY))
    assert model.layout == "diffusers"
    x = packed(seed)
    with torch.no_grad():
        video, audio = model(**x)
    ref_video, ref_audio = reference_forward(reference, x)
    assert video.shape == (8, 96) and audio.shape == (6, 32)
    assert (video - ref_video).abs().max() <= 1e-4 * ref_video.abs().max()
    assert (audio - ref_audio).abs().max() <= 1e-4 * ref_audio.abs().max()


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_native_file_loads_to_identical_tensors(folder, tmp_path, prefix):
    model = load_h3_model(folder, dtype=torch.float32, cfg=DiTConfig(**TINY))
    path = tmp_path / "minimax_h3_t2va_bf16.safetensors"
    save_file({prefix + k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    again = load_h3_model(path, dtype=torch.float32, cfg=DiTConfig(**TINY))
    assert again.layout == "ComfyUI"
    for (k, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k
    x = packed(3)
    with torch.no_grad():
        assert all(torch.equal(p, q) for p, q in zip(model(**x), again(**x)))


def test_bf16_keeps_the_fp32_islands(folder):
    model = load_h3_model(folder, dtype=torch.bfloat16, cfg=DiTConfig(**TINY))
    for key, value in model.state_dict().items():
        assert (value.dtype == torch.float32) == keeps_fp32(key), key
    with torch.no_grad():
        video, audio = model(**packed(4))
    assert video.dtype == torch.float32 and torch.isfinite(video).all() and torch.isfinite(audio).all()


def test_a_vae_is_not_a_dit(tmp_path):
    path = tmp_path / "vae.safetensors"
    save_file({"encoder.conv_in.weight": torch.zeros(1), "decoder.proj_out.weight": torch.zeros(1)}, str(path))
    with pytest.raises(H3InputError, match=r"vae\.safetensors: not a MiniMax H3 DiT checkpoint this pack can load"):
        load_h3_model(path, cfg=DiTConfig(**TINY))


def test_official_shards_with_per_head_interleaved_qkv(folder, tmp_path):
    model = load_h3_model(folder, dtype=torch.float32, cfg=DiTConfig(**TINY))
    heads, head_dim = 2, 32
    official = {}
    for key, value in model.state_dict().items():
        if key.endswith("attn.qkv_proj.weight"):
            # stacked [q; k; v] → rows h·3·d + s·d + e, as the official shards store them
            value = value.view(3, heads, head_dim, -1).transpose(0, 1).reshape(3 * heads * head_dim, -1)
        official[key] = value.contiguous()
    keys = sorted(official)
    half = len(keys) // 2
    shards = tmp_path / "transformer"
    shards.mkdir()
    save_file({k: official[k] for k in keys[:half]}, str(shards / "model-00001-of-00002.safetensors"))
    save_file({k: official[k] for k in keys[half:]}, str(shards / "model-00002-of-00002.safetensors"))
    loaded = load_h3_model(shards, dtype=torch.float32, cfg=DiTConfig(**TINY), qkv_interleaved=True)
    assert loaded.layout == "official"
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    # read as stacked, the same file loads but computes something else: the flag matters
    wrong = load_h3_model(shards, dtype=torch.float32, cfg=DiTConfig(**TINY), qkv_interleaved=False)
    x = packed(5)
    with torch.no_grad():
        assert not torch.allclose(wrong(**x)[0], model(**x)[0])


@pytest.mark.parametrize(
    "spec, named",
    [
        (
            {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256},
            r"\(int8_convrot\): its 4 input columns are not a multiple of its convrot_groupsize 256",
        ),
        (
            {"format": "nvfp4"},
            r"\(nvfp4\): 'blocks\.0\.attn\.qkv_proj\.weight' holds 8 columns, not a multiple of the 16",
        ),
        ({"format": "mxfp8"}, r"is quantized as 'mxfp8', which this pack does not read"),
    ],
)
def test_malformed_or_unknown_quantized_comfy_files_are_refused(tmp_path, spec, named):
    import json

    sidecar = torch.tensor(list(json.dumps(spec).encode()), dtype=torch.uint8)
    dtype = torch.uint8 if spec["format"] == "nvfp4" else torch.int8
    path = tmp_path / "minimax_h3_fl2va_int8_convrot.safetensors"
    save_file(
        {
            "blocks.0.attn.qkv_proj.weight": torch.zeros(4, 4).to(dtype),
            "blocks.0.attn.qkv_proj.weight_scale": torch.ones(4, 1),
            "blocks.0.attn.qkv_proj.comfy_quant": sidecar,
        },
        str(path),
    )
    with pytest.raises(H3InputError, match=rf"{path.name}: layer 'blocks\.0\.attn\.qkv_proj' {named}"):
        load_h3_model(path, cfg=DiTConfig(**TINY))


def test_gguf_is_refused_by_name(tmp_path):
    path = tmp_path / "minimax_h3-Q4_K_M.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(H3InputError, match="GGUF checkpoints are not supported yet"):
        load_h3_model(path, cfg=DiTConfig(**TINY))


@pytest.mark.parametrize("form", ["comfy_quant", "scaled_fp8"])
def test_fp8_scaled_files_load_dequantised(tmp_path, folder, form):
    import json

    source = load_h3_model(folder, dtype=torch.float32, cfg=DiTConfig(**TINY))
    state, expected = {}, {}
    for key, value in source.state_dict().items():
        if key.startswith("blocks.") and key.endswith(("qkv_proj.weight", "fc1.weight", "fc2.weight")):
            scale = value.abs().amax() / 448
            q = (value / scale).to(torch.float8_e4m3fn)
            state[key] = q
            layer = key.removesuffix(".weight")
            if form == "comfy_quant":
                state[layer + ".weight_scale"] = scale.reshape(())
                state[layer + ".input_scale"] = torch.ones(())
                state[layer + ".comfy_quant"] = torch.tensor(
                    list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8
                )
            else:
                state[layer + ".scale_weight"] = scale.reshape(1)
            expected[key] = q.float() * scale
        else:
            state[key] = value.contiguous()
            expected[key] = value
    if form == "scaled_fp8":
        state["scaled_fp8"] = torch.zeros(2, dtype=torch.float8_e4m3fn)
    path = tmp_path / "minimax_h3_fl2va_fp8_scaled.safetensors"
    save_file(state, str(path))
    loaded = load_h3_model(path, dtype=torch.float32, cfg=DiTConfig(**TINY))
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key
    x = packed(2)
    with torch.no_grad():
        got, want = loaded(**x)[0], source(**x)[0]
    assert 0 < (got - want).abs().max() <= 0.1 * want.abs().max()  # fp8 rounding, not another model
