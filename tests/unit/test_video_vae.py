"""The video VAE (h3_core.models.video_vae) against diffusers 0.42.1's AutoencoderKLMiniMaxH3: modules,
checkpoint layouts and refusals, and the tiled decode of a whole clip."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3_core.errors import H3InputError
from h3_core.formats.video_vae import load_video_vae
from h3_core.media.tiling import DecodeHooks, Tiling, decode_video
from h3_core.models.video_vae import IMAGENET_MEAN, IMAGENET_STD, VideoVAEConfig, keeps_fp32

diffusers = pytest.importorskip("diffusers")

STATS = dict(latents_mean=tuple(0.1 * i for i in range(24)), latents_std=tuple(1.0 + 0.05 * i for i in range(24)))
TINY = dict(decoder_layers=2, decoder_heads=2, decoder_head_dim=16, block_out_channels=(8,) * 6, norm_groups=4)
TINY_DIFFUSERS = dict(
    decoder_num_layers=2,
    decoder_num_attention_heads=2,
    decoder_attention_head_dim=16,
    block_out_channels=(8,) * 6,
    norm_num_groups=4,
)


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    model = diffusers.AutoencoderKLMiniMaxH3(**TINY_DIFFUSERS, **STATS).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


@pytest.fixture(scope="module")
def folder(reference, tmp_path_factory):
    path = tmp_path_factory.mktemp("vae")
    reference.save_pretrained(path)
    return path


def tiny_cfg():
    return VideoVAEConfig(**TINY, **STATS)


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_released_defaults():
    cfg = VideoVAEConfig()
    assert (cfg.spatial_ratio, cfg.temporal_ratio, cfg.decoder_dim, cfg.rope_dim) == (16, 4, 2048, 48)
    assert cfg.decoder_layers == 36 and len(cfg.latents_mean) == 24


def test_diffusers_folder_loads_and_decodes_identically(reference, folder):
    vae = load_video_vae(folder, dtype=torch.float32, cfg=tiny_cfg())
    assert vae.layout == "diffusers"
    for shape in [(2, 24, 3, 2, 3), (1, 24, 7, 4, 1)]:
        z = randn(*shape, seed=shape[2])
        with torch.no_grad():
            ours = vae.decode_tiles(z)
            ref = reference.decoder(reference.post_quant_conv(z))
        assert ours.shape == ref.shape and (ours - ref).abs().max() <= 1e-5


def test_encoder_moments_match(reference, folder):
    vae = load_video_vae(folder, dtype=torch.float32, cfg=tiny_cfg())
    for frames in (17, 1):
        x = randn(1, 3, frames, 48, 32, seed=frames)
        with torch.no_grad():
            ours = vae.encode_moments(x)
            ref = reference.quant_conv(reference.encoder(x))
        assert ours.shape == ref.shape == (1, 48, 5 if frames == 17 else 1, 3, 2)
        assert (ours[:, :24] - ref[:, :24]).abs().max() <= 1e-5
        assert (ours[:, 24:] - ref[:, 24:].clamp(-30, 20)).abs().max() <= 1e-5


def test_config_json_supplies_the_latent_statistics(folder):
    sizes = VideoVAEConfig(**TINY)  # released statistics, replaced by the folder's
    vae = load_video_vae(folder, dtype=torch.float32, cfg=sizes)
    assert vae.cfg.latents_mean == pytest.approx(STATS["latents_mean"])
    assert vae.cfg.latents_std == pytest.approx(STATS["latents_std"])
    z = randn(24, 2, 1, 1)
    assert torch.allclose(vae.denormalize_latents(vae.normalize_latents(z)), z, atol=1e-6)


def test_half_precision_keeps_the_released_fp32_islands(reference, folder):
    vae = load_video_vae(folder, dtype=torch.float16, cfg=tiny_cfg())
    dtypes = {k: v.dtype for k, v in vae.state_dict().items()}
    assert all((dt == torch.float32) == keeps_fp32(k) for k, dt in dtypes.items())
    assert dtypes["decoder.transformer_blocks.0.attn.to_qkv.weight"] == torch.float16
    assert dtypes["decoder.proj_out.weight"] == torch.float32
    z = randn(1, 24, 2, 2, 2)
    with torch.no_grad():
        err = (vae.decode_tiles(z) - reference.decoder(reference.post_quant_conv(z))).abs().max()
    assert err < 5e-3


def test_whole_clip_decode_matches_the_released_decoder(reference, folder):
    vae = load_video_vae(folder, dtype=torch.float32, cfg=tiny_cfg())
    latents = randn(24, 7, 2, 20, seed=5)  # model space; one row of 2 tiles
    frames = decode_video(vae, latents, tiling=Tiling(tiles_per_batch=2))
    with torch.no_grad():
        raw = vae.denormalize_latents(latents)
        ref = reference._decode(raw[None])[0]
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1, 1)
    expected = (ref * std + mean).clamp(0, 1).permute(1, 2, 3, 0)
    assert frames.shape == (22, 32, 320, 3)
    assert (frames - expected).abs().max() <= 1e-5


# --- refusals -----------------------------------------------------------------------------------


def weights(folder):
    return load_file(str(folder / "diffusion_pytorch_model.safetensors"))


def test_missing_key_names_the_file_layout_and_key(folder, tmp_path):
    sd = weights(folder)
    del sd["decoder.transformer_blocks.1.attn.to_k.bias"]
    path = tmp_path / "broken.safetensors"
    save_file(sd, str(path))
    with pytest.raises(
        H3InputError,
        match=r"broken\.safetensors: not a MiniMax H3 video VAE checkpoint.*closest to "
        r"the diffusers layout but missing 1 keys, first \['decoder\.transformer_blocks\.1\.attn\.to_k\.bias'\]",
    ):
        load_video_vae(path, cfg=tiny_cfg())


def test_unexpected_key_is_refused(folder, tmp_path):
    sd = weights(folder)
    sd["decoder.extra.weight"] = torch.zeros(2)
    path = tmp_path / "extra.safetensors"
    save_file(sd, str(path))
    with pytest.raises(H3InputError, match=r"1 unexpected keys, first \['decoder\.extra\.weight'\]"):
        load_video_vae(path, cfg=tiny_cfg())


def test_wrong_shape_is_refused(folder, tmp_path):
    sd = weights(folder)
    sd["decoder.proj_in.weight"] = torch.zeros(32, 25)
    path = tmp_path / "shape.safetensors"
    save_file(sd, str(path))
    with pytest.raises(H3InputError, match=r"key 'decoder\.proj_in\.weight' has shape \(32, 25\).*needs \(32, 24\)"):
        load_video_vae(path, cfg=tiny_cfg())


def test_int8_tensors_without_a_quantization_sidecar_are_refused(folder, tmp_path):
    sd = weights(folder)
    sd["decoder.proj_out.weight"] = sd["decoder.proj_out.weight"].to(torch.int8)
    path = tmp_path / "int8.safetensors"
    save_file(sd, str(path))
    with pytest.raises(
        H3InputError,
        match=r"int8\.safetensors: holds I8 tensors that no ComfyUI quantization sidecar "
        r"\(comfy_quant\) describes, first \['decoder\.proj_out\.weight'\]",
    ):
        load_video_vae(path, cfg=tiny_cfg())


def test_an_audio_vae_is_not_a_video_vae(tmp_path):
    audio = diffusers.AutoencoderKLMiniMaxH3Audio()
    path = tmp_path / "audio.safetensors"
    save_file({k: v.contiguous() for k, v in audio.state_dict().items()}, str(path))
    with pytest.raises(H3InputError, match=r"audio\.safetensors: not a MiniMax H3 video VAE checkpoint"):
        load_video_vae(path, cfg=tiny_cfg())


def test_not_a_safetensors_file(tmp_path):
    path = tmp_path / "notes.safetensors"
    path.write_bytes(b"\x00\x01hello")
    with pytest.raises(H3InputError, match="notes.safetensors: too short to be a safetensors file"):
        load_video_vae(path)
    other = tmp_path / "model.ckpt"
    other.write_bytes(b"x" * 100)
    with pytest.raises(H3InputError, match=r"model\.ckpt: not a \.safetensors file"):
        load_video_vae(other)


def comfy_file(folder, path, dtype=torch.float16):
    """The diffusers weights rewritten as ComfyUI's single file, written out independently of the loader:
    renamed encoder levels, per-head interleaved qkv, [gate; up] w1, a mask token and the statistics."""
    sd = weights(folder)
    out = {}
    heads, dim_head = 2, 16
    for key, value in sd.items():
        k = key
        k = k.replace("encoder.down_blocks.", "encoder.down.").replace(".resnets.", ".block.")
        k = k.replace(".conv_shortcut.", ".nin_shortcut.").replace(".downsamplers.0.", ".downsample.")
        k = k.replace("decoder.proj_in.", "decoder.x_embedder.").replace(".attn.to_out.0.", ".attn.to_out.")
        k = k.replace(".ff.net.2.", ".ff.w2.")
        if ".ff.net.0.proj." in k:
            up, gate = value.chunk(2)
            out[k.replace(".ff.net.0.proj.", ".ff.w1.")] = torch.cat([gate, up])
        elif ".attn.to_q." in k:
            parts = [sd[key.replace("to_q", x)] for x in ("to_q", "to_k", "to_v")]
            rows = [p.view(heads, dim_head, *p.shape[1:]) for p in parts]
            out[k.replace(".to_q.", ".to_qkv.")] = torch.stack(rows, 1).reshape(-1, *parts[0].shape[1:])
        elif ".attn.to_k." in k or ".attn.to_v." in k:
            continue
        else:
            out[k] = value
    out = {k: v.to(dtype) for k, v in out.items()}
    out["decoder.mask_token"] = torch.zeros(1, 1, 32, dtype=dtype)
    out["latents_mean"] = torch.tensor(STATS["latents_mean"], dtype=dtype)
    out["latents_std"] = torch.tensor(STATS["latents_std"], dtype=dtype)
    save_file(out, str(path))
    return path


def test_comfy_single_file_loads_and_decodes_identically(reference, folder, tmp_path):
    path = comfy_file(folder, tmp_path / "minimax_h3_video_vae_fp16.safetensors", dtype=torch.float32)
    vae = load_video_vae(path, dtype=torch.float32, cfg=VideoVAEConfig(**TINY))
    assert vae.layout == "ComfyUI/official"
    assert vae.cfg.latents_mean == pytest.approx(STATS["latents_mean"], abs=1e-6)
    z = randn(1, 24, 3, 2, 2, seed=8)
    with torch.no_grad():
        assert (vae.decode_tiles(z) - reference.decoder(reference.post_quant_conv(z))).abs().max() <= 1e-5
        x = randn(1, 3, 17, 32, 32, seed=9)
        assert (vae.encode_moments(x)[:, :24] - reference.quant_conv(reference.encoder(x))[:, :24]).abs().max() <= 1e-5


def test_comfy_fp16_file(reference, folder, tmp_path):
    path = comfy_file(folder, tmp_path / "fp16.safetensors")
    vae = load_video_vae(path, dtype=torch.float16, cfg=VideoVAEConfig(**TINY))
    assert vae.encoder.conv_in.weight.dtype == torch.float32  # the fp32 islands are widened from fp16
    z = randn(1, 24, 2, 2, 2, seed=10)
    with torch.no_grad():
        err = (vae.decode_tiles(z) - reference.decoder(reference.post_quant_conv(z))).abs().max()
    assert err < 2e-2


def test_truncated_file_says_so(folder, tmp_path):
    data = (folder / "diffusion_pytorch_model.safetensors").read_bytes()
    path = tmp_path / "partial.safetensors"
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(
        H3InputError,
        match=rf"partial\.safetensors: truncated: the header describes {len(data)} bytes "
        rf"but the file has {len(data) - 1000}; download it again",
    ):
        load_video_vae(path, cfg=tiny_cfg())


@pytest.mark.parametrize("frames, size", [(1, (48, 32)), (22, (32, 48)), (17, (320, 288)), (17, (32, 64))])
def test_encode_matches_the_released_encoder(reference, folder, frames, size):
    from h3_core.media.tiling import encode_tiled

    vae = load_video_vae(folder, dtype=torch.float32, cfg=tiny_cfg())
    pixels = randn(3, frames, *size, seed=frames)
    with torch.no_grad():
        ours = encode_tiled(vae.encode_moments, pixels)
        ref = reference._encode(pixels[None])[0]
    expected_t = 1 if frames == 1 else (frames + (-frames % 17)) // 17 * 5 - 3
    assert ours.shape == ref.shape == (48, expected_t, size[0] // 16, size[1] // 16)
    assert (ours[:24] - ref[:24]).abs().max() <= 1e-5


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_encode_shapes_on_the_frame_grid(folder, k):
    from h3_core.media.tiling import encode_video

    vae = load_video_vae(folder, dtype=torch.float32, cfg=tiny_cfg())
    z = encode_video(vae, torch.rand(17 * k + 5, 32, 48, 3))
    assert z.shape == (24, 5 * k + 2, 2, 3) and torch.isfinite(z).all()


def test_conditioning_encode_is_seeded_and_fp16_rounded(folder):
    from h3_core.media.tiling import encode_video

    vae = load_video_vae(folder, dtype=torch.float32, cfg=tiny_cfg())
    image = torch.rand(1, 48, 32, 3, generator=torch.Generator().manual_seed(3))
    a, b = encode_video(vae, image), encode_video(vae, image)
    assert torch.equal(a, b) and a.shape == (24, 1, 3, 2)
    raw = vae.denormalize_latents(a)
    assert torch.allclose(raw, raw.half().float(), atol=1e-5)
    assert not torch.equal(a, encode_video(vae, image, sample=False))


def test_compiled_blocks_equal_the_eager_blocks(reference, folder):
    vae = load_video_vae(folder, dtype=torch.float32, cfg=tiny_cfg())
    z = randn(2, 24, 2, 2, 2, seed=11)
    with torch.no_grad():
        eager = vae.decode_tiles(z)
        compiled = vae.decode_tiles(z, compiled=True)
        again = vae.decode_tiles(z)  # the choice is per call: nothing stays switched
    assert (compiled - eager).abs().max() <= 1e-5
    assert torch.equal(again, eager)


def test_official_folder_with_weights_in_source(reference, folder, tmp_path):
    import json

    official = tmp_path / "video_vae"
    (official / "source").mkdir(parents=True)
    comfy_file(folder, official / "source" / "model.safetensors", dtype=torch.float32)
    # the official wrapper config carries the statistics; its file has none
    from safetensors.torch import load_file as _load

    sd = _load(str(official / "source" / "model.safetensors"))
    del sd["latents_mean"], sd["latents_std"]
    save_file(sd, str(official / "source" / "model.safetensors"))
    (official / "config.json").write_text(json.dumps({"latents_mean": [0.5] * 24, "latents_std": [3.0] * 24}))
    vae = load_video_vae(official, dtype=torch.float32, cfg=VideoVAEConfig(**TINY))
    assert vae.layout == "ComfyUI/official" and vae.cfg.latents_std == (3.0,) * 24
    z = randn(1, 24, 2, 2, 2, seed=12)
    with torch.no_grad():
        assert (vae.decode_tiles(z) - reference.decoder(reference.post_quant_conv(z))).abs().max() <= 1e-5


def test_streamed_decoder_blocks_decode_identically(folder):
    vae = load_video_vae(folder, dtype=torch.float32, cfg=tiny_cfg())
    z = randn(1, 24, 2, 2, 2, seed=13)
    with torch.no_grad():
        before = vae.decode_tiles(z)
        said = vae.offload_decoder_blocks()
        after = vae.decode_tiles(z)
    assert "2 blocks now stay in host memory" in said
    assert "already" in vae.offload_decoder_blocks()
    assert torch.equal(before, after)


def test_decode_falls_back_to_streamed_blocks_when_a_tile_does_not_fit(folder, monkeypatch):
    vae = load_video_vae(folder, dtype=torch.float32, cfg=tiny_cfg())
    latents = randn(24, 7, 2, 2, seed=14)
    expected = decode_video(vae, latents)
    real = vae.decode_tiles

    def tight(tiles, overrides=None):
        if not getattr(vae, "_offloaded", False):
            raise torch.OutOfMemoryError("fake: the weights fill the card")
        return real(tiles, overrides)

    monkeypatch.setattr(vae, "decode_tiles", tight)
    said = []
    frames = decode_video(vae, latents, tiling=Tiling(tiles_per_batch=2), hooks=DecodeHooks(report=said.append))
    assert torch.equal(frames, expected)
    assert said[-1].startswith("video decode ran out of memory with 1 tile per batch; the decoder's 2 blocks")


def test_a_vae_left_on_meta_reads_later_what_a_direct_load_reads(folder):
    """``device="meta"`` reads nothing yet gives every tensor the dtype and shape the read will; ``read_weights``
    then reads exactly what a direct load reads, once."""
    from h3_core.formats.vae import read_weights

    direct = load_video_vae(folder, dtype=torch.float16, cfg=tiny_cfg())
    deferred = load_video_vae(folder, device="meta", dtype=torch.float16, cfg=tiny_cfg())
    want = direct.state_dict()
    assert all(t.is_meta for t in deferred.state_dict().values()) and deferred.layout is None
    assert {k: (t.dtype, t.shape) for k, t in deferred.state_dict().items()} == {
        k: (t.dtype, t.shape) for k, t in want.items()
    }
    assert {t.dtype for t in want.values()} == {torch.float16, torch.float32}  # the released mix, not one dtype
    assert read_weights(deferred, "cpu") and not read_weights(deferred, "cpu")
    assert deferred.layout == direct.layout == "diffusers"
    got = deferred.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
