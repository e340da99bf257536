"""Keyframes anywhere (h3_core.pipeline.keyframes and pack_sequence's KeyframeSlot), against a re-derivation of
ComfyUI's native guide placement written here from its source (Comfy-Org/ComfyUI: comfy_extras/nodes_minimax_h3.py
at 542de101, MiniMaxH3AddGuide; comfy/ldm/minimax/model.py at 2c64d4aa, PackedLayout and _forward's timesteps)."""

import math

import pytest
import torch
from test_generate import prompt, tiny_dit

from h3_core.errors import H3InputError
from h3_core.pipeline.generate import generate
from h3_core.pipeline.keyframes import Keyframe, guide_audio_latents, guide_frames, latent_span, resolve_frame_index
from h3_core.pipeline.noise import row_timesteps
from h3_core.pipeline.packing import KeyframeSlot, pack_sequence
from h3_core.pipeline.request import ClipRequest

# ---- the native convention, re-derived ------------------------------------------------------------------------


def native_axis(dim, sqrt_area):
    n = dim // 2
    ratio = dim / sqrt_area
    return (torch.arange(n, dtype=torch.float64) * (ratio / n) + (1.0 - ratio) / 2.0) * 32.0


def native_frame(h, w):
    area = math.sqrt(h * w)
    hh, ww = torch.meshgrid(native_axis(h, area), native_axis(w, area), indexing="ij")
    return torch.stack([hh.reshape(-1), ww.reshape(-1)], -1), native_axis(w, area)


def native_video(vt, frame, origin):
    spans = torch.tensor([5.0 / 3.0 * (1, 4, 4, 4, 4)[k % 5] for k in range(vt)], dtype=torch.float64)
    times = float(origin) + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])
    g = torch.empty(vt, frame.shape[0], 3, dtype=torch.float64)
    g[:, :, 0] = times[:, None]
    g[:, :, 1:] = frame[None]
    return g.reshape(-1, 3)


def native_audio(origin, t, low, high):
    g = torch.zeros(2 * t, 3, dtype=torch.float64)
    g[:, 0] = (origin + torch.arange(t, dtype=torch.float64)).repeat(2)
    g[:t, 2], g[t:, 2] = low, high
    return g


def native_layout(text_len, latent_t, h, w, audio_t, keyframes):
    """Positions and (kind, rows) segments; keyframes as (resolved_frame_index, latent frames or 0, audio or 0)."""
    frame, w_grid = native_frame(h, w)
    g = torch.zeros(text_len, 3, dtype=torch.float64)
    g[:, 0] = torch.arange(text_len, dtype=torch.float64)
    pos, kinds = [g], ["text"] * text_len
    for index, vt, rt in keyframes:
        cond_t = float(text_len) + 5.0 / 3.0 * index
        if vt:
            pos.append(native_video(vt, frame, cond_t))
            kinds += ["cond"] * (vt * frame.shape[0])
        if rt:
            pos.append(native_audio(cond_t, rt, float(w_grid[0]), float(w_grid[-1])))
            kinds += ["cond_audio"] * (2 * rt)
    pos.append(native_audio(float(text_len), audio_t, float(w_grid[0]), float(w_grid[-1])))
    kinds += ["audio"] * (2 * audio_t)
    pos.append(native_video(latent_t, frame, float(text_len)))
    kinds += ["video"] * (latent_t * frame.shape[0])
    return torch.cat(pos), kinds


def native_frame_count(latent_t):
    return sum((1, 4, 4, 4, 4)[k % 5] for k in range(latent_t))


def native_resolve(frame_idx, frame_count, guide):
    resolved = frame_idx if frame_idx >= 0 else frame_count + frame_idx
    return None if resolved < 0 or resolved + guide > frame_count else resolved


def native_guide_frames(n):
    if n < 5:
        return 1
    while n % 17 != 5:
        n -= 1
    return n


# ---- the tests ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "keyframes",
    [
        [(0, 1, 0)],
        [(0, 1, 0), (344, 1, 0)],
        [(100, 1, 30), (323, 7, 0)],  # an image with its soundtrack, a 22-frame clip ending on the last frame
        [(57, 0, 12), (5, 1, 3), (5, 1, 0)],  # audio alone, two keyframes at one frame
    ],
)
def test_positions_and_rows_match_native_placement(keyframes):
    text_len, latent_t, h, w, audio_t = 9, 102, 6, 10, 575
    slots = tuple(KeyframeSlot(i, vt, rt) for i, vt, rt in keyframes)
    tags = torch.ones(text_len, dtype=torch.long)
    packed = pack_sequence(tags, latent_t, h, w, audio_t, keyframes=slots)
    expected, kinds = native_layout(text_len, latent_t, h, w, audio_t, keyframes)
    assert packed.positions.shape == expected.shape
    torch.testing.assert_close(packed.positions, expected, rtol=0, atol=1e-9)
    video_rows = [i for i, k in enumerate(kinds) if k in ("cond", "video")]
    audio_rows = [i for i, k in enumerate(kinds) if k in ("cond_audio", "audio")]
    assert packed.video_index.tolist() == video_rows and packed.audio_index.tolist() == audio_rows
    assert packed.condition_rows == kinds.count("cond")
    assert packed.condition_audio_rows == kinds.count("cond_audio")
    native_tag = {"text": 1, "cond": 0, "video": 0, "cond_audio": 2, "audio": 2}
    assert packed.tags.tolist() == [native_tag[k] for k in kinds]
    # the window softmax treats every keyframe row, video or audio, as global
    spans = {s.name: (s.start, s.start + s.length) for s in packed.layout.global_spans}
    assert spans["conditioning"] == (text_len, text_len + kinds.count("cond") + kinds.count("cond_audio"))


def test_row_timesteps_follow_native_segments():
    """Native: cond rows at max(t_v, 0.999), cond_audio rows at max(t_a, 1.0), targets at their stream's t."""
    packed = pack_sequence(
        torch.ones(4, dtype=torch.long), 7, 2, 4, 37, keyframes=(KeyframeSlot(3, 1, 5), KeyframeSlot(0, 1, 0))
    )
    t_v, t_a = 0.3, 0.6
    values, index = row_timesteps(packed, t_v, t_a, condition_audio_rows=packed.condition_audio_rows)
    per_row = values[index]
    _, kinds = native_layout(4, 7, 2, 4, 37, [(3, 1, 5), (0, 1, 0)])
    want = {"text": t_v, "video": t_v, "audio": t_a, "cond": max(t_v, 0.999), "cond_audio": max(t_a, 1.0)}
    assert per_row.tolist() == pytest.approx([want[k] for k in kinds])


def test_first_and_last_anchors_are_native_frames_0_and_last():
    """The released anchors are the native frame indices 0 and frames - 1 (within rounding of the sum)."""
    tags = torch.ones(5, dtype=torch.long)
    released = pack_sequence(tags, 102, 4, 6, 575, keyframes=("first", "last"))
    native = pack_sequence(tags, 102, 4, 6, 575, keyframes=(KeyframeSlot(0), KeyframeSlot(344)))
    torch.testing.assert_close(released.positions, native.positions, rtol=0, atol=1e-9)


@pytest.mark.parametrize("count", [1, 2, 4, 5, 6, 21, 22, 23, 38, 39, 40, 100])
def test_guide_frames_as_native(count):
    assert guide_frames(count) == native_guide_frames(count)


@pytest.mark.parametrize("latent_t", [1, 2, 7, 12, 102])
def test_latent_span_as_native(latent_t):
    assert latent_span(latent_t) == native_frame_count(latent_t)


@pytest.mark.parametrize(
    "frame_idx, guide", [(0, 1), (344, 1), (-1, 1), (-345, 1), (345, 1), (-346, 1), (323, 22), (324, 22), (-22, 22)]
)
def test_resolve_frame_index_as_native(frame_idx, guide):
    want = native_resolve(frame_idx, 345, guide)
    if want is None:
        with pytest.raises(H3InputError, match=r"frame_idx: .* allowed: 0 to \d+ .* nearest: \d+"):
            resolve_frame_index(frame_idx, 345, guide)
    else:
        assert resolve_frame_index(frame_idx, 345, guide) == want


def test_refused_index_names_the_nearest_valid_ones():
    with pytest.raises(H3InputError) as caught:
        resolve_frame_index(400, 345, 22)
    assert "400" in str(caught.value) and "nearest: 323 (or -22)" in str(caught.value)
    with pytest.raises(H3InputError, match=r"nearest: 0 \(or -345\)"):
        resolve_frame_index(-400, 345)


@pytest.mark.parametrize("index", [0, 1, 100, 344])
def test_guide_audio_room_as_native(index):
    audio_t = 575
    assert guide_audio_latents(index, audio_t) == math.floor(audio_t - 5.0 / 3.0 * index)


# ---- through generate -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dit():
    return tiny_dit()


def test_a_keyframe_at_frame_0_is_the_released_first_keyframe(dit):
    latent = torch.randn(24, 1, 2, 4, generator=torch.Generator().manual_seed(5))
    common = dict(frames=22, width=64, height=32, steps=2, seed=4)
    released = generate(dit, prompt(), ClipRequest(keyframes=(("first", latent),), **common))
    anywhere = generate(dit, prompt(), ClipRequest(keyframes=(Keyframe(0, video=latent),), **common))
    assert torch.equal(released[0], anywhere[0]) and torch.equal(released[1], anywhere[1])


def test_keyframes_anywhere_with_audio_change_the_clip(dit):
    gen = torch.Generator().manual_seed(6)
    still, clip = torch.randn(24, 1, 2, 4, generator=gen), torch.randn(24, 2, 2, 4, generator=gen)
    sound = torch.randn(2, 32, 9, generator=gen)
    common = dict(frames=22, width=64, height=32, steps=2, seed=4)
    plain = generate(dit, prompt(), ClipRequest(**common))
    guided = generate(
        dit,
        prompt(),
        ClipRequest(keyframes=(Keyframe(9, video=still, audio=sound), Keyframe(17, video=clip)), **common),
    )
    moved = generate(
        dit,
        prompt(),
        ClipRequest(keyframes=(Keyframe(10, video=still, audio=sound), Keyframe(17, video=clip)), **common),
    )
    assert guided[0].shape == plain[0].shape == (24, 7, 2, 4) and guided[1].shape == (2, 32, 37)
    assert torch.isfinite(guided[0]).all() and torch.isfinite(guided[1]).all()
    assert not torch.equal(guided[0], plain[0]) and not torch.equal(guided[0], moved[0])


@pytest.mark.parametrize(
    "keyframe, message",
    [
        (Keyframe(0), r"keyframe 0: needs a video latent, an audio latent or both"),
        (Keyframe(3, video=torch.zeros(24, 1, 4, 4)), r"keyframe 0: the video latent must be \[24, t, 2, 4\]"),
        (Keyframe(3, video=torch.zeros(24, 3, 2, 4)), r"has 3 frames; allowed: 1 \(an image\) or 5k \+ 2"),
        (Keyframe(22, video=torch.zeros(24, 1, 2, 4)), r"frame_index: 22 does not place a still keyframe .*21"),
        (Keyframe(18, video=torch.zeros(24, 2, 2, 4)), r"a 5-frame keyframe clip .* nearest: 17 \(or -5\)"),
        (Keyframe(3, audio=torch.zeros(2, 32, 40)), r"its audio has 40 latents but only 32 fit after frame 3"),
        (Keyframe(3, audio=torch.zeros(1, 32, 4)), r"the audio latent must be \[2, 32, Ta\]"),
    ],
)
def test_bad_keyframes_are_named(dit, keyframe, message):
    with pytest.raises(H3InputError, match=message):
        generate(dit, prompt(), ClipRequest(keyframes=(keyframe,), frames=22, width=64, height=32, steps=1, seed=0))
