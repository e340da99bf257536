"""Keyframes at any frame of the clip, placed as ComfyUI's native H3 places its guides (``MiniMaxH3AddGuide`` in
comfy_extras/nodes_minimax_h3.py at Comfy-Org/ComfyUI 542de101, and ``PackedLayout`` in comfy/ldm/minimax/model.py
at 2c64d4aa).

The rule. A keyframe is a still image (one latent frame) or a clip of ``17k + 5`` frames (``5k + 2`` latents): a
batch of at least 5 images is cut to the largest such count, a shorter batch keeps only its first image. Its first
frame is anchored at a pixel frame of the target clip: ``frame_idx`` from 0 counts from the start, a negative one
from the end (-1 is the last frame), and the keyframe must fit, ``0 <= i`` and ``i + its frames <= the clip's
frames``. Nothing is snapped to a latent frame: the rows sit at the rotary time ``origin + 5/3 · i``, the image's
latent frames on the video clock from there. A soundtrack anchored with it starts at the same time, is cut to the
audio the clip has left after that time (``floor(Ta - 5/3 · i)`` latents per channel) and rides along clean. In the
packed sequence each keyframe's video rows come before its soundtrack's, keyframes in the order given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import H3InputError
from .geometry import CLIP, KEEP
from .packing import FRAME_RESCALE, FRAMES_PER_LATENT, KeyframeSlot, soundtrack_rows

__all__ = ["Keyframe", "guide_frames", "latent_span", "resolve_frame_index", "guide_audio_latents"]


def guide_frames(count: int) -> int:
    """How many of ``count`` images a keyframe keeps: 1 below 5, else the largest ``17k + 5`` within ``count``."""
    if count < KEEP:
        return 1
    return count - (count - KEEP) % CLIP


def latent_span(latent_frames: int) -> int:
    """The pixel frames ``latent_frames`` latents cover (1, 4, 4, 4, 4, 1, 4, ... frames each)."""
    return sum(FRAMES_PER_LATENT[k % 5] for k in range(latent_frames))


def resolve_frame_index(frame_idx: int, frame_count: int, frames: int = 1, name: str = "frame_idx") -> int:
    """``frame_idx`` (negative: from the end) → the pixel frame a keyframe of ``frames`` frames starts at in a clip
    of ``frame_count`` frames; an index that does not fit is an error naming the nearest ones that do."""
    if isinstance(frame_idx, bool) or not isinstance(frame_idx, int):
        raise H3InputError(f"{name} must be a whole frame index, got {frame_idx!r}")
    if frames > frame_count:
        raise H3InputError(f"{name}: a {frames}-frame keyframe does not fit in the clip's {frame_count} frames")
    resolved = frame_idx if frame_idx >= 0 else frame_count + frame_idx
    last = frame_count - frames
    if 0 <= resolved <= last:
        return resolved
    nearest = min(max(resolved, 0), last)
    what = "a still keyframe" if frames == 1 else f"a {frames}-frame keyframe clip"
    raise H3InputError(
        f"{name}: {frame_idx} does not place {what} inside the clip's {frame_count} frames; allowed: 0 to {last} "
        f"from the start or -{frame_count} to -{frames} from the end; nearest: {nearest} (or {nearest - frame_count})"
    )


def guide_audio_latents(frame_index: int, audio_latents: int) -> int:
    """The audio latents per channel a soundtrack anchored at pixel frame ``frame_index`` may keep in a clip
    with ``audio_latents`` of them: the rest of the clip's audio after that time."""
    return math.floor(audio_latents - FRAME_RESCALE * frame_index)


@dataclass(frozen=True)
class Keyframe:
    """One keyframe in model space: anchored with its first frame at pixel frame ``frame_index`` (resolved, from
    0), ``video`` ``[24, t, h, w]`` (``t`` 1 for an image or ``5k + 2`` for a clip) and/or ``audio`` its soundtrack
    ``[2, 32, Ta]``, at least one of the two."""

    frame_index: int
    video: torch.Tensor | None = None
    audio: torch.Tensor | None = None

    def slot(self, index: int, frames: int, height: int, width: int, audio_latents: int) -> KeyframeSlot:
        """Its geometry, checked against a clip of ``frames`` pixel frames on an ``height`` × ``width`` latent
        grid with ``audio_latents`` per channel (``index`` names it in errors)."""
        name = f"keyframe {index}"
        if self.video is None and self.audio is None:
            raise H3InputError(f"{name}: needs a video latent, an audio latent or both; got neither")
        latent_frames = 0
        if self.video is not None:
            shape = tuple(self.video.shape)
            if self.video.dim() != 4 or shape[0] != 24 or shape[2:] != (height, width):
                raise H3InputError(f"{name}: the video latent must be [24, t, {height}, {width}], got {shape}")
            latent_frames = shape[1]
            if latent_frames != 1 and latent_frames % KEEP != 2:
                raise H3InputError(
                    f"{name}: the video latent has {latent_frames} frames; allowed: 1 (an image) or 5k + 2 (a clip)"
                )
        span = latent_span(latent_frames) if latent_frames else 1
        resolve_frame_index(self.frame_index, frames, span, name=f"{name}: frame_index")
        if self.frame_index < 0:
            raise H3InputError(f"{name}: frame_index must be resolved (from 0), got {self.frame_index}")
        rows = 0
        if self.audio is not None:
            if self.audio.dim() != 3 or tuple(self.audio.shape[:2]) != (2, 32):
                raise H3InputError(f"{name}: the audio latent must be [2, 32, Ta], got {tuple(self.audio.shape)}")
            rows = int(self.audio.shape[2])
            room = guide_audio_latents(self.frame_index, audio_latents)
            if room < 1:
                raise H3InputError(
                    f"{name}: frame {self.frame_index} is past the end of the clip's audio ({audio_latents} latents)"
                )
            if rows > room:
                raise H3InputError(
                    f"{name}: its audio has {rows} latents but only {room} fit after frame {self.frame_index}; "
                    "crop it (guide_audio_latents)"
                )
        return KeyframeSlot(self.frame_index, latent_frames, rows)

    def audio_rows(self) -> torch.Tensor | None:
        """The soundtrack in row layout ``[2 · Ta, 32]``, left channel first."""
        return None if self.audio is None else soundtrack_rows(self.audio)
