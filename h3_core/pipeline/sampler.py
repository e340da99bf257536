"""The denoising loop of one packed request: one model evaluation per step, the generated video rows
stepping down the video schedule (shift 12) and the generated audio rows the audio schedule (shift 3),
the conditioning and reference rows held where they are (only generated rows are ever written)."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from ..models.adaln_tables import clear_adaln_tables, prepare_adaln_tables
from ..models.run_options import apply_run_options, evaluate, run_options_of
from ..triton_forms import check_compile
from .masks import MaskedStart, masked_euler_step, masked_input, masked_row_timesteps
from .noise import CONDITION_T, REFERENCE_AUDIO_T, row_timesteps
from .packing import PackedSequence, unpatchify
from .schedule import (
    AUDIO_SHIFT,
    VIDEO_SHIFT,
    check_sigmas,
    clean_estimate,
    euler_step,
    sigma_grid,
    time_shift_sigma,
    timesteps_of,
)

__all__ = ["denoise"]


def denoise(
    model: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    packed: PackedSequence,
    text_rows: torch.Tensor,
    video_rows: torch.Tensor,
    audio_rows: torch.Tensor,
    steps: int,
    *,
    video_shift: float = VIDEO_SHIFT,
    audio_shift: float = AUDIO_SHIFT,
    condition_audio_rows: int = 0,
    condition_audio_t: float = REFERENCE_AUDIO_T,
    progress: Callable[[int, int], None] | None = None,
    check_cancel: Callable[[], None] | None = None,
    hybrid=None,
    compile: str = "auto",
    preview: Callable[[int, int, torch.Tensor], None] | None = None,
    start: MaskedStart | None = None,
    sigmas: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``steps`` model evaluations (the σ grids have ``steps + 1`` points).

    Args:
        model: called as ``model(video_rows, audio_rows, text_rows, timesteps, timestep_index, tags, positions,
            video_index, audio_index, text_index)`` → (video velocity, audio velocity), like ``H3DiT``.
        video_rows: conditioning rows (``packed.condition_rows`` of them) then the noisy target rows.
        audio_rows: reference rows (``condition_audio_rows``) then the noisy target rows; the reference rows run
            at ``max(t_audio, condition_audio_t)`` (1 unless the references were mixed with noise).
        progress: ``progress(step, steps)`` after every step; check_cancel: before every evaluation and, for a
            model with a ``check_cancel`` slot (``H3DiT``), before every block; it raises to stop.
        hybrid: a ``HybridContext`` passed to the model as ``hybrid=`` (VDN-H3); None passes nothing.
        compile: ``"auto"`` or ``"off"`` (``triton_forms.COMPILE_MODES``): each evaluation runs through
            ``block_fused.evaluate``, on the plain path when ``"off"`` or once the compiled path has failed.
        preview: ``preview(step, steps, frame)`` after every step, ``frame`` the step's clean estimate of the
            clip's middle latent frame, ``[24, 1, h, w]`` fp32 (what a live preview shows).
        start: held latents and denoise masks for the generated rows (``masks``); None generates everything.
        sigmas: a video σ schedule from outside (ComfyUI's SIGMAS; ``steps`` is then its length less one), the
            audio σ derived from it as native H3 derives it (``schedule.time_shift_sigma``); None: the released
            grids for ``steps``.
    Returns:
        The video and audio rows after the last step (conditioning rows unchanged).
    """
    check_compile(compile)
    if sigmas is None:
        video_sigmas, audio_sigmas = sigma_grid(steps, video_shift), sigma_grid(steps, audio_shift)
    else:
        video_sigmas = check_sigmas(sigmas)
        audio_sigmas = time_shift_sigma(video_sigmas, float(video_shift), float(audio_shift))
    video_ts, audio_ts = timesteps_of(video_sigmas), timesteps_of(audio_sigmas)
    n = min(len(video_ts), len(audio_ts))  # equal unless a strong shift collapsed grid points
    cv, ca = packed.condition_rows, condition_audio_rows
    video_rows, audio_rows = video_rows.clone(), audio_rows.clone()
    extra = {} if hybrid is None else {"hybrid": hybrid}
    held_video = held_audio = None  # (held rows, mask) of each stream's generated rows
    if start is not None:
        device = video_rows.device
        held_video = tuple(r.to(device) for r in start.video_rows())
        held_audio = tuple(r.to(device) for r in start.audio_rows())
        row_mask_v, row_mask_a = held_video[1].amax(dim=1).cpu(), held_audio[1][:, 0].cpu()

    def rows_t(i):
        if start is None:
            return {}
        return dict(
            video_rows_t=masked_row_timesteps(row_mask_v, video_sigmas[i], max(float(video_ts[i]), CONDITION_T)),
            audio_rows_t=masked_row_timesteps(row_mask_a, audio_sigmas[i], max(float(audio_ts[i]), 1.0)),
        )

    steps_timesteps = [
        row_timesteps(
            packed,
            float(video_ts[i]),
            float(audio_ts[i]),
            condition_audio_rows=ca,
            condition_audio_t=max(float(audio_ts[i]), float(condition_audio_t)),
            **rows_t(i),
        )
        for i in range(n)
    ]
    if getattr(model, "adaln_on_host", False):  # the blocks' AdaLN tables for the whole run, made once
        prepare_adaln_tables(model, [timesteps for timesteps, _ in steps_timesteps], video_rows.device)
    per_block = isinstance(model, torch.nn.Module) and check_cancel is not None
    if per_block:
        before = apply_run_options(model, replace(run_options_of(model), check_cancel=check_cancel))
    try:
        for i, (timesteps, index) in enumerate(steps_timesteps):
            if check_cancel is not None:
                check_cancel()
            device = video_rows.device
            video_in, audio_in = video_rows, audio_rows
            if start is not None:
                video_in, audio_in = video_rows.clone(), audio_rows.clone()
                video_in[cv:] = masked_input(video_rows[cv:], *held_video)
                audio_in[ca:] = masked_input(audio_rows[ca:], *held_audio)
            v_video, v_audio = evaluate(
                model,
                compile,
                video_in,
                audio_in,
                text_rows,
                timesteps.to(device),
                index.to(device),
                packed.tags.to(device),
                packed.positions.to(device),
                packed.video_index.to(device),
                packed.audio_index.to(device),
                packed.text_index.to(device),
                **extra,
            )
            frame = _middle_frame_estimate(packed, video_in, v_video, video_ts[i]) if preview is not None else None
            video_rows[cv:] = _step(video_rows, video_in, v_video, cv, video_sigmas, video_ts, i, held_video)
            audio_rows[ca:] = _step(audio_rows, audio_in, v_audio, ca, audio_sigmas, audio_ts, i, held_audio)
            if progress is not None:
                progress(i + 1, n)
            if preview is not None:
                preview(i + 1, n, frame)
    finally:
        if per_block:
            apply_run_options(model, replace(before, check_cancel=None))
        if getattr(model, "adaln_on_host", False):
            clear_adaln_tables(model)
    return video_rows, audio_rows


def _step(rows, model_input, velocity, first: int, sigmas, timesteps, i: int, held) -> torch.Tensor:
    """Step ``i`` of one stream's generated rows (from row ``first``): the released Euler step, or the masked one
    where ``held`` (the held rows and their mask) is given."""
    at = (float(sigmas[i]), float(sigmas[i + 1]), timesteps[i])
    if held is None:
        return euler_step(rows[first:], velocity[first:].float(), *at)
    return masked_euler_step(rows[first:], model_input[first:], velocity[first:], *held, *at)


def _middle_frame_estimate(packed: PackedSequence, video_rows, v_video, timestep) -> torch.Tensor:
    """The clean estimate ``x0 = x_t + (1 − t) · v`` of the target's middle latent frame, ``[24, 1, h, w]`` fp32."""
    layout = packed.layout
    per_frame = layout.tokens_per_frame
    start = packed.condition_rows + layout.num_frames // 2 * per_frame
    rows = slice(start, start + per_frame)
    x0 = clean_estimate(video_rows[rows].float(), v_video[rows].float(), timestep)
    return unpatchify(x0.cpu(), 24, 1, 2 * layout.frame_h, 2 * layout.frame_w)
