"""The video decode streamed into the mp4: each decoder window's finished frames go to an ``Mp4Worker`` as soon
as they are final (as the mp4's 8-bit values, made on the decoder's device), so the clip is encoded on the host
while the GPU decodes the next window, and only the last window's frames (the audio is encoded first, while the
first window decodes) are left to write once the decode ends. The file is the one ``decode_video`` followed by
``write_mp4`` makes, byte for byte."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import torch

from ..media.mp4 import ENCODER_NICENESS, Mp4Worker, Mp4Writer
from ..media.tiling import DecodeHooks, decode_video

__all__ = ["decode_to_mp4", "DecodedClip"]


class DecodedClip(NamedTuple):
    path: Path  # the finished mp4
    frames: torch.Tensor  # [F, H, W, 3] in [0, 1]
    tail_s: float  # seconds between the decode's end and the file's
    frames_behind: int  # frames the encoder had still to take when the decode ended


def decode_to_mp4(
    vae,
    latents: torch.Tensor,
    writer: Mp4Writer,
    *,
    hooks: DecodeHooks = DecodeHooks(),
    tail_cancel=None,
    encoder_niceness: int = ENCODER_NICENESS,
    **decode_options,
) -> DecodedClip:
    """Decode ``latents`` (``decode_video``'s ``hooks``, less their ``on_frames``, and its other arguments in
    ``decode_options``) into ``writer``, its encoder's threads ``encoder_niceness`` below the process (``Mp4Worker``).
    Any failure or cancel (``hooks.check_cancel`` raising, or ``tail_cancel`` while the encoder finishes after the
    decode: default ``hooks.check_cancel``; a check the ranks of a decode share is no check for this process alone)
    removes the partial file."""
    with Mp4Worker(writer, encoder_niceness) as worker:
        into_mp4 = dataclasses.replace(hooks, on_frames=lambda start, ready: worker.put(ready), uint8_frames=True)
        frames = decode_video(vae, latents, hooks=into_mp4, **decode_options)
        path = worker.close(tail_cancel if tail_cancel is not None else hooks.check_cancel)
    return DecodedClip(path, frames, worker.tail_s, worker.frames_behind)
