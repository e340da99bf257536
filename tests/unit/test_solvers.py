"""An integrator from outside (ComfyUI's samplers through the node) in place of the released Euler loop: the audio
carried on the video schedule as ComfyUI's native H3 carries it — re-derived here from ``ModelSamplingAV`` in
comfy/model_sampling.py at Comfy-Org/ComfyUI 2fd20839 ("the audio target is scaled by audio_scale", ``audio_scale =
shift / audio_shift``) and the flow's ``x = (1 − σ)·x0 + σ·noise`` — so that the host's Euler, written here as
k-diffusion writes it, gives the released clip, and a second-order method runs too."""

import pytest
import torch
from test_generate import prompt, tiny_dit
from test_masks import COMMON

from h3_core.errors import H3InputError
from h3_core.pipeline.carried_audio import carry_factor, from_carried, to_carried
from h3_core.pipeline.generate import generate
from h3_core.pipeline.request import ClipRequest, Runner


@pytest.fixture(scope="module")
def dit():
    return tiny_dit()


def native_audio_sigma(sigma_v, s_v=12.0, s_a=3.0):
    b = sigma_v / (s_v + sigma_v * (1 - s_v))
    return s_a * b / (1 + (s_a - 1) * b)


@pytest.mark.parametrize("sigma_v", [1.0, 0.99, 0.9, 0.5, 0.1, 0.01, 0.0])
def test_the_carried_audio_is_a_flow_latent_on_the_video_schedule_with_the_scaled_target(sigma_v):
    g = torch.Generator().manual_seed(3)
    clean, noise = torch.randn(2, 32, 7, generator=g, dtype=torch.float64), torch.randn(2, 32, 7, generator=g)
    sigma_a = native_audio_sigma(sigma_v)
    audio = (1 - sigma_a) * clean + sigma_a * noise.double()
    carried = to_carried(audio, sigma_v, 12.0, 3.0)
    torch.testing.assert_close(carried, (1 - sigma_v) * (4.0 * clean) + sigma_v * noise.double())
    torch.testing.assert_close(from_carried(carried, sigma_v, 12.0, 3.0), audio)


def test_the_carry_is_one_at_pure_noise_and_the_audio_scale_at_the_end():
    assert carry_factor(1.0, 12.0, 3.0) == pytest.approx(1.0)
    assert carry_factor(0.0, 12.0, 3.0) == pytest.approx(4.0)
    assert carry_factor(0.5, 3.0, 3.0) == pytest.approx(1.0)  # equal shifts: nothing to carry


def k_euler(denoised, x, sigmas, on_step):
    """k-diffusion's sample_euler (no churn): d = (x − x0) / σ, x += d · (σ_next − σ)."""
    for i in range(len(sigmas) - 1):
        x0 = denoised(x, sigmas[i : i + 1])
        on_step(i + 1, len(sigmas) - 1, x0)
        x = x + (x - x0) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
    return x


def heun(denoised, x, sigmas, on_step):
    """A second-order method: evaluations between the schedule's points (σ a solver picks itself)."""
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        d = (x - denoised(x, s)) / s
        x_euler = x + d * (s_next - s)
        if s_next == 0:
            x = x_euler
        else:
            x = x + (d + (x_euler - denoised(x_euler, s_next)) / s_next) / 2 * (s_next - s)
        on_step(i + 1, len(sigmas) - 1, x)
    return x


def test_the_hosts_euler_over_the_released_grid_gives_the_released_clip(dit):
    released = generate(dit, prompt(), ClipRequest(frames=22, **COMMON))
    steps, previews = [], []
    solved = generate(
        dit,
        prompt(),
        ClipRequest(frames=22, **COMMON),
        Runner(
            solver=k_euler,
            progress=lambda i, n: steps.append((i, n)),
            preview=lambda i, n, frame: previews.append(frame.shape),
        ),
    )
    torch.testing.assert_close(solved[0], released[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(solved[1], released[1], rtol=0, atol=1e-4)
    n = COMMON["steps"]
    assert steps == [(i, n) for i in range(1, n + 1)] and len(previews) == n


def test_a_second_order_solver_evaluates_between_the_schedules_points(dit):
    calls = []
    real = dit.forward

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dit.forward = counting
    try:
        video, audio = generate(dit, prompt(), ClipRequest(frames=22, **COMMON), Runner(solver=heun))
    finally:
        del dit.forward
    assert len(calls) == 2 * COMMON["steps"] - 1 and torch.isfinite(video).all() and torch.isfinite(audio).all()
    released = generate(dit, prompt(), ClipRequest(frames=22, **COMMON))
    assert not torch.equal(video, released[0])


def test_a_solver_does_not_take_a_start_clip(dit):
    from h3_core.pipeline.masks import MaskedStart

    # 22 frames at 64x32: 7 latent frames of 2x4, 37 audio latents
    start = MaskedStart(torch.randn(24, 7, 2, 4), torch.randn(2, 32, 37), torch.ones(7, 2, 4), torch.ones(2, 37))
    with pytest.raises(H3InputError, match="start: extending or inpainting runs with the released sampler"):
        generate(dit, prompt(), ClipRequest(frames=22, start=start, **COMMON), Runner(solver=k_euler))


def test_a_solver_on_a_model_whose_adaln_stays_in_host_memory_gives_the_same_clip():
    from h3_core.models.adaln_tables import keep_adaln_on_host

    resident, hosted = tiny_dit(), tiny_dit()
    hosted.load_state_dict(resident.state_dict())
    keep_adaln_on_host(hosted)  # tables made per evaluation: a solver's σ are not known ahead
    want = generate(resident, prompt(), ClipRequest(frames=22, **COMMON), Runner(solver=heun))
    got = generate(hosted, prompt(), ClipRequest(frames=22, **COMMON), Runner(solver=heun))
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
