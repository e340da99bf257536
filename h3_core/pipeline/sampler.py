"""The denoising loop of one packed request: one model evaluation per step, the generated video rows
stepping down the video schedule (shift 12) and the generated audio rows the audio schedule (shift 3),
the conditioning and reference rows held where they are (only generated rows are ever written)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..errors import H3InputError
from ..models.adaln_tables import clear_adaln_tables, prepare_adaln_tables
from ..models.options import PLAIN, RunOptions
from ..models.run_options import Evaluations
from .carried_audio import carried_clean, from_carried, to_carried
from .masks import masked_euler_step, masked_input, masked_row_timesteps
from .noise import CONDITION_T, REFERENCE_AUDIO_T, row_timesteps
from .packing import PackedSequence, repad_rows, unpatchify
from .request import ClipRequest, Runner
from .schedule import (
    check_sigmas,
    clean_estimate,
    euler_step,
    sigma_grid,
    time_shift_sigma,
    timesteps_of,
)

__all__ = ["denoise", "SequenceRows"]


@dataclass(frozen=True)
class SequenceRows:
    """The packed sequence's rows by kind, in the order of its indices: ``text`` ``[L, text_dim]``; ``video``: the
    conditioning rows (``packed.condition_rows`` of them) then the noisy target rows; ``audio``: ``reference_audio``
    reference rows then the noisy target rows, the reference rows run at ``max(t_audio, reference_audio_t)`` (1
    unless they were mixed with noise)."""

    text: torch.Tensor
    video: torch.Tensor
    audio: torch.Tensor
    reference_audio: int = 0
    reference_audio_t: float = REFERENCE_AUDIO_T


def denoise(
    model: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    packed: PackedSequence,
    rows: SequenceRows,
    request: ClipRequest,
    runner: Runner = Runner(),
    *,
    hybrid=None,
    run: RunOptions = PLAIN,
    video_size: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``request.steps`` model evaluations (the σ grids have ``steps + 1`` points) over ``rows``.

    Args:
        model: called as ``model(video_rows, audio_rows, text_rows, timesteps, timestep_index, tags, positions,
            video_index, audio_index, text_index)`` → (video velocity, audio velocity), like ``H3DiT`` (which is
            given ``run=`` as well: a model with a ``compiled_form``).
        request: its schedule (``steps``, ``video_shift`` / ``audio_shift``, or ``sigmas``: a video σ schedule from
            outside, ComfyUI's SIGMAS, ``steps`` then its length less one, the audio σ derived from it as native H3
            derives it, ``schedule.time_shift_sigma``), ``start`` (held latents and denoise masks for the generated
            rows, ``masks``; None generates everything) and ``compile`` (each evaluation runs through
            ``run_options.Evaluations``, on the plain path when ``"off"`` or once the compiled path has failed).
            Its geometry is what ``packed`` was made from.
        runner: ``progress(step, steps)`` after every step; ``check_cancel()`` before every evaluation (given with
            it as ``RunOptions.check_cancel``: an ``H3DiT`` calls it before each of its blocks), raising to stop;
            ``preview(step, steps, frame)`` after every step, ``frame`` the step's clean estimate of the clip's middle
            latent frame, ``[24, 1, h, w]`` fp32 (what a live preview shows); ``solver`` integrates in place of the
            released Euler loop (e.g. one of ComfyUI's samplers), as ``solver(denoised, x, sigmas, on_step)`` → the
            final ``x``: ``x`` ``[1, N]`` fp32 holds the generated video rows then the generated audio rows carried on
            the video schedule (``carried_audio``), ``denoised(x, σ)`` is one model evaluation's clean estimate of it at
            video σ (``σ`` a 0-d or 1-element tensor), and ``on_step(i, n, denoised)`` reports step ``i`` of ``n``
            (progress and preview); not with ``start``.
        hybrid: a ``HybridContext`` passed to the model as ``hybrid=`` (VDN-H3); None passes nothing.
        run: the ``RunOptions`` every evaluation of an ``H3DiT`` is given (a placement's, ``FittedModel.options``).
        video_size: the target's latent ``(frames, height, width)`` where it is not whole patches: its rows are on
            the padded grid, and the padding is made again from the latent before every evaluation, as native H3
            pads the latent it is given (``packing.repad_rows``); None when it divides.
    Returns:
        The video and audio rows after the last step (conditioning rows unchanged).
    """
    steps, sigmas, start, solver = request.steps, request.sigmas, request.start, runner.solver
    video_shift, audio_shift = request.video_shift, request.audio_shift
    progress, check_cancel, preview = runner.progress, runner.check_cancel, runner.preview
    text_rows, video_rows, audio_rows = rows.text, rows.video, rows.audio
    condition_audio_rows, condition_audio_t = rows.reference_audio, rows.reference_audio_t
    if sigmas is None:
        video_sigmas, audio_sigmas = sigma_grid(steps, video_shift), sigma_grid(steps, audio_shift)
    else:
        video_sigmas = check_sigmas(sigmas)
        audio_sigmas = time_shift_sigma(video_sigmas, float(video_shift), float(audio_shift))
    evaluations = Evaluations(
        model, run if check_cancel is None else replace(run, check_cancel=check_cancel), request.compile
    )
    if solver is not None:
        if start is not None:
            raise H3InputError(
                "start: extending or inpainting runs with the released sampler; disconnect the sampler input"
            )
        solving = _Run(evaluations, packed, text_rows, video_rows, audio_rows, condition_audio_rows, hybrid, video_size)
        return solving.solve(
            solver,
            video_sigmas,
            (float(video_shift), float(audio_shift)),
            condition_audio_t,
            progress,
            preview,
        )
    video_ts, audio_ts = timesteps_of(video_sigmas), timesteps_of(audio_sigmas)
    n = min(len(video_ts), len(audio_ts))  # equal unless a strong shift collapsed grid points
    cv, ca = packed.condition_rows, condition_audio_rows
    video_rows, audio_rows = video_rows.clone(), audio_rows.clone()
    held_video = held_audio = None  # (held rows, mask) of each stream's generated rows
    row_mask_v = row_mask_a = None  # the mask values the rows' timesteps follow; None: the stream's own timestep
    if start is not None:
        device = video_rows.device
        held_video = tuple(r.to(device) for r in start.video_rows())
        held_audio = tuple(r.to(device) for r in start.audio_rows())
        row_mask_v, row_mask_a = (m if m is None else m.cpu() for m in (start.video_row_mask(), start.audio_row_mask()))

    def rows_t(i):
        rows = {}
        if row_mask_v is not None:
            pin = max(float(video_ts[i]), CONDITION_T)
            rows["video_rows_t"] = masked_row_timesteps(row_mask_v, video_sigmas[i], pin)
        if row_mask_a is not None:
            rows["audio_rows_t"] = masked_row_timesteps(row_mask_a, audio_sigmas[i], max(float(audio_ts[i]), 1.0))
        return rows

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
    stepping = _Run(evaluations, packed, text_rows, video_rows, audio_rows, ca, hybrid)
    try:
        for i, (timesteps, index) in enumerate(steps_timesteps):
            if video_size is not None:
                video_rows[cv:] = repad_rows(video_rows[cv:], *video_size)
            video_in, audio_in = video_rows, audio_rows
            if start is not None:
                video_in, audio_in = video_rows.clone(), audio_rows.clone()
                video_in[cv:] = masked_input(video_rows[cv:], *held_video)
                audio_in[ca:] = masked_input(audio_rows[ca:], *held_audio)
            v_video, v_audio = stepping.velocities(video_in, audio_in, timesteps, index)
            frame = None
            if preview is not None:
                mid = _middle_rows(packed)
                frame = _as_frame(
                    packed, clean_estimate(video_in[cv:][mid].float(), v_video[cv:][mid].float(), video_ts[i])
                )
            video_rows[cv:] = _step(video_rows, video_in, v_video, cv, video_sigmas, video_ts, i, held_video)
            audio_rows[ca:] = _step(audio_rows, audio_in, v_audio, ca, audio_sigmas, audio_ts, i, held_audio)
            if progress is not None:
                progress(i + 1, n)
            if preview is not None:
                preview(i + 1, n, frame)
    finally:
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


def _middle_rows(packed: PackedSequence) -> slice:
    """The target's middle latent frame among its generated video rows."""
    per_frame = packed.layout.tokens_per_frame
    start = packed.layout.num_frames // 2 * per_frame
    return slice(start, start + per_frame)


def _as_frame(packed: PackedSequence, clean_rows: torch.Tensor) -> torch.Tensor:
    """The middle frame's clean rows as a latent frame ``[24, 1, h, w]`` fp32 on the CPU."""
    layout = packed.layout
    return unpatchify(clean_rows.float().cpu(), 24, 1, 2 * layout.frame_h, 2 * layout.frame_w)


# the integrator given from outside: (denoised, x, video sigmas, on_step) -> final x (``denoise``'s ``solver``)
Solver = Callable[[Callable, torch.Tensor, torch.Tensor, Callable], torch.Tensor]


class _Run:
    """One request's fixed inputs, for evaluations at any σ."""

    def __init__(
        self, evaluations, packed, text_rows, video_rows, audio_rows, condition_audio_rows, hybrid, video_size=None
    ):
        self.evaluations, self.packed, self.text_rows = evaluations, packed, text_rows
        self.video_size = video_size
        self.video_rows, self.audio_rows, self.ca = video_rows, audio_rows, condition_audio_rows
        self.extra = {} if hybrid is None else {"hybrid": hybrid}

    def velocities(self, video_in, audio_in, timesteps, index):
        """One model evaluation of the whole sequence: (video velocity, audio velocity)."""
        packed, device = self.packed, video_in.device
        return self.evaluations(
            video_in,
            audio_in,
            self.text_rows,
            timesteps.to(device),
            index.to(device),
            *packed.model_inputs(device),
            **self.extra,
        )

    def solve(self, solver, video_sigmas, shifts, condition_audio_t, progress, preview):
        """``denoise`` with ``solver`` integrating: the generated rows packed into one state with the audio carried
        on the video schedule, each ``denoised`` call one evaluation, the final state unpacked."""
        cv, ca, packed = self.packed.condition_rows, self.ca, self.packed
        video_rows, audio_rows = self.video_rows, self.audio_rows
        video, audio = video_rows[cv:].float(), audio_rows[ca:].float()
        nv = video.numel()
        first = float(video_sigmas[0])
        state = torch.cat([video.flatten(), to_carried(audio, first, *shifts).flatten()])[None]
        host_tables = getattr(self.evaluations.model, "adaln_on_host", False)

        def denoised(x, sigma):
            sigma_v = torch.as_tensor(sigma, dtype=torch.float32).flatten()[:1].cpu()
            sigma_a = time_shift_sigma(sigma_v, *shifts)
            t_video, t_audio = float(1.0 - sigma_v), float(1.0 - sigma_a)
            x_video = x[0, :nv].view_as(video)
            if self.video_size is not None:
                x_video = repad_rows(x_video, *self.video_size)
            x_audio = from_carried(x[0, nv:].view_as(audio), float(sigma_v), *shifts)
            video_in = torch.cat([video_rows[:cv], x_video.to(video_rows.dtype)])
            audio_in = torch.cat([audio_rows[:ca], x_audio.to(audio_rows.dtype)])
            timesteps, index = row_timesteps(
                packed, t_video, t_audio, condition_audio_rows=ca, condition_audio_t=max(t_audio, condition_audio_t)
            )
            if host_tables:  # the σ a solver asks for are not known ahead: this evaluation's tables only
                prepare_adaln_tables(self.evaluations.model, [timesteps], video_in.device)
            try:
                v_video, v_audio = self.velocities(video_in, audio_in, timesteps, index)
            finally:
                if host_tables:
                    clear_adaln_tables(self.evaluations.model)
            clean_video = clean_estimate(video_in[cv:].float(), v_video[cv:].float(), t_video)
            clean_audio = clean_estimate(audio_in[ca:].float(), v_audio[ca:].float(), t_audio)
            return torch.cat([clean_video.flatten(), carried_clean(clean_audio, *shifts).flatten()])[None].to(x.dtype)

        def on_step(i, n, clean):
            if progress is not None:
                progress(i, n)
            if preview is not None:
                preview(i, n, _as_frame(packed, clean[0, :nv].view_as(video)[_middle_rows(packed)]))

        final = solver(denoised, state, video_sigmas.to(video_rows.device), on_step)
        last = float(video_sigmas[-1])
        video_rows, audio_rows = video_rows.clone(), audio_rows.clone()
        video_rows[cv:] = final[0, :nv].view_as(video).to(video_rows.dtype)
        audio_rows[ca:] = from_carried(final[0, nv:].view_as(audio), last, *shifts).to(audio_rows.dtype)
        return video_rows, audio_rows
