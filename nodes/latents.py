"""H3's latents in the host's LATENT dict: the video latents under ``samples`` (``[1, 24, T, h, w]``, as
other nodes expect a batch) and the stereo audio latents beside them."""

from __future__ import annotations

import torch

from ..h3_core.errors import H3InputError


def to_latent(video: torch.Tensor, audio: torch.Tensor, frames: int) -> dict:
    return {"samples": video[None], "h3_audio": audio[None], "h3_frames": int(frames)}


def from_latent(latent, name: str = "latent") -> tuple[torch.Tensor, torch.Tensor, int]:
    """(video ``[24, T, h, w]``, audio ``[2, 32, Ta]``, frames) of one generated clip."""
    if not isinstance(latent, dict) or "h3_audio" not in latent:
        raise H3InputError(f"{name}: not an H3 latent (video + audio); connect the H3 Sampler's output")
    video, audio = latent["samples"], latent["h3_audio"]
    if video.shape[0] != 1:
        raise H3InputError(f"{name}: H3 decodes one clip at a time, got a batch of {video.shape[0]}")
    return video[0], audio[0], int(latent["h3_frames"])
