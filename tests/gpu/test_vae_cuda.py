"""GPU checks of the video decode: every way of copying frames off the device, the compiled blocks and the
streamed-weights fallback give the frames of the plain CPU decode (skipped without CUDA)."""

import threading

import pytest
import torch

from h3_core.media.mp4 import pixels_uint8
from h3_core.media.tiling import DecodeHooks, Tiling, decode_video
from h3_core.models.video_vae import VideoVAE, VideoVAEConfig, keeps_fp32

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TINY = VideoVAEConfig(
    decoder_layers=2, decoder_heads=2, decoder_head_dim=32, block_out_channels=(8,) * 6, norm_groups=4
)


@pytest.fixture(scope="module")
def vae_cpu():
    torch.manual_seed(0)
    vae = VideoVAE(TINY).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.normal_(0, 0.05)
    return vae


@pytest.fixture(scope="module")
def z():
    # 12 latents → 2 temporal windows; 40×52 latents → a 3×4 grid of 256 px tiles at 640×832.
    return torch.randn(24, 12, 40, 52, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def expected(vae_cpu, z):
    return decode_video(vae_cpu, z, tiling=Tiling(tiles_per_batch=3))


def cuda_copy(vae_cpu):
    vae = VideoVAE(TINY).eval()
    vae.load_state_dict(vae_cpu.state_dict())
    return vae.cuda()


@pytest.mark.parametrize("where", ["pageable", "pinned", "device"])
def test_frames_copied_off_the_device_in_every_way_are_the_cpu_frames(vae_cpu, z, expected, where):
    vae = cuda_copy(vae_cpu)
    out = {
        "pageable": None,
        "pinned": torch.empty(expected.shape, pin_memory=True),
        "device": torch.empty(expected.shape, device="cuda"),
    }[where]
    frames = decode_video(vae, z.cuda(), tiling=Tiling(tiles_per_batch=3), hooks=DecodeHooks(out=out))
    assert frames.device.type == ("cuda" if where == "device" else "cpu")
    torch.testing.assert_close(frames.cpu(), expected, atol=2e-4, rtol=0)
    # the frames handed over as the mp4's 8-bit values, made on the GPU: those of the frames returned, each
    # window's handed on while the next one decodes (once its rows were seen to arrive), the last at the end
    announced, ticks, seen_at = [], [], []

    def on_frames(start, values):
        announced.append(values.clone())
        seen_at.append(len(ticks))

    out = None if out is None else torch.empty_like(out)
    frames = decode_video(
        vae,
        z.cuda(),
        tiling=Tiling(tiles_per_batch=3),
        hooks=DecodeHooks(out=out, on_frames=on_frames, uint8_frames=True, progress=lambda d, t: ticks.append(d)),
    )
    assert torch.equal(torch.cat(announced), pixels_uint8(frames).cpu())
    assert len(announced) == 2 and seen_at[0] < len(ticks) == seen_at[1]


def test_a_cancelled_decode_into_pageable_memory_stops_its_copier(vae_cpu, z):
    vae = cuda_copy(vae_cpu)
    checks = []

    def check_cancel():  # the cancel comes once the first tile row's rows were handed to the copier
        checks.append(1)
        if len(checks) > 6:
            raise InterruptedError("cancelled")

    with pytest.raises(InterruptedError):
        decode_video(vae, z.cuda(), tiling=Tiling(tiles_per_batch=1), hooks=DecodeHooks(check_cancel=check_cancel))
    assert not [t for t in threading.enumerate() if t.name == "h3-decode-copy-out"]


def test_compiled_blocks_give_the_eager_frames(vae_cpu, z, expected):
    vae = cuda_copy(vae_cpu)
    frames = decode_video(vae, z.cuda(), tiling=Tiling(tiles_per_batch=4), compile="auto")
    plain = decode_video(vae, z.cuda(), tiling=Tiling(tiles_per_batch=4), compile="off")
    torch.testing.assert_close(frames, expected, atol=2e-4, rtol=0)
    torch.testing.assert_close(plain, expected, atol=2e-4, rtol=0)


def test_streamed_decoder_blocks_give_the_resident_frames(vae_cpu, z, expected):
    vae = cuda_copy(vae_cpu)
    said = vae.offload_decoder_blocks()
    assert "host memory" in said
    block = vae.decoder.transformer_blocks[0]
    assert all(p.device.type == "cpu" and p.is_pinned() for p in block.parameters())
    frames = decode_video(vae, z.cuda(), tiling=Tiling(tiles_per_batch=2))
    assert all(p.device.type == "cpu" for p in block.parameters())
    torch.testing.assert_close(frames, expected, atol=2e-4, rtol=0)


def test_half_precision_decode_stays_close(vae_cpu, z, expected):
    vae = cuda_copy(vae_cpu)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.startswith("decoder.transformer_blocks.") and not keeps_fp32(name):
                p.data = p.data.half()
    frames = decode_video(vae, z.cuda(), tiling=Tiling(tiles_per_batch=4))
    assert torch.isfinite(frames).all()
    assert (frames - expected).abs().max() < 2e-2
