"""Keyframes anywhere through a real ComfyUI server: H3 Add Keyframe chains (a still with its sound, a clip)
feeding the sampler's FL2VA mode, the mp4 read back; a frame the clip cannot hold is a node error naming the
nearest valid frames, and what the graph alone shows wrong is refused when queued."""

import json
import re

import av
import numpy as np
from comfy_host import error_message, mp4_files
from graphs import generation, with_keyframes
from test_host_runs import check_mp4


def video_frames(path):
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def run_keyframes(server, keyframes, prefix):
    """The run's frames from the mp4, and the sampler's progress texts."""
    prompt = (
        with_keyframes(generation(prefix=prefix, length=56), keyframes)
        if keyframes
        else generation(prefix=prefix, length=56)
    )
    events = list(server.events(prompt))
    assert events[-1][0] == "execution_success", events[-1]
    texts = [text for kind, (node, text) in (e for e in events if e[0] == "text") if node == "7"]
    (path,) = sorted(server.output.glob(prefix + "*.mp4"))
    check_mp4(path, 56, 64, 32)
    return video_frames(path), "\n".join(texts)


def test_keyframes_anywhere_with_sound_and_a_clip(server):
    chain = [dict(frame_idx=20, image="first.png", audio="tone.wav"), dict(frame_idx=-5, video="clip.mp4")]
    guided, told = run_keyframes(server, chain, "H3/keyframes")
    # tone.wav lasts 2.5 s (100 latents): cut to floor(93 - 5/3 · 20) = 59, the audio the clip has after frame 20;
    # the 17-frame clip is cut to 5 frames (2 latent frames), which end on the last frame
    assert "keyframe 1: an image and 59 audio latents at frame 20" in told, told
    assert "keyframe 2: a clip of 2 latent frames at frame 51" in told, told
    again, _ = run_keyframes(server, chain, "H3/keyframes_again")
    _, told_moved = run_keyframes(server, [dict(chain[0], frame_idx=-11), chain[1]], "H3/keyframes_moved")
    plain, _ = run_keyframes(server, [], "H3/keyframes_none")
    assert np.array_equal(guided, again)
    assert "keyframe 1: an image and 18 audio latents at frame 45" in told_moved, told_moved
    assert not np.array_equal(guided, plain), "the keyframes did not reach the model"


def test_a_frame_the_clip_cannot_hold_names_the_nearest(server):
    prompt = with_keyframes(generation(prefix="H3/keyframe_bad", length=56), [dict(frame_idx=60, image="last.png")])
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "error"
    message = error_message(entry)
    assert re.search(
        r"keyframe 1 of 1: frame_idx: 60 does not place a still keyframe .* nearest: 55 \(or -1\)", message
    )
    assert not mp4_files(entry, server.output)
    # a 17-frame clip is cut to 5 frames, which cannot start at frame 52 of 56
    prompt = with_keyframes(generation(prefix="H3/keyframe_bad", length=56), [dict(frame_idx=52, video="clip.mp4")])
    message = error_message(server.run(prompt))
    assert "a 5-frame keyframe clip" in message and "nearest: 51 (or -5)" in message, message
    entry = server.run(generation(prefix="H3/after_keyframes", length=22))
    assert entry["status"]["status_str"] == "success", error_message(entry)


def test_what_the_graph_shows_wrong_is_refused_when_queued(server):
    prompt = with_keyframes(generation(prefix="H3/keyframe_refused"), [dict(frame_idx=0, image="first.png")])
    del prompt["43"]["inputs"]["images"]
    answer = server.queue(prompt)
    assert "prompt_id" not in answer and "connect images, audio or both" in json.dumps(answer), answer
    prompt = with_keyframes(generation(prefix="H3/keyframe_refused"), [dict(frame_idx=0, image="first.png")])
    prompt["7"]["inputs"]["mode"] = "T2VA"
    answer = server.queue(prompt)
    assert "prompt_id" not in answer, answer
    assert "mode T2VA: takes no keyframes, but keyframes is connected" in json.dumps(answer), answer
