"""Decoding the generated audio latents into the clip's stereo soundtrack."""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import H3InputError
from .conditioning import AUDIO_SAMPLE_RATE
from .geometry import FPS

__all__ = ["decode_soundtrack", "clip_samples"]


def clip_samples(frames: int, fps: float = FPS, sample_rate: int = AUDIO_SAMPLE_RATE) -> int:
    """Audio samples spanning ``frames`` video frames."""
    return round(frames * sample_rate / fps)


def decode_soundtrack(
    audio_vae, latents: torch.Tensor, *, frames: int | None = None, check_cancel: Callable[[], None] | None = None
) -> torch.Tensor:
    """Model-space audio latents ``[2, 32, Ta]`` (left, right) → waveform ``[2, samples]`` in [-1, 1], fp32 on
    the CPU. The two channels decode as a batch of the mono VAE; with ``frames`` a waveform longer than the
    video (the latents round its duration to the nearest 25 ms hop) is cut to the video's duration."""
    if (
        not isinstance(latents, torch.Tensor)
        or latents.dim() != 3
        or tuple(latents.shape[:2]) != (2, audio_vae.cfg.latent_channels)
    ):
        shape = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
        raise H3InputError(
            f"audio latents must be [2, {audio_vae.cfg.latent_channels}, frames] (left, right), got {shape}"
        )
    if check_cancel is not None:
        check_cancel()
    device = next(audio_vae.parameters()).device
    with torch.inference_mode():
        raw = audio_vae.denormalize_latents(latents.to(device, torch.float32))
        waveform = audio_vae.decode(raw)[:, 0].float().clamp(-1, 1).cpu()
    if frames is not None:
        waveform = waveform[:, : clip_samples(frames)]
    return waveform
