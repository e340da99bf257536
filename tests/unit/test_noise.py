"""Per-row timesteps and the initial noise (h3_core.pipeline.noise) against diffusers 0.42.1's pipeline steps."""

import pytest
import torch

from h3_core.errors import H3InputError
from h3_core.pipeline.noise import CONDITION_T, initial_noise, row_timesteps, starting_rows
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


# ---- the native ComfyUI draw, re-derived from its source (Comfy-Org/ComfyUI: comfy/sample.py prepare_noise at
# 542de101; comfy/ldm/minimax/model.py patchify_video, pack_audio and _cond_video_rows at 2c64d4aa) ----------------


def native_patchify(latent):  # [B, C, T, H, W] -> [B·t·h·w, C·pt·ph·pw], patch (1, 2, 2)
    b, c, t, hh, ww = latent.shape
    x = latent.reshape(b, c, t, 1, hh // 2, 2, ww // 2, 2)
    x = torch.einsum("nctrhpwq->nthwcrpq", x)
    return x.reshape(b * t * (hh // 2) * (ww // 2), c * 4)


def native_start(seed, conditions, frames, height, width, audio_t):
    generator = torch.Generator(device="cpu").manual_seed(seed)  # what torch.manual_seed(seed) seeds
    video = torch.randn([1, 24, frames, height, width], dtype=torch.float32, generator=generator, device="cpu")
    audio = torch.randn([1, 32, 2, audio_t], dtype=torch.float32, generator=generator, device="cpu")
    rows = []
    for z in conditions:
        r = native_patchify(z[None].to(torch.float32))
        gen = torch.Generator("cpu").manual_seed(seed)
        noise = torch.randn(r.shape, generator=gen, dtype=torch.float32)
        rows.append(0.999 * r + (1.0 - 0.999) * noise)
    audio_rows = audio[0].permute(1, 2, 0).reshape(2 * audio_t, 32)
    return torch.cat(rows) if rows else torch.empty(0, 96), native_patchify(video), audio_rows


@pytest.mark.parametrize("count", [0, 1, 2])
def test_the_comfyui_draw_is_the_native_one(count):
    gen = torch.Generator().manual_seed(9)
    conditions = [torch.randn(24, 1, 4, 6, generator=gen), torch.randn(24, 2, 4, 6, generator=gen)][:count]
    ours = starting_rows("comfyui", 1234, conditions, 7, 4, 6, 23)
    theirs = native_start(1234, conditions, 7, 4, 6, 23)
    for mine, native in zip(ours, theirs):
        assert mine.shape == native.shape and torch.equal(mine, native)


def test_the_released_draw_is_the_default_and_differs_from_the_native_one():
    conditions = [torch.randn(24, 1, 4, 6)]
    released = starting_rows("released", 5, conditions, 7, 4, 6, 23)
    assert all(
        torch.equal(a, b)
        for a, b in zip(released, initial_noise(torch.Generator().manual_seed(5), conditions, 7, 4, 6, 23))
    )
    native = starting_rows("comfyui", 5, conditions, 7, 4, 6, 23)
    assert not torch.equal(released[0], native[0]) and not torch.equal(released[2], native[2])
    with pytest.raises(H3InputError, match=r"noise must be one of \['released', 'comfyui'\], got 'native'"):
        starting_rows("native", 5, conditions, 7, 4, 6, 23)
