"""The rectified-flow schedule and Euler sampler of H3.

Conventions (as released): ``t = 1 − σ`` in [0, 1] with ``t = 1`` clean; the model predicts a data-ward
velocity, so the clean estimate is ``x0 = x_t + σ · v``; an Euler step blends ``x_next = r · x_t + (1 − r) · x0``
with ``r = σ_next / σ``, in fp32. Video rows use shift 12 and audio rows shift 3:
``σ' = s·σ / (1 + (s − 1)·σ)``.

``steps`` counts model evaluations, ComfyUI's convention: the σ grid has ``steps + 1`` points, from 1 to a
terminal 0 (the released pipelines and diffusers pass the number of grid points instead). Points the
shift maps onto the same fp32 value are collapsed, as released, so a strong shift with many steps can
give fewer evaluations than asked; ``sigma_grid`` returns what will actually run.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import H3InputError

__all__ = [
    "VIDEO_SHIFT",
    "AUDIO_SHIFT",
    "sigma_grid",
    "check_sigmas",
    "time_shift_sigma",
    "timesteps_of",
    "clean_estimate",
    "euler_step",
    "noise_to",
    "sample_euler",
]

VIDEO_SHIFT = 12.0
AUDIO_SHIFT = 3.0


def sigma_grid(steps: int, shift: float) -> torch.Tensor:
    """fp32 σ from 1 down to 0 for ``steps`` model evaluations (``steps + 1`` points before collapsing)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise H3InputError(f"steps must be an integer >= 1, got {steps!r}")
    if not shift > 0:
        raise H3InputError(f"shift must be positive, got {shift!r}")
    base = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float32)
    return torch.unique_consecutive(shift * base / (1 + (shift - 1) * base))


def check_sigmas(sigmas, name: str = "sigmas") -> torch.Tensor:
    """A σ schedule given from outside (ComfyUI's SIGMAS) as fp32 on the CPU: at least two points, descending,
    within [0, 1] (the flow's range), ending at 0."""
    if not isinstance(sigmas, torch.Tensor) or sigmas.dim() != 1 or sigmas.numel() < 2:
        got = tuple(sigmas.shape) if isinstance(sigmas, torch.Tensor) else type(sigmas).__name__
        raise H3InputError(f"{name}: a schedule of at least 2 sigmas is needed, got {got}")
    sigmas = sigmas.detach().float().cpu()
    if not bool(torch.isfinite(sigmas).all()) or float(sigmas.max()) > 1.0 or float(sigmas.min()) < 0.0:
        raise H3InputError(
            f"{name}: H3 is a flow model, its sigmas run from at most 1 down to 0; got {float(sigmas[0]):g} to "
            f"{float(sigmas[-1]):g} (a scheduler made for another model? set its sigma_max to 1)"
        )
    if not bool((sigmas[1:] < sigmas[:-1]).all()) or float(sigmas[-1]) != 0.0:
        raise H3InputError(f"{name}: the sigmas must fall step by step and end at 0, got {sigmas.tolist()}")
    return sigmas


def time_shift_sigma(sigma: torch.Tensor, from_shift: float, to_shift: float) -> torch.Tensor:
    """``σ`` on the ``from_shift`` schedule → the same point on the ``to_shift`` one: back to the unshifted grid
    (``b = σ / (s + σ(1 − s))``), then shifted again. How ComfyUI's native H3 derives the audio σ from the video σ
    (comfy/ldm/minimax/model.py at Comfy-Org/ComfyUI 2c64d4aa)."""
    base = sigma / (from_shift + sigma * (1.0 - from_shift))
    return to_shift * base / (1.0 + (to_shift - 1.0) * base)


def timesteps_of(sigmas: torch.Tensor) -> torch.Tensor:
    """The model's timestep for each evaluation, ``t = 1 − σ`` (the terminal σ has none)."""
    return 1.0 - sigmas[:-1]


def clean_estimate(sample: torch.Tensor, velocity: torch.Tensor, timestep) -> torch.Tensor:
    """``x0 = x_t + (1 − t) · v``; σ is taken from the timestep the model saw, as released."""
    sigma = 1 - torch.as_tensor(timestep, dtype=sample.dtype, device=sample.device)
    return sample + sigma * velocity


def euler_step(
    sample: torch.Tensor, velocity: torch.Tensor, sigma: float, sigma_next: float, timestep=None
) -> torch.Tensor:
    """One Euler step from ``sigma`` to ``sigma_next`` (fp32 for half-precision samples)."""
    x0 = clean_estimate(sample, velocity, 1 - sigma if timestep is None else timestep)
    dtype = torch.float32 if sample.dtype in (torch.float16, torch.bfloat16) else sample.dtype
    ratio = torch.as_tensor(sigma_next, dtype=dtype) / torch.as_tensor(sigma, dtype=dtype)
    return (ratio * sample.to(dtype) + (1 - ratio) * x0.to(dtype)).to(sample.dtype)


def noise_to(clean: torch.Tensor, noise: torch.Tensor, timestep) -> torch.Tensor:
    """The forward process at ``t``: ``x_t = t · x0 + (1 − t) · noise`` (t = 1 returns ``clean``)."""
    t = torch.as_tensor(timestep, dtype=clean.dtype, device=clean.device)
    return t * clean + (1 - t) * noise


def sample_euler(
    velocity: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    sample: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    progress: Callable[[int, int], None] | None = None,
    check_cancel: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Integrate from ``sigmas[0]`` to ``sigmas[-1]``: ``velocity(x, t, i)`` is evaluated once per step.
    ``progress(i + 1, n)`` follows every step; ``check_cancel()`` runs before every evaluation and raises
    to stop."""
    ts = timesteps_of(sigmas)
    n = len(ts)
    for i in range(n):
        if check_cancel is not None:
            check_cancel()
        v = velocity(sample, ts[i], i)
        sample = euler_step(sample, v, float(sigmas[i]), float(sigmas[i + 1]), ts[i])
        if progress is not None:
            progress(i + 1, n)
    return sample
