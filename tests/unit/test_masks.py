"""Denoise masks (h3_core.pipeline.masks) through generate on a tiny random DiT, against the native rules
re-derived here from Comfy-Org/ComfyUI comfy/ldm/minimax/model.py at 2c64d4aa (``mask_row_values``; the masked rows'
timesteps ``(1 - m · sigma).clamp(max=max(t, 0.999))``)."""

import pytest
import torch
from test_generate import prompt, tiny_dit

from h3_core.errors import H3InputError
from h3_core.pipeline.generate import generate
from h3_core.pipeline.masks import (
    MaskedStart,
    extend_start,
    latent_frame_spans,
    masked_row_timesteps,
    region_mask,
    span_mask,
)


def native_mask_row_values(mask, latent_t, lat_h, lat_w):
    m = torch.nn.functional.pad(mask, (0, lat_w - mask.shape[-1], 0, lat_h - mask.shape[-2]), mode="replicate")
    return m.reshape(latent_t, lat_h // 2, 2, lat_w // 2, 2).amax(dim=(2, 4)).reshape(-1)


def test_row_timesteps_follow_the_native_rule():
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(7, 4, 6, generator=gen) > 0.6).float() * torch.rand(7, 4, 6, generator=gen)
    start = MaskedStart(torch.zeros(24, 7, 4, 6), torch.zeros(2, 32, 5), mask, torch.ones(2, 5))
    _, element_mask = start.video_rows()
    for sigma, t in ((torch.tensor(0.8), 0.2), (torch.tensor(0.0004), 0.9996)):
        ours = masked_row_timesteps(element_mask.amax(dim=1), sigma, max(t, 0.999))
        native = (1.0 - native_mask_row_values(mask, 7, 4, 6) * sigma).clamp(max=max(t, 0.999))
        assert torch.equal(ours, native)


@pytest.fixture(scope="module")
def dit():
    return tiny_dit()


COMMON = dict(width=64, height=32, steps=3, seed=4)


def test_an_all_ones_mask_is_the_unmasked_run(dit):
    plain = generate(dit, prompt(), frames=22, **COMMON)
    start = MaskedStart(torch.randn(24, 7, 2, 4), torch.randn(2, 32, 37), torch.ones(7, 2, 4), torch.ones(2, 37))
    masked = generate(dit, prompt(), frames=22, start=start, **COMMON)
    assert torch.equal(plain[0], masked[0]) and torch.equal(plain[1], masked[1])


def test_extending_holds_the_clip_bit_for_bit(dit):
    video, audio = generate(dit, prompt(), frames=22, **COMMON)
    start = extend_start(video, audio, 12, 65)  # 22 frames (7 latents) extended to 39 (12)
    longer, longer_audio = generate(dit, prompt(), frames=39, start=start, **dict(COMMON, seed=5))
    assert longer.shape == (24, 12, 2, 4) and longer_audio.shape == (2, 32, 65)
    assert torch.equal(longer[:, :7], video) and torch.equal(longer_audio[..., :37], audio)
    assert torch.isfinite(longer).all() and not torch.equal(longer[:, 7:], torch.zeros_like(longer[:, 7:]))


def test_a_held_region_stays_and_the_rest_is_generated(dit):
    video, audio = generate(dit, prompt(), frames=22, **COMMON)
    mask = torch.zeros(7, 2, 4)
    mask[:, :, 2:] = 1  # regenerate the right half of every frame
    again, again_audio = generate(
        dit, prompt(), frames=22, start=MaskedStart(video, audio, mask, torch.zeros(2, 37)), **dict(COMMON, seed=9)
    )
    assert torch.equal(again[..., :2], video[..., :2]) and torch.equal(again_audio, audio)
    assert not torch.equal(again[..., 2:], video[..., 2:])


def test_latent_frames_cover_the_clip_as_native_counts_it():
    spans = latent_frame_spans(12)
    assert spans[:3] == [(0, 1), (1, 5), (5, 9)] and spans[5] == (17, 18) and spans[-1][1] == 39


def test_a_span_regenerates_the_latent_frames_covering_it_and_their_sound():
    video, sound = span_mask(7, 2, 4, 37, 6, 10)  # pixel frames 6..9: latent frames 2 (5-8) and 3 (9-12)
    assert video[:, 0, 0].tolist() == [0, 0, 1, 1, 0, 0, 0]
    # latent frames 2-3 cover pixel frames 5..13, 5/24 s to 13/24 s: audio latents 8 (0.200 s) to 21 (0.550 s)
    assert sound[0].nonzero().flatten().tolist() == list(range(8, 22)) and torch.equal(sound[0], sound[1])
    assert span_mask(7, 2, 4, 37, 6, 10, audio="hold")[1].sum() == 0
    assert span_mask(7, 2, 4, 37, 6, 10, audio="generate")[1].min() == 1
    with pytest.raises(H3InputError, match="must lie within the clip's 22 frames"):
        span_mask(7, 2, 4, 37, 20, 30)


def test_a_pixel_region_marks_every_latent_cell_it_touches():
    pixels = torch.zeros(32, 64)
    pixels[20, 40] = 1  # one pixel in latent cell (1, 2)
    cells = region_mask(pixels, 2, 4)
    assert cells.tolist() == [[0, 0, 0, 0], [0, 0, 1, 0]]


def test_a_start_that_does_not_fit_the_clip_is_named(dit):
    start = MaskedStart(torch.zeros(24, 7, 2, 4), torch.zeros(2, 32, 37), torch.ones(7, 2, 4) * 2, torch.ones(2, 37))
    with pytest.raises(H3InputError, match=r"video_mask must lie in \[0, 1\]"):
        generate(dit, prompt(), frames=22, start=start, **COMMON)
    with pytest.raises(H3InputError, match=r"start: its video is \[24, 7, 2, 4\] but the clip being generated needs"):
        generate(dit, prompt(), frames=39, start=start, **COMMON)
    with pytest.raises(H3InputError, match="must be longer than the 22 it extends"):
        extend_start(torch.zeros(24, 7, 2, 4), torch.zeros(2, 32, 37), 7, 37)
