"""The library's decoders and encoders run under inference mode whatever the caller's grad state: on models fresh
from their constructors (parameters requiring grad), called with grad enabled, they give what they give under
no_grad, as inference tensors."""

import torch
from tiny_checkpoints import TINY_AUDIO_VAE, TINY_VIDEO_VAE

from h3_core.media.tiling import decode_video, encode_video
from h3_core.models.audio_vae import AudioVAE
from h3_core.models.video_vae import VideoVAE
from h3_core.pipeline.soundtrack import decode_soundtrack


def both_ways(fn):
    with torch.enable_grad():
        tracked = fn()
    with torch.no_grad():
        plain = fn()
    return tracked, plain


def test_the_video_decoder_and_encoder():
    torch.manual_seed(0)
    vae = VideoVAE(TINY_VIDEO_VAE).eval()
    assert all(p.requires_grad for p in vae.parameters())
    latents = torch.randn(24, 7, 2, 3, generator=torch.Generator().manual_seed(1))
    frames, want = both_ways(lambda: decode_video(vae, latents, compile="off"))
    assert torch.equal(frames, want) and frames.is_inference()
    encoded, want = both_ways(lambda: encode_video(vae, want[:5]))
    assert torch.equal(encoded, want) and encoded.is_inference()


def test_the_audio_decoder():
    torch.manual_seed(0)
    vae = AudioVAE(TINY_AUDIO_VAE).eval()
    assert all(p.requires_grad for p in vae.parameters())
    latents = torch.randn(2, 32, 6, generator=torch.Generator().manual_seed(2))
    waveform, want = both_ways(lambda: decode_soundtrack(vae, latents))
    assert torch.equal(waveform, want) and waveform.is_inference()
