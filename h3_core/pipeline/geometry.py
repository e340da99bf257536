"""Canvas and clip-length rules of H3 requests.

* Frames: ``17k + 5`` at 24 fps (the video VAE encodes 17-frame clips into 5 latents and drops the last 3
  latents once), so ``17k + 5`` frames are ``5k + 2`` latent frames. The model was trained on 124–362
  frames; other lengths work but leave that range, and say so.
* Canvas: both sides on the 16-px grid of the latent, at least 32 px. A side that is an odd number of latents
  (a multiple of 16 px but not of 32) is padded to whole 2×2 patches for the model and cropped after, as
  ComfyUI's native H3 does (``packing.pad_to_patch``). From an aspect ratio: the short edge aims at 768, the area
  is capped at 768 × 1344, then both sides round to the nearest 32 (as released); aspect ratios from 1:4 to 4:1.
* Audio: 40 latents per second (hop 800 at 32 kHz), so ``round(frames / 24 · 40)`` per channel.
"""

from __future__ import annotations

import warnings

from ..errors import H3InputError

__all__ = [
    "FPS",
    "CANVAS_MULTIPLE",
    "LATENT_PX",
    "TRAINED_FRAMES",
    "canvas_size",
    "check_canvas",
    "check_frames",
    "snap_frames",
    "latent_frames",
    "audio_latents",
]

FPS = 24
CANVAS_MULTIPLE = 32  # what canvases made from an aspect ratio round to
LATENT_PX = 16  # one latent per 16 px: the grid every canvas side is on
SHORT_EDGE = 768
MAX_PIXELS = 768 * 1344
MIN_ASPECT, MAX_ASPECT = 1 / 4, 4
TRAINED_FRAMES = (124, 362)
CLIP, KEEP = 17, 5
AUDIO_LATENTS_PER_SECOND = 40


def canvas_size(
    aspect_width: float,
    aspect_height: float,
    *,
    short_edge: int = SHORT_EDGE,
    max_pixels: int = MAX_PIXELS,
    multiple: int = CANVAS_MULTIPLE,
) -> tuple[int, int]:
    """``(height, width)`` of the canvas for an aspect ratio (or a keyframe's own size)."""
    if not (aspect_width > 0 and aspect_height > 0):
        raise H3InputError(f"the aspect ratio must be positive, got {aspect_width}:{aspect_height}")
    ratio = aspect_width / aspect_height
    if not MIN_ASPECT <= ratio <= MAX_ASPECT:
        raise H3InputError(
            f"H3 generates aspect ratios from 1:4 to 4:1, got {aspect_width}:{aspect_height} "
            f"({ratio:g}); crop the image or choose another ratio"
        )
    width, height = (short_edge * ratio, float(short_edge)) if ratio >= 1 else (float(short_edge), short_edge / ratio)
    if width * height > max_pixels:
        scale = (max_pixels / (width * height)) ** 0.5
        width, height = width * scale, height * scale
    return max(multiple, round(height / multiple) * multiple), max(multiple, round(width / multiple) * multiple)


def check_canvas(width: int, height: int) -> None:
    """Refuse sides off the 16-px latent grid or under 32 px, naming the nearest valid value."""
    for name, value in (("width", width), ("height", height)):
        if isinstance(value, bool) or not isinstance(value, int) or value < CANVAS_MULTIPLE or value % LATENT_PX:
            nearest = (
                max(CANVAS_MULTIPLE, round(value / LATENT_PX) * LATENT_PX)
                if isinstance(value, (int, float)) and not isinstance(value, bool)
                else SHORT_EDGE
            )
            raise H3InputError(
                f"{name} must be a multiple of {LATENT_PX} px and at least {CANVAS_MULTIPLE}, "
                f"got {value!r}; nearest: {nearest}"
            )


def snap_frames(frames: int) -> int:
    """The next frame count the VAE takes (``17k + 5``) at or above ``frames``."""
    if frames < 1:
        raise H3InputError(f"length must be at least 1 frame, got {frames}")
    return frames + (KEEP - frames) % CLIP


def check_frames(frames: int) -> None:
    """Refuse lengths off the ``17k + 5`` grid (naming the nearest valid ones); warn outside 124–362."""
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < KEEP or frames % CLIP != KEEP:
        if isinstance(frames, int) and not isinstance(frames, bool) and frames >= 1:
            up = snap_frames(frames)
            down = up - CLIP if up - CLIP >= KEEP else None
            nearest = f"{down} or {up}" if down else f"{up}"
        else:
            nearest = f"{KEEP}, {KEEP + CLIP}, ..."
        raise H3InputError(
            f"length must be 17k + 5 frames (5, 22, 39, ..., 124, ..., 345, 362), got {frames!r}; nearest: {nearest}"
        )
    if not TRAINED_FRAMES[0] <= frames <= TRAINED_FRAMES[1]:
        warnings.warn(
            f"{frames} frames is outside the 124-362 frames H3 was trained on; expect weaker results", stacklevel=2
        )


def latent_frames(frames: int) -> int:
    """``17k + 5`` frames → ``5k + 2`` latent frames."""
    if frames % CLIP != KEEP:
        raise H3InputError(f"length must be 17k + 5 frames, got {frames}")
    return (frames - KEEP) // CLIP * KEEP + 2


def audio_latents(frames: int, fps: float = FPS) -> int:
    """Audio latents per channel covering ``frames`` video frames."""
    return int(round(frames / fps * AUDIO_LATENTS_PER_SECOND))
