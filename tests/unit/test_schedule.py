"""The rectified-flow schedule and sampler (h3_core.pipeline.schedule) against diffusers 0.42.1's
MiniMaxH3Scheduler and against closed forms."""

import pytest
import torch

from h3_core.errors import H3InputError
from h3_core.pipeline.schedule import (
    AUDIO_SHIFT,
    VIDEO_SHIFT,
    euler_step,
    noise_to,
    sample_euler,
    sigma_grid,
    timesteps_of,
)

diffusers = pytest.importorskip("diffusers")


@pytest.mark.parametrize("shift", [VIDEO_SHIFT, AUDIO_SHIFT, 1.0, 5.0])
@pytest.mark.parametrize("steps", [1, 2, 8, 20, 50, 200])
def test_grid_and_timesteps_equal_the_released_scheduler(shift, steps):
    ref = diffusers.MiniMaxH3Scheduler(shift=shift)
    ref.set_timesteps(steps + 1)  # diffusers counts grid points; we count model evaluations
    sigmas = sigma_grid(steps, shift)
    assert torch.equal(sigmas, ref.sigmas)
    assert torch.equal(timesteps_of(sigmas), ref.timesteps)
    assert sigmas[0] == 1 and sigmas[-1] == 0
    if len(sigmas) == steps + 1:
        assert ref.num_inference_steps == steps


def test_the_grid_is_the_shifted_linear_grid():
    sigmas = sigma_grid(4, 3.0)
    base = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    assert torch.allclose(sigmas, 3 * base / (1 + 2 * base))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_equal_the_released_scheduler(dtype):
    ref = diffusers.MiniMaxH3Scheduler(shift=VIDEO_SHIFT)
    ref.set_timesteps(9)
    sigmas = sigma_grid(8, VIDEO_SHIFT)
    g = torch.Generator().manual_seed(0)
    ours = theirs = torch.randn(2, 24, 3, 4, generator=g).to(dtype)
    for i, t in enumerate(ref.timesteps):
        v = torch.randn(ours.shape, generator=g).to(dtype)
        theirs = ref.step(v, t, theirs).prev_sample
        ours = euler_step(ours, v, float(sigmas[i]), float(sigmas[i + 1]), timesteps_of(sigmas)[i])
        assert ours.dtype == dtype
        assert torch.equal(ours, theirs), i


def test_noise_to_matches_scale_noise():
    ref = diffusers.MiniMaxH3Scheduler()
    x, n = torch.randn(3, 5), torch.randn(3, 5)
    for t in (0.0, 0.3, 0.999, 1.0):
        assert torch.equal(noise_to(x, n, t), ref.scale_noise(x, t, n))
    assert torch.equal(noise_to(x, n, 1.0), x)


@pytest.mark.parametrize("steps, shift", [(1, 1.0), (8, VIDEO_SHIFT), (30, AUDIO_SHIFT)])
def test_exact_velocity_field_lands_on_its_target(steps, shift):
    # The data-ward velocity towards a fixed x* is (x* − x_t) / σ: every Euler step then moves exactly
    # along the straight path, and the last one lands on x*.
    target = torch.randn(4, 6, dtype=torch.float64)
    start = torch.randn(4, 6, dtype=torch.float64)
    sigmas = sigma_grid(steps, shift).double()
    seen = []

    def velocity(x, t, i):
        sigma = 1 - t
        # the path is x_t = t x* + σ x_noise; check we are on it before each step
        seen.append(i)
        return (target - x) / sigma

    out = sample_euler(velocity, start, sigmas)
    assert seen == list(range(len(sigmas) - 1))
    assert torch.allclose(out, target, atol=1e-12)
    # and halfway it sits on the straight line between noise and target
    half = sample_euler(velocity, start, sigmas[: len(sigmas) // 2 + 1])
    s = sigmas[len(sigmas) // 2]
    assert torch.allclose(half, (1 - s) * target + s * start, atol=1e-12)


def test_progress_and_cancel():
    sigmas = sigma_grid(5, 1.0)
    calls = []
    sample_euler(
        lambda x, t, i: torch.zeros_like(x), torch.zeros(2), sigmas, progress=lambda i, n: calls.append((i, n))
    )
    assert calls == [(i, 5) for i in range(1, 6)]
    evaluated = []

    def cancel():
        if len(evaluated) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sample_euler(
            lambda x, t, i: evaluated.append(i) or torch.zeros_like(x), torch.zeros(2), sigmas, check_cancel=cancel
        )
    assert evaluated == [0, 1]


@pytest.mark.parametrize(
    "steps, shift, message",
    [
        (0, 12.0, "steps must be an integer >= 1, got 0"),
        (2.5, 12.0, "steps must be an integer >= 1, got 2.5"),
        (8, 0.0, "shift must be positive, got 0.0"),
    ],
)
def test_bad_schedule_arguments(steps, shift, message):
    with pytest.raises(H3InputError, match=message):
        sigma_grid(steps, shift)
