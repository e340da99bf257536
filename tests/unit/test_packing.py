"""Packed layout, positions and tags (h3_core.pipeline.packing) against diffusers 0.42.1's modular pipeline
and hand-computed cases."""

import pytest
import torch

from h3_core.errors import H3InputError
from h3_core.pipeline.packing import pack_sequence, patchify, unpatchify

diffusers = pytest.importorskip("diffusers")
from diffusers.modular_pipelines.minimax_h3 import before_denoise


def reference(text_tags, frames, h, w, audio, keyframes):
    return before_denoise.MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        text_tags, frames, h, w, audio, (1, 2, 2), 2, 2, 0, keyframe_anchors=keyframes
    )


@pytest.mark.parametrize(
    "keyframes", [(), ("first",), ("last",), ("first", "last")], ids=["t2va", "i2va", "l2va", "fl2va"]
)
@pytest.mark.parametrize("frames, h, w, audio", [(7, 4, 6, 23), (22, 48, 84, 115), (102, 6, 10, 575), (2, 2, 2, 1)])
def test_matches_the_released_packing(keyframes, frames, h, w, audio):
    text_tags = torch.ones(37, dtype=torch.long)
    text_tags[5:12] = 0  # a keyframe's vision block inside the text
    ours = pack_sequence(text_tags, frames, h, w, audio, keyframes=keyframes)
    positions, tags, video_index, audio_index, text_index, condition_rows, _ = reference(
        text_tags, frames, h, w, audio, keyframes
    )
    assert torch.equal(ours.positions, positions)
    assert torch.equal(ours.tags, tags)
    assert torch.equal(ours.video_index, video_index)
    assert torch.equal(ours.audio_index, audio_index)
    assert torch.equal(ours.text_index, text_index)
    assert ours.condition_rows == condition_rows


def test_hand_computed_t2va():
    packed = pack_sequence(torch.ones(3, dtype=torch.long), frames=6, height=2, width=2, audio_latents=2)
    # [text 3 | audio 2 × 2 | video 6 frames × 1 row]
    assert packed.tags.tolist() == [1, 1, 1, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0]
    assert packed.positions[:3, 0].tolist() == [0.0, 1.0, 2.0]
    # a square canvas of one patch: its only coordinate is the left end of [0, 32) split into 1
    assert packed.positions[3:7, 0].tolist() == [3.0, 4.0, 3.0, 4.0]
    assert packed.positions[3:7, 2].tolist() == [0.0, 0.0, 0.0, 0.0]
    times = packed.positions[7:, 0]
    expected = [3.0, 3 + 5 / 3, 3 + 5 / 3 * 5, 3 + 5 / 3 * 9, 3 + 5 / 3 * 13, 3 + 5 / 3 * 17]
    assert torch.allclose(times, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)
    layout = packed.layout
    assert (layout.video_start, layout.num_frames, layout.tokens_per_frame) == (7, 6, 1)


def test_patchify_round_trip_and_order():
    latents = torch.arange(24 * 2 * 4 * 6, dtype=torch.float32).reshape(24, 2, 4, 6)
    rows = patchify(latents)
    assert rows.shape == (2 * 2 * 3, 96)
    # row 0 = frame 0, patch (0, 0): channel 0's 2×2 block first
    assert rows[0, :4].tolist() == [latents[0, 0, 0, 0], latents[0, 0, 0, 1], latents[0, 0, 1, 0], latents[0, 0, 1, 1]]
    assert torch.equal(unpatchify(rows, 24, 2, 4, 6), latents)
    ref = before_denoise.patchify_video_latents(latents[None], (1, 2, 2))
    assert torch.equal(rows, ref)


def test_bad_geometry():
    with pytest.raises(H3InputError, match="latent size 3x4 must be a multiple of the patch 2x2"):
        pack_sequence(torch.ones(2, dtype=torch.long), 7, 3, 4, 5)
    with pytest.raises(H3InputError, match="keyframe anchor must be 'first' or 'last', got 'middle'"):
        pack_sequence(torch.ones(2, dtype=torch.long), 7, 4, 4, 5, keyframes=("middle",))


from types import SimpleNamespace

from h3_core.pipeline.packing import Reference, pack_ref2va

REF_CASES = {
    "images": [Reference("image", 1, 6, 4), Reference("image", 1, 4, 8)],
    "video+soundtrack, audio": [Reference("video", 7, 4, 6, audio_latents=23), Reference("audio", audio_latents=11)],
    "silent video of 17 latents": [Reference("video", 17, 2, 4)],
    "mixed": [
        Reference("audio", audio_latents=40),
        Reference("image", 1, 8, 4),
        Reference("video", 12, 4, 4, audio_latents=5),
    ],
}


@pytest.mark.parametrize("refs", REF_CASES.values(), ids=REF_CASES.keys())
def test_ref2va_matches_the_released_packing(refs):
    text_tags = torch.ones(21, dtype=torch.long)
    text_tags[3:9] = 0
    ours = pack_ref2va(text_tags, refs, 7, 4, 6, 23)
    visual = [torch.empty(1, 24, r.frames, r.height, r.width) for r in refs if r.kind in ("image", "video")]
    sound = [torch.empty(r.audio_latents * 2, 32) for r in refs if r.audio_latents]
    kinds = [SimpleNamespace(kind=r.kind, has_audio=r.audio_latents > 0) for r in refs]
    positions, tags, video_index, audio_index, text_index, ref_video, ref_audio = (
        before_denoise.MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
            text_tags, kinds, visual, sound, 7, 4, 6, 23, (1, 2, 2), 2, 2, 0
        )
    )
    assert torch.equal(ours.positions, positions)
    assert torch.equal(ours.tags, tags)
    assert torch.equal(ours.video_index, video_index) and torch.equal(ours.audio_index, audio_index)
    assert ours.condition_rows == ref_video
    assert ours.layout.video_start == int(video_index[-1]) + 1 - 7 * 6


def test_ref2va_refuses_unknown_kinds():
    with pytest.raises(H3InputError, match="a reference must be 'image', 'video' or 'audio', got 'text'"):
        pack_ref2va(torch.ones(2, dtype=torch.long), [Reference("text")], 7, 4, 4, 5)
