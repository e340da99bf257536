"""Denoise masks: regenerate part of a clip and hold the rest, as ComfyUI's native H3 does with its per-token masks
(comfy/ldm/minimax/model.py at Comfy-Org/ComfyUI 2c64d4aa: ``mask_row_values``, the masked rows' timesteps and
velocities).

A mask is 1 where the clip is generated and 0 where it is held at the given latents, per video latent element
``[T, h, w]`` and per audio latent ``[2, Ta]``. Every step, for the generated streams' rows:
  * the model sees ``m · x + (1 − m) · held`` (held rows enter clean), per element; on an odd-sized latent the
    element mask is padded to whole patches circularly, as the latents are (``packing.pad_to_patch``);
  * a video row's timestep is ``1 − m · σ`` with ``m`` the largest mask value of its 2×2 patch, clamped at
    ``max(t, 0.999)`` (a held row sits where the keyframes sit); an audio row's at ``max(t, 1)``, ``m`` its own
    mask value. Two rules of the native model set ``m`` (``video_row_mask`` / ``audio_row_mask``):
      1. for the timesteps the video mask is padded to whole patches by repeating its last row and column
         (``mode="replicate"``), not circularly as the latents are: on an odd grid a held last row or column
         keeps its patch row at the pinned timestep;
      2. a stream whose row values are all ``>= 1 − 1e-3`` (0.999) counts as fully generated: its rows run at the
         stream's own timestep, as with no mask; video (after the 2×2 max) and audio each on its own. Only the
         timesteps follow this rule, the blending above keeps the mask as given;
  * the clean estimate is ``x_in + (1 − t) · m · v`` and the step lands on ``m · x0 + (1 − m) · held``, so held
    latents come out exactly as given.
With the mask all ones this is the unmasked step, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import H3InputError
from .geometry import AUDIO_LATENTS_PER_SECOND, FPS
from .keyframes import latent_span
from .packing import FRAMES_PER_LATENT, pad_to_patch, patchify, soundtrack_rows

__all__ = [
    "FULLY_GENERATED",
    "MaskedStart",
    "patch_row_mask",
    "masked_input",
    "masked_row_timesteps",
    "masked_euler_step",
    "latent_frame_spans",
    "span_mask",
    "extend_start",
    "region_mask",
]

# a stream whose row mask values all reach this runs at its own timesteps, as if it had no mask (native
# ``mask_row_values`` and the audio mask in ``_forward``)
FULLY_GENERATED = 1.0 - 1e-3


def patch_row_mask(mask: torch.Tensor, patch: tuple[int, int, int] = (1, 2, 2)) -> torch.Tensor:
    """A video mask ``[T, h, w]`` → one value per row of the patch grid (t-major, as ``packing.patchify``), fp32:
    the mask padded at the end of each axis to whole patches by repeating its last frame, row and column
    (replicate, rule 1 of the module docstring), then the largest value of each patch."""
    return patchify(pad_to_patch(mask.float()[None], patch, mode="replicate"), patch).amax(dim=1)


def _unless_fully_generated(row_mask: torch.Tensor) -> torch.Tensor | None:
    """``row_mask``, or None where every value is ``>= FULLY_GENERATED`` (rule 2 of the module docstring)."""
    return None if bool((row_mask >= FULLY_GENERATED).all()) else row_mask


@dataclass(frozen=True)
class MaskedStart:
    """The latents a run starts from and holds where the masks are 0: ``video`` ``[24, T, h, w]`` and ``audio``
    ``[2, 32, Ta]`` in model space, ``video_mask`` ``[T, h, w]`` and ``audio_mask`` ``[2, Ta]`` in [0, 1]."""

    video: torch.Tensor
    audio: torch.Tensor
    video_mask: torch.Tensor
    audio_mask: torch.Tensor

    def check(self, frames: int, height: int, width: int, audio_latents: int) -> None:
        """Against the clip being generated (its latent geometry)."""
        want = {
            "video": (24, frames, height, width),
            "audio": (2, 32, audio_latents),
            "video_mask": (frames, height, width),
            "audio_mask": (2, audio_latents),
        }
        for name, shape in want.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise H3InputError(f"start: its {name} is {list(got)} but the clip being generated needs {list(shape)}")
        for name in ("video_mask", "audio_mask"):
            mask = getattr(self, name)
            if not bool(((mask >= 0) & (mask <= 1)).all()):
                raise H3InputError(f"start: its {name} must lie in [0, 1] (1 generates, 0 holds)")

    def video_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(held [N, 96], element mask [N, 96])`` in the target's row layout, for the blending (on the padded grid
        of an odd-sized latent, both padded circularly as the latents are, ``packing.pad_to_patch``)."""
        mask = self.video_mask.float()[None].expand(24, -1, -1, -1)
        return patchify(pad_to_patch(self.video.float())), patchify(pad_to_patch(mask.contiguous()))

    def audio_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(held [2 · Ta, 32], mask [2 · Ta, 1])`` in the target's row layout (left channel first)."""
        return soundtrack_rows(self.audio), self.audio_mask.float().reshape(-1, 1)

    def video_row_mask(self) -> torch.Tensor | None:
        """The mask value ``[N]`` each generated video row's timestep follows (``patch_row_mask``: replicate
        padding, the 2×2 max), or None when every row counts as fully generated (module docstring)."""
        return _unless_fully_generated(patch_row_mask(self.video_mask))

    def audio_row_mask(self) -> torch.Tensor | None:
        """The mask value ``[2 · Ta]`` each generated audio row's timestep follows (left channel first), or None
        when every row counts as fully generated (module docstring)."""
        return _unless_fully_generated(self.audio_mask.float().reshape(-1))


def masked_input(rows: torch.Tensor, held: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What the model sees of the generated rows: ``m · x + (1 − m) · held``."""
    return mask * rows + (1 - mask) * held


def masked_row_timesteps(row_mask: torch.Tensor, sigma: torch.Tensor, pin: float) -> torch.Tensor:
    """Each row's timestep ``1 − m · σ``, clamped at ``pin`` (fp32; ``σ`` the stream's, ``m`` one per row)."""
    return (1 - row_mask.float() * sigma.float()).clamp(max=pin)


def masked_euler_step(
    rows: torch.Tensor,
    model_input: torch.Tensor,
    velocity: torch.Tensor,
    held: torch.Tensor,
    mask: torch.Tensor,
    sigma: float,
    sigma_next: float,
    timestep,
) -> torch.Tensor:
    """One Euler step of the masked rows (module docstring), fp32."""
    scale = 1 - torch.as_tensor(timestep, dtype=torch.float32)
    x0 = model_input.float() + scale * (mask * velocity.float())
    denoised = mask * x0 + (1 - mask) * held
    ratio = torch.as_tensor(sigma_next, dtype=torch.float32) / torch.as_tensor(sigma, dtype=torch.float32)
    return ratio * rows.float() + (1 - ratio) * denoised


def latent_frame_spans(latent_frames: int) -> list[tuple[int, int]]:
    """The pixel frames ``[start, stop)`` each latent frame of a clip covers (1, 4, 4, 4, 4, 1, 4, ...)."""
    spans, start = [], 0
    for k in range(latent_frames):
        stop = start + FRAMES_PER_LATENT[k % 5]
        spans.append((start, stop))
        start = stop
    return spans


def span_mask(
    latent_frames: int, height: int, width: int, audio_latents: int, start: int, stop: int, *, audio: str = "follow"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks that regenerate pixel frames ``[start, stop)`` of a clip: every latent frame covering one of them, and
    (``audio`` "follow") every audio latent overlapping those latent frames' time, or all the audio ("generate")
    or none of it ("hold")."""
    if audio not in ("follow", "generate", "hold"):
        raise H3InputError(f"audio must be 'follow', 'generate' or 'hold', got {audio!r}")
    frames = latent_span(latent_frames)
    if not 0 <= start < stop <= frames:
        raise H3InputError(
            f"the frames to regenerate, {start} to {stop}, must lie within the clip's {frames} frames (0 to {frames})"
        )
    video = torch.zeros(latent_frames, height, width)
    first = last = None
    for k, (a, b) in enumerate(latent_frame_spans(latent_frames)):
        if a < stop and b > start:
            video[k] = 1
            first = a if first is None else first
            last = b
    sound = torch.zeros(2, audio_latents)
    if audio == "generate":
        sound[:] = 1
    elif audio == "follow":
        for j in range(audio_latents):
            begin, end = j / AUDIO_LATENTS_PER_SECOND, (j + 1) / AUDIO_LATENTS_PER_SECOND
            if begin < last / FPS and end > first / FPS:
                sound[:, j] = 1
    return video, sound


def region_mask(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """A pixel mask ``[H, W]`` (1 regenerates) → the latent grid ``[height, width]``: a latent cell is regenerated
    where any pixel of its 16 × 16 block is (the mask first resized to the canvas, nearest)."""
    if pixels.dim() != 2:
        raise H3InputError(f"mask: expected one mask [height, width], got {tuple(pixels.shape)}")
    canvas = torch.nn.functional.interpolate(pixels.float()[None, None], size=(16 * height, 16 * width), mode="nearest")
    return torch.nn.functional.max_pool2d(canvas, 16)[0, 0].clamp(0, 1)


def extend_start(video: torch.Tensor, audio: torch.Tensor, latent_frames: int, audio_latents: int) -> MaskedStart:
    """A clip of ``latent_frames`` (and ``audio_latents``) that begins with the given clip, held, and generates the
    rest."""
    held_frames, held_audio = int(video.shape[1]), int(audio.shape[2])
    if latent_frames <= held_frames:
        raise H3InputError(
            f"extend: the new clip's {latent_span(latent_frames)} frames must be longer than the "
            f"{latent_span(held_frames)} it extends"
        )
    _, _, h, w = video.shape
    start_video = torch.zeros(24, latent_frames, h, w)
    start_video[:, :held_frames] = video.float()
    kept = min(held_audio, audio_latents)
    start_audio = torch.zeros(2, 32, audio_latents)
    start_audio[..., :kept] = audio.float()[..., :kept]
    video_mask = torch.ones(latent_frames, h, w)
    video_mask[:held_frames] = 0
    audio_mask = torch.ones(2, audio_latents)
    audio_mask[:, :kept] = 0
    return MaskedStart(start_video, start_audio, video_mask, audio_mask)
