"""H3's latents in the host's LATENT dict: the pack's own form (the video latents under ``samples``,
``[1, 24, T, h, w]`` as other nodes expect a batch, and the stereo audio latents beside them) or ComfyUI's native
H3 form (a nested video + audio pair under ``samples``, ``h3_core.pipeline.native_latent``), which native H3 nodes
read and write."""

from __future__ import annotations

import torch

from ..h3_core.errors import H3InputError
from ..h3_core.pipeline.native_latent import from_native, to_native

LATENT_FORMS = ("h3", "native")


def to_latent(video: torch.Tensor, audio: torch.Tensor, frames: int, form: str = "h3") -> dict:
    if form == "native":
        from comfy.nested_tensor import NestedTensor

        return {"samples": NestedTensor(to_native(video, audio))}
    return {"samples": video[None], "h3_audio": audio[None], "h3_frames": int(frames)}


def from_latent(latent, name: str = "latent") -> tuple[torch.Tensor, torch.Tensor, int]:
    """(video ``[24, T, h, w]``, audio ``[2, 32, Ta]``, frames) of one generated clip, from either form."""
    samples = latent.get("samples") if isinstance(latent, dict) else None
    if getattr(samples, "is_nested", False):
        tensors = list(samples.tensors)
        if len(tensors) != 2:
            raise H3InputError(f"{name}: a nested latent of {len(tensors)} streams is not H3's video + audio")
        return from_native(*tensors, name=name)
    if not isinstance(latent, dict) or "h3_audio" not in latent:
        raise H3InputError(
            f"{name}: not an H3 latent (video + audio); connect the H3 Sampler's output or a native H3 AV latent"
        )
    video, audio = latent["samples"], latent["h3_audio"]
    if video.shape[0] != 1:
        raise H3InputError(f"{name}: H3 decodes one clip at a time, got a batch of {video.shape[0]}")
    return video[0], audio[0], int(latent["h3_frames"])
