"""The audio VAE (h3_core.models.audio_vae) against diffusers 0.42.1's AutoencoderKLMiniMaxH3Audio."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3_core.errors import H3InputError
from h3_core.formats.audio_vae import load_audio_vae
from h3_core.models.audio_vae import AudioVAEConfig, kaiser_sinc

diffusers = pytest.importorskip("diffusers")

SIZES = dict(encoder_dim=4, latent_dim=32, latent_channels=8, decoder_dim=256)
STATS = dict(latents_mean=[0.1 * i for i in range(8)], latents_std=[1.0 + 0.1 * i for i in range(8)])


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    model = diffusers.AutoencoderKLMiniMaxH3Audio(**SIZES, num_attention_heads=2, **STATS).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def folder(reference, tmp_path_factory):
    path = tmp_path_factory.mktemp("audio_vae")
    reference.save_pretrained(path)
    return path


def tiny_cfg():
    return AudioVAEConfig(**SIZES, attention_heads=2, latents_mean=(0.0,) * 8, latents_std=(1.0,) * 8)


def test_released_defaults():
    cfg = AudioVAEConfig()
    assert (cfg.hop, cfg.sample_rate, cfg.latent_channels) == (800, 32000, 32)
    assert cfg.latent_dim // cfg.attention_heads == 256


def test_loads_diffusers_folder_with_its_statistics(folder):
    vae = load_audio_vae(folder, cfg=tiny_cfg())
    assert vae.layout == "diffusers/official"
    assert vae.cfg.latents_mean == pytest.approx(tuple(STATS["latents_mean"]))
    assert all(p.dtype == torch.float32 for p in vae.parameters())
    z = torch.randn(2, 8, 3)
    assert torch.allclose(vae.denormalize_latents(vae.normalize_latents(z)), z, atol=1e-6)


def test_encode_matches_the_posterior_mean(reference, folder):
    vae = load_audio_vae(folder, cfg=tiny_cfg())
    stereo = torch.randn(2, 1, 2500, generator=torch.Generator().manual_seed(1)) * 0.3  # L and R as a batch
    with torch.no_grad():
        ours = vae.encode_mean(stereo)
        ref = reference.encode(stereo).latent_dist.mode()
    assert ours.shape == ref.shape == (2, 8, 4)  # 2500 samples pad to 4 hops
    assert (ours - ref).abs().max() <= 1e-5


def test_decode_matches(reference, folder):
    vae = load_audio_vae(folder, cfg=tiny_cfg())
    z = torch.randn(2, 8, 5, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = vae.decode(z)
        ref = reference.decode(z).sample
    assert ours.shape == (2, 1, 4000)
    assert (ours - ref).abs().max() <= 1e-5
    assert ours.abs().max() <= 1.0


def test_weight_norm_is_folded_into_plain_weights(reference, folder):
    vae = load_audio_vae(folder, cfg=tiny_cfg())
    keys = set(vae.state_dict())
    assert not any(k.endswith(("weight_g", "weight_v")) for k in keys)
    conv = reference.decoder.conv_pre
    assert torch.allclose(vae.decoder.conv_pre.weight, torch._weight_norm(conv.weight_v, conv.weight_g, 0))


def test_resampling_filters_equal_the_stored_buffers(reference):
    stored = reference.decoder.activation_post.upsample.filter
    assert torch.equal(kaiser_sinc(0.25, 0.3, 12), stored)


def test_a_video_vae_is_not_an_audio_vae(tmp_path):
    video = diffusers.AutoencoderKLMiniMaxH3(
        block_out_channels=(8,) * 6,
        norm_num_groups=4,
        decoder_num_layers=1,
        decoder_num_attention_heads=2,
        decoder_attention_head_dim=16,
    )
    path = tmp_path / "video.safetensors"
    save_file({k: v.contiguous() for k, v in video.state_dict().items()}, str(path))
    with pytest.raises(H3InputError, match=r"video\.safetensors: not a MiniMax H3 audio VAE checkpoint"):
        load_audio_vae(path, cfg=tiny_cfg())


def test_missing_weight_norm_half_is_named(folder, tmp_path):
    sd = load_file(str(folder / "diffusion_pytorch_model.safetensors"))
    del sd["decoder.conv_post.weight_v"]
    path = tmp_path / "broken.safetensors"
    save_file(sd, str(path))
    with pytest.raises(H3InputError, match=r"missing 1 keys, first \['decoder\.conv_post\.weight_v'\]"):
        load_audio_vae(path, cfg=tiny_cfg())


def test_comfy_single_file_with_folded_weights_and_statistics(reference, folder, tmp_path):
    sd = load_file(str(folder / "diffusion_pytorch_model.safetensors"))
    comfy = {}
    for key, value in sd.items():
        if key.endswith(".weight_v"):
            stem = key[: -len(".weight_v")]
            g = sd[stem + ".weight_g"]
            comfy[stem + ".weight"] = g * value / value.norm(dim=(1, 2), keepdim=True)
        elif not key.endswith(".weight_g"):
            comfy[key] = value
    comfy["latents_mean"] = torch.tensor(STATS["latents_mean"])
    comfy["latents_std"] = torch.tensor(STATS["latents_std"])
    path = tmp_path / "minimax_h3_audio_vae_fp32.safetensors"
    save_file(comfy, str(path))
    vae = load_audio_vae(path, cfg=tiny_cfg())
    assert vae.layout == "ComfyUI"
    assert vae.cfg.latents_std == pytest.approx(tuple(STATS["latents_std"]))
    z = torch.randn(2, 8, 3, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (vae.decode(z) - reference.decode(z).sample).abs().max() <= 1e-5


def test_parametrized_weight_norm_names(reference, folder, tmp_path):
    sd = load_file(str(folder / "diffusion_pytorch_model.safetensors"))
    renamed = {
        k.replace(".weight_g", ".parametrizations.weight.original0").replace(
            ".weight_v", ".parametrizations.weight.original1"
        ): v
        for k, v in sd.items()
    }
    path = tmp_path / "parametrized.safetensors"
    save_file(renamed, str(path))
    vae = load_audio_vae(path, cfg=tiny_cfg())
    assert vae.layout == "parametrized weight norm"
    z = torch.randn(1, 8, 2)
    with torch.no_grad():
        assert (vae.decode(z) - reference.decode(z).sample).abs().max() <= 1e-5
