"""Per-row timesteps and the initial noise of one request, as released.

A model evaluation serves rows at several noise levels: the generated video rows at the video schedule's
``t``, the generated audio rows at the audio schedule's, the keyframe / reference image rows held at
``max(t, 0.999)`` (the anchors were trained slightly noised), reference audio rows clean at 1 (or, asked,
at ``max(t_audio, reference_audio_t)``, mixed by ``noised_reference_audio``); text rows take the video ``t``
(they reach no output head). ``row_timesteps`` reduces that to the model's ``(timesteps, timestep_index)``
pair.

Two draws of the starting noise from a seed (``NOISE_DRAWS``). ``released``: one generator in a fixed order, so a
seed means the same start as in the reference pipeline: one draw per conditioning latent in packed order (each
mixed in at ``t = 0.999``), then the video latent ``[1, 24, T, h, w]``, then the audio rows ``[2 · Ta, 32]``
directly in row layout. ``comfyui``: as a native ComfyUI H3 graph draws it (``initial_noise_comfyui``), so the
same seed gives the same start there and here.
"""

from __future__ import annotations

import torch

from ..errors import H3InputError
from .packing import PackedSequence, pad_to_patch, patchify
from .schedule import noise_to

__all__ = [
    "CONDITION_T",
    "REFERENCE_AUDIO_T",
    "NOISE_DRAWS",
    "row_timesteps",
    "initial_noise",
    "initial_noise_comfyui",
    "starting_rows",
    "check_noise",
    "noised_reference_audio",
]

NOISE_DRAWS = ("released", "comfyui")

CONDITION_T = 0.999
# Reference audio rows are held clean, at t = 1: MiniMax's released Ref2VA pipeline does so (noise augmentation
# 1.0 for audio references) and so does ComfyUI's native H3 (comfy/ldm/minimax/model.py at Comfy-Org/ComfyUI
# 01a56b76: AUDIO_COND_TIMESTEP = 1.0, the rows mixed with noise only when its payload's audio_cond_noise_aug is
# set below that).
REFERENCE_AUDIO_T = 1.0


def row_timesteps(
    packed: PackedSequence,
    video_t: float,
    audio_t: float,
    *,
    condition_audio_rows: int = 0,
    condition_video_t: float | None = None,
    condition_audio_t: float = 1.0,
    video_rows_t: torch.Tensor | None = None,
    audio_rows_t: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct fp32 timesteps of the sequence, sorted, and each row's index into them. ``video_rows_t`` /
    ``audio_rows_t``: a timestep per generated video / audio row, in place of the stream's (denoise masks)."""
    condition_video_t = max(float(video_t), CONDITION_T) if condition_video_t is None else condition_video_t
    T = packed.positions.shape[0]
    t = torch.full((T,), float(video_t), dtype=torch.float32)
    t[packed.video_index[: packed.condition_rows]] = condition_video_t
    t[packed.audio_index[condition_audio_rows:]] = float(audio_t)
    t[packed.audio_index[:condition_audio_rows]] = condition_audio_t
    if video_rows_t is not None:
        t[packed.video_index[packed.condition_rows :]] = video_rows_t.float().cpu()
    if audio_rows_t is not None:
        t[packed.audio_index[condition_audio_rows:]] = audio_rows_t.float().cpu()
    return torch.unique(t, sorted=True, return_inverse=True)


def initial_noise(
    generator: torch.Generator,
    condition_latents: list[torch.Tensor],
    frames: int,
    height: int,
    width: int,
    audio_latents: int,
    *,
    latent_channels: int = 24,
    audio_channels: int = 2,
    audio_latent_channels: int = 32,
    patch: tuple[int, int, int] = (1, 2, 2),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(condition_rows, video_rows, audio_rows)`` in fp32 on the generator's device: the conditioning
    latents (``[24, t, h, w]`` each, model space) noised to ``t = 0.999`` and patchified, then pure-noise
    target video rows and audio rows, drawn in the released order. Latents of odd size are drawn at their size and
    padded to whole patches as native H3 pads them (``packing.pad_to_patch``)."""
    device = generator.device
    conditions = []
    for latent in condition_latents:
        noise = torch.randn((1, *latent.shape), generator=generator, device=device, dtype=torch.float32)[0]
        noised = noise_to(latent.to(device, torch.float32), noise, CONDITION_T)
        conditions.append(patchify(pad_to_patch(noised, patch), patch))
    video = torch.randn(
        (1, latent_channels, frames, height, width), generator=generator, device=device, dtype=torch.float32
    )[0]
    audio = torch.randn(
        (audio_latents * audio_channels, audio_latent_channels), generator=generator, device=device, dtype=torch.float32
    )
    return _joined(conditions, patch, latent_channels, device), patchify(pad_to_patch(video, patch), patch), audio


def initial_noise_comfyui(
    seed: int,
    condition_latents: list[torch.Tensor],
    frames: int,
    height: int,
    width: int,
    audio_latents: int,
    *,
    latent_channels: int = 24,
    audio_channels: int = 2,
    audio_latent_channels: int = 32,
    patch: tuple[int, int, int] = (1, 2, 2),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(condition_rows, video_rows, audio_rows)`` as ComfyUI's native H3 starts a run from ``seed``, on the CPU in
    fp32. The host's sampler draws the target noise from one CPU generator seeded ``seed``, one draw per stream of
    the nested latent: the video ``[1, 24, T, h, w]``, then the audio ``[1, 32, 2, Ta]`` (its rows channel-major:
    ``[2 · Ta, 32]``) (comfy/sample.py ``prepare_noise`` at Comfy-Org/ComfyUI 542de101). The model noises each
    condition's rows afresh from a generator seeded ``seed`` (every condition draws the same stream), in row
    layout: ``0.999 · rows + (1 − 0.999) · ε`` with the coefficients in float64 as Python computes them
    (comfy/ldm/minimax/model.py ``_cond_video_rows`` at 2c64d4aa). Latents of odd size are drawn at their size
    and padded to whole patches (``packing.pad_to_patch``), as that model pads what it is given."""
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    video = torch.randn((1, latent_channels, frames, height, width), generator=generator, dtype=torch.float32)[0]
    audio = torch.randn((1, audio_latent_channels, audio_channels, audio_latents), generator=generator)[0]
    conditions = []
    for latent in condition_latents:
        rows = patchify(pad_to_patch(latent.to("cpu", torch.float32), patch), patch)
        noise = torch.randn(rows.shape, generator=torch.Generator(device="cpu").manual_seed(int(seed)))
        conditions.append(CONDITION_T * rows + (1.0 - CONDITION_T) * noise)
    audio_rows = audio.permute(1, 2, 0).reshape(-1, audio_latent_channels)
    return _joined(conditions, patch, latent_channels, "cpu"), patchify(pad_to_patch(video, patch), patch), audio_rows


def _joined(conditions: list[torch.Tensor], patch, latent_channels: int, device) -> torch.Tensor:
    """The conditions' rows one after the other (none: an empty ``[0, C·pt·ph·pw]``)."""
    width = patch[0] * patch[1] * patch[2] * latent_channels
    return torch.cat(conditions) if conditions else torch.empty(0, width, device=device)


def check_noise(draw) -> None:
    if draw not in NOISE_DRAWS:
        raise H3InputError(f"noise must be one of {list(NOISE_DRAWS)}, got {draw!r}")


def starting_rows(
    draw: str, seed: int, condition_latents: list[torch.Tensor], frames: int, height: int, width: int, audio: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The noise draw named ``draw`` (``NOISE_DRAWS``) from ``seed``: ``(condition_rows, video_rows, audio_rows)``
    on the CPU in fp32."""
    check_noise(draw)
    if draw == "comfyui":
        return initial_noise_comfyui(seed, condition_latents, frames, height, width, audio)
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    return initial_noise(generator, condition_latents, frames, height, width, audio)


def noised_reference_audio(rows: list[torch.Tensor], t: float, seed: int) -> list[torch.Tensor]:
    """Reference audio rows ``[2 · Ta, 32]`` mixed to ``t`` as ComfyUI's native H3 mixes its audio conditions
    (the commit cited at ``REFERENCE_AUDIO_T``): ``t · rows + (1 − t) · ε``, ε drawn in fp32 in row layout from
    a CPU generator seeded ``seed + 1`` afresh for every reference (each draws the same stream). Unchanged at
    ``t = 1``."""
    if t >= 1.0:
        return list(rows)
    mixed = []
    for r in rows:
        generator = torch.Generator(device="cpu").manual_seed(int(seed) + 1)
        noise = torch.randn(r.shape, generator=generator, dtype=torch.float32)
        mixed.append(t * r.float() + (1.0 - t) * noise)
    return mixed
