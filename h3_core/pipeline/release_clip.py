"""The released clip as the memory model sees it: T2VA, 345 frames at 1344×768 (the longest trained length at
the largest canvas), a 300-token prompt. A DiT read straight to the device has to leave room beside its weights for
one evaluation of it, or the first run moves the weights back out."""

from __future__ import annotations

import torch

from ..memory.policy import activation_bytes
from ..memory.predict import ModelForm
from .geometry import LATENT_PX, audio_latents, latent_frames
from .packing import PackedSequence, pack_sequence

__all__ = ["RELEASE_FRAMES", "RELEASE_HEIGHT", "RELEASE_WIDTH", "PROMPT_TOKENS", "release_clip", "release_activations"]

RELEASE_FRAMES = 345
RELEASE_HEIGHT, RELEASE_WIDTH = 768, 1344
PROMPT_TOKENS = 300


def release_clip() -> PackedSequence:
    """The released clip's packed sequence (no keyframes)."""
    return pack_sequence(
        torch.ones(PROMPT_TOKENS, dtype=torch.long),
        latent_frames(RELEASE_FRAMES),
        RELEASE_HEIGHT // LATENT_PX,
        RELEASE_WIDTH // LATENT_PX,
        audio_latents(RELEASE_FRAMES),
    )


def release_activations(cfg, dtype: torch.dtype, linears: str) -> int:
    """Bytes of activations of one evaluation of the released clip by a DiT of ``cfg`` with nothing given up, on
    the fused path (the one CUDA runs): what ``memory.policy.working_bytes`` gives for that clip."""
    form = ModelForm(cfg, hybrid=bool(cfg.hybrid), dtype=dtype, linears=linears, fused=True)
    return activation_bytes(form, release_clip())
