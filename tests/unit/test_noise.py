"""Per-row timesteps and the initial noise (h3_core.pipeline.noise) against diffusers 0.42.1's pipeline steps."""

import pytest
import torch

from h3_core.pipeline.noise import CONDITION_T, initial_noise, row_timesteps
from h3_core.pipeline.packing import pack_sequence

diffusers = pytest.importorskip("diffusers")
from diffusers.modular_pipelines.minimax_h3 import before_denoise
from diffusers.utils.torch_utils import randn_tensor


@pytest.mark.parametrize("keyframes", [(), ("first", "last")])
@pytest.mark.parametrize("video_t, audio_t", [(0.0, 0.0), (0.4, 0.7), (0.9995, 0.99)])
def test_row_timesteps_match_the_released_plan(keyframes, video_t, audio_t):
    text = torch.ones(9, dtype=torch.long)
    packed = pack_sequence(text, 7, 4, 6, 23, keyframes=keyframes)
    ours = row_timesteps(packed, video_t, audio_t)
    ref = before_denoise.MiniMaxH3SetTimestepsStep.build_row_timesteps(
        packed.video_index,
        packed.audio_index,
        packed.condition_rows,
        0,
        9,
        video_t,
        audio_t,
        max(video_t, CONDITION_T),
        1.0,
    )
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    if keyframes:
        assert ours[0][ours[1][packed.video_index[0]]] == max(video_t, CONDITION_T)


def test_initial_noise_matches_the_released_draw_order():
    conditions = [torch.randn(24, 1, 4, 6), torch.randn(24, 1, 4, 6)]
    ours = initial_noise(torch.Generator().manual_seed(42), conditions, 7, 4, 6, 23)

    g = torch.Generator().manual_seed(42)
    scheduler = diffusers.MiniMaxH3Scheduler()
    packed = []
    for latent in conditions:
        noise = randn_tensor((1, *latent.shape), generator=g, dtype=torch.float32)
        packed.append(
            before_denoise.patchify_video_latents(scheduler.scale_noise(latent[None], CONDITION_T, noise), (1, 2, 2))
        )
    video = randn_tensor((1, 24, 7, 4, 6), generator=g, dtype=torch.float32)
    audio = randn_tensor((46, 32), generator=g, dtype=torch.float32)
    assert torch.equal(ours[0], torch.cat(packed))
    assert torch.equal(ours[1], before_denoise.patchify_video_latents(video, (1, 2, 2)))
    assert torch.equal(ours[2], audio)


def test_no_conditions():
    rows, video, audio = initial_noise(torch.Generator().manual_seed(0), [], 2, 2, 2, 3)
    assert rows.shape == (0, 96) and video.shape == (2, 96) and audio.shape == (6, 32)
