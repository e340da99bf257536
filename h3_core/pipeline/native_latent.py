"""ComfyUI's native H3 latent, as its nodes pass it: a nested pair of the video ``[B, 24, T, h, w]`` and the stereo
audio ``[B, 32, 2, Ta]`` (latent channels, then the two channels; ``_empty_av_latent`` in
comfy_extras/nodes_minimax_h3.py at Comfy-Org/ComfyUI 542de101), both in the model's space as here. The pack holds
the audio as ``[2, 32, Ta]`` (left and right channels first)."""

from __future__ import annotations

import torch

from ..errors import H3InputError
from .generate import ReferenceLatents
from .keyframes import Keyframe, latent_span

__all__ = ["to_native", "from_native", "keyframe_from_native", "reference_from_native"]


def to_native(video: torch.Tensor, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(video [24, T, h, w], audio [2, 32, Ta])`` → the native pair ``([1, 24, T, h, w], [1, 32, 2, Ta])``."""
    return video[None], audio.permute(1, 0, 2)[None].contiguous()


def from_native(
    video: torch.Tensor, audio: torch.Tensor, name: str = "latent"
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The native pair → ``(video [24, T, h, w], audio [2, 32, Ta], frames)``, the frames the ``T`` latents cover."""
    if video.dim() != 5 or video.shape[1] != 24:
        raise H3InputError(f"{name}: the native H3 video latent must be [1, 24, T, h, w], got {tuple(video.shape)}")
    if audio.dim() != 4 or tuple(audio.shape[1:3]) != (32, 2):
        raise H3InputError(f"{name}: the native H3 audio latent must be [1, 32, 2, Ta], got {tuple(audio.shape)}")
    if video.shape[0] != 1 or audio.shape[0] != 1:
        raise H3InputError(f"{name}: H3 takes one clip at a time, got a batch of {video.shape[0]}")
    frames = int(video.shape[2])
    if frames % 5 != 2:
        raise H3InputError(f"{name}: {frames} latent frames is not a clip's 5k + 2; not an H3 latent")
    return video[0], _audio_from_native(audio[0]), latent_span(frames)


def _audio_from_native(audio: torch.Tensor) -> torch.Tensor:
    """One clip's native audio ``[32, 2, Ta]`` → the pack's ``[2, 32, Ta]``."""
    return audio.permute(1, 0, 2)


def _condition_latents(video, audio, name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A native condition's ``latent`` ``[1, 24, t, h, w]`` and ``audio_latent`` ``[1, 32, 2, Ta]`` (either may be
    None) → the pack's ``[24, t, h, w]`` and ``[2, 32, Ta]``, fp32 on the CPU."""
    if video is not None:
        if not isinstance(video, torch.Tensor) or video.dim() != 5 or video.shape[0] != 1:
            raise H3InputError(f"{name}: its latent must be [1, 24, t, h, w], got {getattr(video, 'shape', video)}")
        video = video[0].float().cpu()
    if audio is not None:
        if not isinstance(audio, torch.Tensor) or audio.dim() != 4 or tuple(audio.shape[:3]) != (1, 32, 2):
            raise H3InputError(f"{name}: its audio_latent must be [1, 32, 2, Ta], got {getattr(audio, 'shape', audio)}")
        audio = _audio_from_native(audio[0]).float().cpu()
    return video, audio


def keyframe_from_native(entry: dict, index: int = 1) -> Keyframe:
    """One of the keyframes a native H3 CONDITIONING carries (``minimax_keyframes``: ``resolved_frame_index``, a
    video ``latent`` ``[1, 24, t, h, w]`` and/or an ``audio_latent`` ``[1, 32, 2, Ta]``, as ``MiniMaxH3ImageToVideo``
    and ``MiniMaxH3AddGuide`` make them at 542de101) → a ``Keyframe``."""
    name = f"conditioning: native keyframe {index}"
    if not isinstance(entry, dict) or "resolved_frame_index" not in entry:
        raise H3InputError(f"{name}: not a native H3 keyframe (no resolved_frame_index)")
    video, audio = _condition_latents(entry.get("latent"), entry.get("audio_latent"), name)
    return Keyframe(int(entry["resolved_frame_index"]), video=video, audio=audio)


NATIVE_REFERENCE_KINDS = {"image": "image", "video": "video", "video_audio": "video", "audio": "audio"}


def reference_from_native(block: dict, index: int = 1) -> ReferenceLatents:
    """One of the references a native H3 CONDITIONING carries (``minimax_refs``, as ``MiniMaxH3ReferenceToVideo``
    makes them at 542de101: ``kind`` image / video / video_audio / audio, a video ``latent`` ``[1, 24, t, h, w]``
    and an ``audio_latent`` ``[1, 32, 2, Ta]`` where the kind has them) → ``ReferenceLatents``."""
    name = f"conditioning: native reference {index}"
    kind = block.get("kind") if isinstance(block, dict) else None
    if kind not in NATIVE_REFERENCE_KINDS:
        raise H3InputError(f"{name}: kind must be one of {list(NATIVE_REFERENCE_KINDS)}, got {kind!r}")
    video, audio = _condition_latents(block.get("latent"), block.get("audio_latent"), name)
    return ReferenceLatents(NATIVE_REFERENCE_KINDS[kind], video=video, audio=audio)
