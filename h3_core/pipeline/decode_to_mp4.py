"""The video decode streamed into the mp4: each decoder window's finished frames go to an ``Mp4Worker`` as soon
as they are final, so the clip is encoded on the host while the GPU decodes the next window, and only the last
window's frames and the audio are left to write once the decode ends. The file is the one ``decode_video``
followed by ``write_mp4`` makes, frame for frame."""

from __future__ import annotations

from pathlib import Path

import torch

from ..mp4 import Mp4Worker, Mp4Writer
from ..tiling import decode_video

__all__ = ["decode_to_mp4"]


def decode_to_mp4(vae, latents: torch.Tensor, writer: Mp4Writer, **decode_options) -> tuple[Path, torch.Tensor, float]:
    """Decode ``latents`` (``decode_video``'s arguments in ``decode_options``) into ``writer``; returns the mp4's
    path, the frames ``[F, H, W, 3]`` in [0, 1] and the seconds between the decode's end and the file's. Any
    failure or cancel (``check_cancel`` raising) removes the partial file."""
    with Mp4Worker(writer) as worker:
        frames = decode_video(vae, latents, on_frames=lambda start, ready: worker.put(ready), **decode_options)
        path = worker.close(decode_options.get("check_cancel"))
    return path, frames, worker.tail_s
