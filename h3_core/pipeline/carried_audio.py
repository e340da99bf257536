"""The audio stream carried on the video schedule, so that one σ drives both streams (how ComfyUI's native H3 lets
any of the host's samplers run it: ``ModelSamplingAV`` in comfy/model_sampling.py at Comfy-Org/ComfyUI 2fd20839,
"carrying the audio latent scaled onto the video schedule makes the pack an ordinary single-schedule flow latent
whose audio target is scaled by audio_scale", ``audio_scale = video_shift / audio_shift``).

With the audio σ paired to the video σ as native pairs them (``schedule.time_shift_sigma``), the audio latent
``x_a = (1 − σ_a)·a0 + σ_a·n`` carried as ``y = c(σ_v)·x_a``, ``c = audio_scale · (1 − σ_v) / (1 − σ_a)``, is
``y = (1 − σ_v)·(audio_scale·a0) + σ_v·n``: a flow latent on the video schedule with the same noise. ``c`` is 1 at
σ = 1 (pure noise needs no carrying) and ``audio_scale`` at σ = 0.
"""

from __future__ import annotations

import torch

__all__ = ["audio_scale", "carry_factor", "to_carried", "from_carried", "carried_clean"]


def audio_scale(video_shift: float, audio_shift: float) -> float:
    """The factor on the carried audio's clean target: ``video_shift / audio_shift``."""
    return float(video_shift) / float(audio_shift)


def carry_factor(sigma_v: float, video_shift: float, audio_shift: float) -> float:
    """``c(σ_v) = audio_scale · (1 − σ_v) / (1 − σ_a)``, written through the unshifted grid point
    ``b = σ_v / (s_v + σ_v (1 − s_v))`` so that it stays finite at σ = 1: ``(s_v/s_a)·(1 + (s_a − 1) b) / (1 +
    (s_v − 1) b)``."""
    s_v, s_a, sigma = float(video_shift), float(audio_shift), float(sigma_v)
    base = sigma / (s_v + sigma * (1.0 - s_v))
    return (s_v / s_a) * (1.0 + (s_a - 1.0) * base) / (1.0 + (s_v - 1.0) * base)


def to_carried(audio: torch.Tensor, sigma_v: float, video_shift: float, audio_shift: float) -> torch.Tensor:
    """The audio latent at the σ paired with ``sigma_v`` → the carried latent on the video schedule."""
    return audio * carry_factor(sigma_v, video_shift, audio_shift)


def from_carried(carried: torch.Tensor, sigma_v: float, video_shift: float, audio_shift: float) -> torch.Tensor:
    """The carried latent at ``sigma_v`` → the audio latent at its own σ (what the model reads)."""
    return carried / carry_factor(sigma_v, video_shift, audio_shift)


def carried_clean(clean_audio: torch.Tensor, video_shift: float, audio_shift: float) -> torch.Tensor:
    """The audio's clean estimate as the carried latent's: scaled by ``audio_scale``."""
    return clean_audio * audio_scale(video_shift, audio_shift)
