"""IMAGE and AUDIO inputs as h3_core takes them."""

from __future__ import annotations

import torch

from ..h3_core.errors import H3InputError


def single_image(image, name: str) -> torch.Tensor:
    """One ``[H, W, 3]`` image from a host IMAGE batch ``[B, H, W, C]`` that must hold exactly one."""
    if not isinstance(image, torch.Tensor) or image.dim() != 4:
        shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise H3InputError(f"{name}: expected an IMAGE batch [images, height, width, channels], got {shape}")
    if image.shape[0] != 1:
        raise H3InputError(
            f"{name}: takes one image, got a batch of {image.shape[0]}; pick one (e.g. with an image batch selector)"
        )
    if image.shape[-1] != 3:
        raise H3InputError(f"{name}: needs RGB (3 channels), got {image.shape[-1]}; remove the alpha channel")
    return image[0]


def single_waveform(audio, name: str) -> tuple[torch.Tensor, int]:
    """``([channels, samples], sample rate)`` from a host AUDIO that must hold exactly one clip."""
    if not isinstance(audio, dict) or "waveform" not in audio or "sample_rate" not in audio:
        raise H3InputError(f"{name}: expected the host's AUDIO ({{'waveform': [1, channels, samples], 'sample_rate'}})")
    waveform = audio["waveform"]
    if not isinstance(waveform, torch.Tensor) or waveform.dim() != 3 or waveform.shape[0] != 1:
        shape = tuple(waveform.shape) if isinstance(waveform, torch.Tensor) else type(waveform).__name__
        raise H3InputError(f"{name}: one clip's waveform [1, channels, samples] is needed, got {shape}")
    return waveform[0], int(audio["sample_rate"])
