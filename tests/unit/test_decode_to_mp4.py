"""The video decode streamed into the mp4 (h3_core.pipeline.decode_to_mp4) against its eager reference, the whole
decode (decode_video) then the whole write (write_mp4): the same frames and the same file, byte for byte; a
cancel during the decode leaves no file."""

import pytest
import torch
from tiny_checkpoints import TINY_VIDEO_VAE

from h3_core.media.mp4 import Mp4Writer, write_mp4
from h3_core.media.tiling import DecodeHooks, Tiling, decode_video, temporal_plan
from h3_core.models.video_vae import VideoVAE
from h3_core.pipeline.decode_to_mp4 import decode_to_mp4


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(1)
    return VideoVAE(TINY_VIDEO_VAE).eval()


def latents(T=12):
    return torch.randn(24, T, 2, 3, generator=torch.Generator().manual_seed(5))


def test_streamed_equals_decoding_then_writing(vae, tmp_path):
    z = latents()
    assert len(temporal_plan(z.shape[1]).windows) > 1
    sound = 0.1 * torch.randn(2, 32000, generator=torch.Generator().manual_seed(6))
    tags = {"prompt": "{}"}
    frames = decode_video(vae, z, compile="off")
    reference = write_mp4(tmp_path / "reference.mp4", frames, sound, 32000, metadata=tags)
    writer = Mp4Writer(tmp_path / "streamed.mp4", frames.shape[2], frames.shape[1], waveform=sound, metadata=tags)
    clip = decode_to_mp4(vae, z, writer, compile="off")
    assert torch.equal(clip.frames, frames)
    assert clip.path.read_bytes() == reference.read_bytes()
    assert clip.tail_s >= 0 and 0 <= clip.frames_behind <= frames.shape[0]


def test_a_cancel_during_the_decode_leaves_no_file(vae, tmp_path):
    batches = []

    def cancel():
        batches.append(1)
        if len(batches) >= 2:  # the second window: the first one's frames are already with the writer
            raise InterruptedError("cancelled")

    writer = Mp4Writer(tmp_path / "cancelled.mp4", 48, 32)
    with pytest.raises(InterruptedError):
        decode_to_mp4(
            vae,
            latents(),
            writer,
            compile="off",
            tiling=Tiling(tiles_per_batch=1),
            hooks=DecodeHooks(check_cancel=cancel),
        )
    assert list(tmp_path.iterdir()) == []
