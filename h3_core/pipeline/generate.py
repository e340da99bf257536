"""One T2VA / I2VA / L2VA / FL2VA generation, from conditioning to latents.

``generate`` packs the request, draws the noise from ``seed`` in the released order, runs the denoising loop
and returns the latents in model space: video ``[24, T, h, w]`` and audio ``[2, 32, Ta]`` (left, right). The
caller decodes them (``h3_core.tiling.decode_video``, the audio VAE). Keyframes come as latents in model space
(``[24, 1, h, w]``, as the released encode produces them) with their anchors, "first" and/or "last".
"""

from __future__ import annotations

from typing import Callable

import torch

from ..attention.layout import WindowSpec
from ..errors import H3InputError
from ..models.hybrid import RELEASE_WINDOW, HybridContext
from .geometry import audio_latents, check_canvas, check_frames, latent_frames
from .noise import initial_noise
from .packing import pack_sequence, unpatchify
from .prompt import PromptEmbedding
from .sampler import denoise
from .schedule import AUDIO_SHIFT, VIDEO_SHIFT

__all__ = ["generate"]


def generate(
    model,
    prompt: PromptEmbedding,
    *,
    frames: int,
    width: int,
    height: int,
    steps: int,
    seed: int,
    keyframes: tuple[tuple[str, torch.Tensor], ...] = (),
    video_shift: float = VIDEO_SHIFT,
    audio_shift: float = AUDIO_SHIFT,
    device: torch.device | str = "cpu",
    progress: Callable[[int, int], None] | None = None,
    check_cancel: Callable[[], None] | None = None,
    window: WindowSpec = RELEASE_WINDOW,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate one clip's latents. ``steps`` counts model evaluations; ``keyframes`` is a sequence of
    ``(anchor, latent)`` pairs. For a VDN-H3 model (``model.cfg.hybrid``) ``window`` and ``backend`` pick the
    window softmax; a plain H3 model ignores them. Returns ``(video [24, T, h, w], audio [2, 32, Ta])`` in
    model space, fp32."""
    check_frames(frames)
    check_canvas(width, height)
    T, h, w = latent_frames(frames), height // 16, width // 16
    Ta = audio_latents(frames)
    for anchor, latent in keyframes:
        if tuple(latent.shape) != (24, 1, h, w):
            raise H3InputError(f"the {anchor} keyframe latent must be [24, 1, {h}, {w}] for a {width}x{height} canvas, "
                               f"got {tuple(latent.shape)}")
    device = torch.device(device)
    packed = pack_sequence(prompt.tags, T, h, w, Ta, keyframes=tuple(a for a, _ in keyframes))
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    condition, video, audio = initial_noise(generator, [z for _, z in keyframes], T, h, w, Ta)
    video_rows = torch.cat([condition, video]).to(device)
    hybrid = None
    if getattr(getattr(model, "cfg", None), "hybrid", False):
        text = (int(packed.text_index.min()), int(packed.text_index.max()) + 1)
        hybrid = HybridContext(packed.layout, window, backend, text)
    video_rows, audio_rows = denoise(
        model, packed, prompt.embeds.to(device), video_rows, audio.to(device), steps,
        video_shift=video_shift, audio_shift=audio_shift, progress=progress, check_cancel=check_cancel,
        hybrid=hybrid,
    )
    target = video_rows[packed.condition_rows :].float().cpu()
    video_latents = unpatchify(target, 24, T, h, w)
    audio_latents_lr = audio_rows.float().cpu().reshape(2, Ta, 32).transpose(1, 2)
    return video_latents, audio_latents_lr
