"""ComfyUI's native H3 latent and keyframe forms (h3_core.pipeline.native_latent) against the native conventions
re-derived here from Comfy-Org/ComfyUI 542de101 (comfy_extras/nodes_minimax_h3.py: ``_empty_av_latent``,
``video_latent_t``; comfy/ldm/minimax/model.py at 2c64d4aa: ``pack_audio``)."""

import pytest
import torch
from test_keyframes import native_audio, native_frame, native_video

from h3_core.errors import H3InputError
from h3_core.pipeline.keyframes import Keyframe
from h3_core.pipeline.native_latent import from_native, keyframe_from_native, reference_from_native, to_native
from h3_core.pipeline.packing import soundtrack_rows


def native_pack_audio(latent):  # [B, C=32, ch=2, T] -> [ch·T, 32], channel-major
    b, c, ch, t = latent.shape
    return latent[0].permute(1, 2, 0).reshape(ch * t, c)


def native_video_latent_t(frame_count):
    return 2 if frame_count <= 5 else ((frame_count - 5) // 17) * 5 + 2


@pytest.mark.parametrize("frames", [5, 22, 124, 345])
def test_round_trip_and_the_native_layout(frames):
    T = native_video_latent_t(frames)
    gen = torch.Generator().manual_seed(frames)
    video, audio = torch.randn(24, T, 2, 4, generator=gen), torch.randn(2, 32, 11, generator=gen)
    native_video, native_audio = to_native(video, audio)
    assert native_video.shape == (1, 24, T, 2, 4) and native_audio.shape == (1, 32, 2, 11)
    # the same rows reach the model: native packs its audio channel-major, as the pack does
    assert torch.equal(native_pack_audio(native_audio), soundtrack_rows(audio))
    back_video, back_audio, back_frames = from_native(native_video, native_audio)
    assert torch.equal(back_video, video) and torch.equal(back_audio, audio) and back_frames == frames


@pytest.mark.parametrize(
    "video, audio, message",
    [
        (torch.zeros(1, 16, 7, 2, 4), torch.zeros(1, 32, 2, 5), r"video latent must be \[1, 24, T, h, w\]"),
        (torch.zeros(1, 24, 7, 2, 4), torch.zeros(1, 2, 32, 5), r"audio latent must be \[1, 32, 2, Ta\]"),
        (torch.zeros(2, 24, 7, 2, 4), torch.zeros(2, 32, 2, 5), r"one clip at a time, got a batch of 2"),
        (torch.zeros(1, 24, 6, 2, 4), torch.zeros(1, 32, 2, 5), r"6 latent frames is not a clip's 5k \+ 2"),
    ],
)
def test_what_is_not_an_h3_latent_is_named(video, audio, message):
    with pytest.raises(H3InputError, match=message):
        from_native(video, audio)


def test_a_native_keyframe_becomes_a_keyframe():
    gen = torch.Generator().manual_seed(1)
    latent, sound = torch.randn(1, 24, 2, 2, 4, generator=gen), torch.randn(1, 32, 2, 9, generator=gen)
    keyframe = keyframe_from_native({"resolved_frame_index": 17, "latent": latent, "audio_latent": sound})
    assert isinstance(keyframe, Keyframe) and keyframe.frame_index == 17
    assert torch.equal(keyframe.video, latent[0]) and torch.equal(
        soundtrack_rows(keyframe.audio), native_pack_audio(sound)
    )
    audio_only = keyframe_from_native({"resolved_frame_index": 3, "audio_latent": sound})
    assert audio_only.video is None and audio_only.audio.shape == (2, 32, 9)
    with pytest.raises(H3InputError, match="native keyframe 2: not a native H3 keyframe"):
        keyframe_from_native({"latent": latent}, 2)
    with pytest.raises(H3InputError, match=r"its audio_latent must be \[1, 32, 2, Ta\]"):
        keyframe_from_native({"resolved_frame_index": 0, "audio_latent": torch.zeros(1, 2, 32, 9)})


def native_ref2va_layout(text_len, latent_t, h, w, audio_t, refs):
    """Native PackedLayout's positions for refs (kind, latent_t, latent_h, latent_w, ref_audio_t), written from
    comfy/ldm/minimax/model.py at 2c64d4aa: refs in order from the text length, then the target audio and video
    after the refs' spans."""
    frame, w_grid = native_frame(h, w)
    g = torch.zeros(text_len, 3, dtype=torch.float64)
    g[:, 0] = torch.arange(text_len, dtype=torch.float64)
    pos, cursor = [g], float(text_len)
    for kind, vt, rh, rw, rt in refs:
        r_frame, r_w = native_frame(rh, rw) if kind != "audio" else (None, None)
        if kind == "image":
            gi = torch.empty(r_frame.shape[0], 3, dtype=torch.float64)
            gi[:, 0], gi[:, 1:] = cursor, r_frame
            pos.append(gi)
            cursor += 1.0
        elif kind == "audio":
            pos.append(native_audio(cursor, rt, float(w_grid[0]), float(w_grid[-1])))
            cursor += float(rt)
        else:
            if rt:
                pos.append(native_audio(cursor, rt, float(r_w[0]), float(r_w[-1])))
            pos.append(native_video(vt, r_frame, cursor))
            cursor += max(float(rt), sum(5.0 / 3.0 * (1, 4, 4, 4, 4)[k % 5] for k in range(vt)))
    pos.append(native_audio(cursor, audio_t, float(w_grid[0]), float(w_grid[-1])))
    pos.append(native_video(latent_t, frame, cursor))
    return torch.cat(pos)


def test_native_references_pack_where_native_packs_them():
    from h3_core.pipeline.packing import pack_ref2va

    gen = torch.Generator().manual_seed(2)
    blocks = [
        {"kind": "image", "latent": torch.randn(1, 24, 1, 4, 2, generator=gen), "latent_h": 4, "latent_w": 2},
        {
            "kind": "video_audio",
            "latent": torch.randn(1, 24, 7, 2, 6, generator=gen),
            "audio_latent": torch.randn(1, 32, 2, 40, generator=gen),
        },
        {"kind": "audio", "audio_latent": torch.randn(1, 32, 2, 9, generator=gen)},
    ]
    refs = [reference_from_native(block, i) for i, block in enumerate(blocks, 1)]
    assert [r.kind for r in refs] == ["image", "video", "audio"] and refs[1].audio.shape == (2, 32, 40)
    packed = pack_ref2va(torch.ones(5, dtype=torch.long), [r.geometry(i) for i, r in enumerate(refs)], 7, 4, 6, 37)
    native = native_ref2va_layout(
        5, 7, 4, 6, 37, [("image", 1, 4, 2, 0), ("video", 7, 2, 6, 40), ("audio", 0, 0, 0, 9)]
    )
    torch.testing.assert_close(packed.positions, native, rtol=0, atol=1e-9)
    with pytest.raises(H3InputError, match="kind must be one of"):
        reference_from_native({"kind": "sound"})
