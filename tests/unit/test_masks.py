"""Denoise masks (h3_core.pipeline.masks) through generate on a tiny random DiT, against the native rules
re-derived here from Comfy-Org/ComfyUI comfy/ldm/minimax/model.py at 2c64d4aa (``mask_row_values``: the mask padded
with ``mode="replicate"``, the 2x2 max, a mask whose values all reach 1 - 1e-3 counting as none; the masked rows'
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
    patch_row_mask,
    region_mask,
    span_mask,
)
from h3_core.pipeline.request import ClipRequest


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
    plain = generate(dit, prompt(), ClipRequest(frames=22, **COMMON))
    start = MaskedStart(torch.randn(24, 7, 2, 4), torch.randn(2, 32, 37), torch.ones(7, 2, 4), torch.ones(2, 37))
    masked = generate(dit, prompt(), ClipRequest(frames=22, start=start, **COMMON))
    assert torch.equal(plain[0], masked[0]) and torch.equal(plain[1], masked[1])


def test_extending_holds_the_clip_bit_for_bit(dit):
    video, audio = generate(dit, prompt(), ClipRequest(frames=22, **COMMON))
    start = extend_start(video, audio, 12, 65)  # 22 frames (7 latents) extended to 39 (12)
    longer, longer_audio = generate(dit, prompt(), ClipRequest(frames=39, start=start, **dict(COMMON, seed=5)))
    assert longer.shape == (24, 12, 2, 4) and longer_audio.shape == (2, 32, 65)
    assert torch.equal(longer[:, :7], video) and torch.equal(longer_audio[..., :37], audio)
    assert torch.isfinite(longer).all() and not torch.equal(longer[:, 7:], torch.zeros_like(longer[:, 7:]))


def test_a_held_region_stays_and_the_rest_is_generated(dit):
    video, audio = generate(dit, prompt(), ClipRequest(frames=22, **COMMON))
    mask = torch.zeros(7, 2, 4)
    mask[:, :, 2:] = 1  # regenerate the right half of every frame
    again, again_audio = generate(
        dit,
        prompt(),
        ClipRequest(frames=22, start=MaskedStart(video, audio, mask, torch.zeros(2, 37)), **dict(COMMON, seed=9)),
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
        generate(dit, prompt(), ClipRequest(frames=22, start=start, **COMMON))
    with pytest.raises(H3InputError, match=r"start: its video is \[24, 7, 2, 4\] but the clip being generated needs"):
        generate(dit, prompt(), ClipRequest(frames=39, start=start, **COMMON))
    with pytest.raises(H3InputError, match="must be longer than the 22 it extends"):
        extend_start(torch.zeros(24, 7, 2, 4), torch.zeros(2, 32, 37), 7, 37)


def hand_row_values(mask, pad):
    """The 2x2 max of each patch row of ``mask`` ``[T, h, w]`` on the grid padded to even size, by explicit loops:
    a padded cell ``(i, j)`` reads ``mask[t, pad(i, h), pad(j, w)]``."""
    T, h, w = mask.shape
    values = []
    for t in range(T):
        for pi in range((h + 1) // 2):
            for pj in range((w + 1) // 2):
                cells = [float(mask[t, pad(2 * pi + di, h), pad(2 * pj + dj, w)]) for di in (0, 1) for dj in (0, 1)]
                values.append(max(cells))
    return torch.tensor(values)


def replicate(i, n):
    return min(i, n - 1)


def circular(i, n):
    return i % n


def seen_timesteps(dit, **kwargs):
    """Run generate, keeping each evaluation's per-row timesteps of the generated video rows and audio rows (t2va:
    no conditioning or reference rows), as the DiT is given them."""
    seen, real = [], dit.forward

    def recording(
        video_rows, audio_rows, text_rows, timesteps, index, tags, positions, video_index, audio_index, *a, **kw
    ):
        per_row = timesteps[index]
        seen.append((per_row[video_index].clone(), per_row[audio_index].clone()))
        return real(
            video_rows, audio_rows, text_rows, timesteps, index, tags, positions, video_index, audio_index, *a, **kw
        )

    dit.forward = recording
    try:
        generate(dit, prompt(), ClipRequest(**kwargs))
    finally:
        del dit.forward
    return seen


def test_an_odd_grid_holds_the_last_row_and_column_at_the_pinned_timestep(dit):
    # 80 x 48 pixels: 3 x 5 latents, padded to 4 x 6 (2 x 3 patch rows per frame); 22 frames: 7 latent frames
    mask = torch.ones(7, 3, 5)
    mask[1:4, :2, :2] = 0.5
    mask[:, 2, :] = 0  # hold the last latent row
    mask[:, :, 4] = 0  # and the last latent column
    want = hand_row_values(mask, replicate)
    held = torch.zeros(7, 2, 3, dtype=torch.bool)
    held[:, 1, :] = held[:, :, 2] = True  # the patch row and column the held latents fall in
    held = held.reshape(-1)
    assert (want[held] == 0).all() and (want[~held] > 0).all()
    wrapped = hand_row_values(mask, circular)  # the circular pad reads the first row / column there instead
    assert (wrapped[held] > 0).all() and torch.equal(wrapped[~held], want[~held])

    start = MaskedStart(torch.randn(24, 7, 3, 5), torch.randn(2, 32, 37), mask, torch.ones(2, 37))
    assert torch.equal(patch_row_mask(mask), want) and torch.equal(start.video_row_mask(), want)

    common = dict(frames=22, width=80, height=48, steps=3, seed=4)
    plain = seen_timesteps(dit, **common)
    masked = seen_timesteps(dit, start=start, **common)
    assert len(masked) == len(plain) == 3
    for (t_plain, _), (t_rows, _) in zip(plain, masked):
        t = float(t_plain[0])  # the stream's timestep, every row of the unmasked run
        assert torch.equal(t_plain, torch.full_like(t_plain, t))
        pin = max(t, 0.999)
        sigma = 1.0 - t
        assert torch.equal(t_rows[held], torch.full((int(held.sum()),), pin))
        torch.testing.assert_close(t_rows, (1.0 - want * sigma).clamp(max=pin), rtol=0, atol=1e-6)
        if sigma > 1e-3:  # the circular pad would have regenerated them
            assert ((1.0 - wrapped[held] * sigma).clamp(max=pin) < pin - 1e-4).all()


def test_a_mask_at_or_above_0_999_runs_the_unmasked_timesteps(dit):
    video, audio = torch.randn(24, 7, 2, 4), torch.randn(2, 32, 37)
    almost = MaskedStart(video, audio, torch.full((7, 2, 4), 0.9995), torch.full((2, 37), 0.9995))
    assert almost.video_row_mask() is None and almost.audio_row_mask() is None
    plain = seen_timesteps(dit, frames=22, **COMMON)
    masked = seen_timesteps(dit, frames=22, start=almost, **COMMON)
    assert len(masked) == len(plain) == COMMON["steps"]
    for (v_plain, a_plain), (v_rows, a_rows) in zip(plain, masked):
        assert torch.equal(v_rows, v_plain) and torch.equal(a_rows, a_plain)

    # one element of a patch below 0.999: the 2x2 max still reaches it, fully generated
    one_cell = torch.full((7, 2, 4), 0.9995)
    one_cell[3, 0, 0] = 0.998
    assert MaskedStart(video, audio, one_cell, torch.ones(2, 37)).video_row_mask() is None

    # a whole patch (video) or one audio latent (audio) at 0.998: masked, each stream on its own
    video_mask = torch.full((7, 2, 4), 0.9995)
    video_mask[3, :, :2] = 0.998
    audio_mask = torch.full((2, 37), 0.9995)
    audio_mask[1, 20] = 0.998
    for start, video_masked in (
        (MaskedStart(video, audio, video_mask, torch.full((2, 37), 0.9995)), True),
        (MaskedStart(video, audio, torch.full((7, 2, 4), 0.9995), audio_mask), False),
    ):
        assert (start.video_row_mask() is None) != video_masked and (start.audio_row_mask() is None) == video_masked
        masked = seen_timesteps(dit, frames=22, start=start, **COMMON)
        (v_plain, a_plain), (v_rows, a_rows) = plain[0], masked[0]  # step 0: sigma 1, t 0
        # a masked stream's rows all follow 1 - m · sigma, its 0.9995 rows included
        if video_masked:
            assert not torch.equal(v_rows, v_plain) and torch.equal(a_rows, a_plain)
            torch.testing.assert_close(v_rows, 1.0 - hand_row_values(video_mask, replicate), rtol=0, atol=1e-6)
        else:
            assert torch.equal(v_rows, v_plain) and not torch.equal(a_rows, a_plain)
            torch.testing.assert_close(a_rows, 1.0 - audio_mask.reshape(-1), rtol=0, atol=1e-6)
