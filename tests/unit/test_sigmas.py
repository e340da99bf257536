"""A σ schedule from outside (ComfyUI's SIGMAS) through generate on a tiny random DiT: the audio's σ derived from the
video's as ComfyUI's native H3 derives them (re-derived here from comfy/ldm/minimax/model.py at Comfy-Org/ComfyUI
2c64d4aa, ``time_shift_sigma``), and what is not a flow schedule refused by name."""

import pytest
import torch
from test_generate import prompt, tiny_dit
from test_masks import COMMON

from h3_core.errors import H3InputError
from h3_core.pipeline.generate import generate
from h3_core.pipeline.request import ClipRequest


@pytest.fixture(scope="module")
def dit():
    return tiny_dit()


def test_the_audio_sigmas_follow_the_video_ones_as_native_derives_them():
    from h3_core.pipeline.schedule import sigma_grid, time_shift_sigma

    video = sigma_grid(8, 12.0)
    # native: invert σ = s·b / (1 + (s − 1)·b) to b, then shift by the other s; on the released grid that is the
    # audio's own grid
    base = video / (12.0 - 11.0 * video)
    torch.testing.assert_close(time_shift_sigma(video, 12.0, 3.0), 3.0 * base / (1.0 + 2.0 * base))
    torch.testing.assert_close(time_shift_sigma(video, 12.0, 3.0), sigma_grid(8, 3.0), rtol=0, atol=1e-6)


def test_a_schedule_from_outside_runs_and_the_released_one_is_what_steps_gives(dit):
    from h3_core.pipeline.schedule import sigma_grid

    released = generate(dit, prompt(), ClipRequest(frames=22, **COMMON))
    given = generate(dit, prompt(), ClipRequest(frames=22, sigmas=sigma_grid(3, 12.0), **COMMON))
    torch.testing.assert_close(given[0], released[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(given[1], released[1], rtol=0, atol=1e-4)
    other = generate(dit, prompt(), ClipRequest(frames=22, sigmas=torch.tensor([1.0, 0.9, 0.5, 0.2, 0.0]), **COMMON))
    assert not torch.equal(other[0], released[0])


@pytest.mark.parametrize(
    "sigmas, message",
    [
        (torch.tensor([14.6, 3.0, 0.0]), r"sigmas run from at most 1 down to 0; got 14.6 to 0"),
        (torch.tensor([1.0, 0.5]), r"must fall step by step and end at 0"),
        (torch.tensor([1.0, 0.5, 0.7, 0.0]), r"must fall step by step"),
        (torch.tensor([1.0]), r"at least 2 sigmas"),
    ],
)
def test_a_schedule_that_is_not_a_flow_one_is_named(dit, sigmas, message):
    with pytest.raises(H3InputError, match=message):
        generate(dit, prompt(), ClipRequest(frames=22, sigmas=sigmas, **COMMON))
