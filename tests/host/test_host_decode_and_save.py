"""H3 Decode & Save in a real ComfyUI server: the latents of a run written as one mp4 whose video and audio equal,
frame for frame and sample for sample, what H3 Video Decode + H3 Audio Decode + H3 Save Video write from the same
latents, with the workflow in its metadata and its frames passed on, telling when the soundtrack and the VAE's load
are done; a cancel while it decodes leaves no file and
the next prompt runs; an encoder named outright that does not open on this machine is refused when queued."""

import json
import os

import av
import numpy as np
import pytest
from comfy_host import error_message, mp4_files
from graphs import generation, with_decode_and_save
from test_host_interruptions import next_prompt_runs, nothing_written
from test_host_runs import check_mp4


def contents(path):
    with av.open(str(path)) as container:
        video = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
        container.seek(0)
        audio = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)
        tags = dict(container.metadata)
    return video, audio, tags


def test_decode_and_save_writes_what_decode_then_save_write(server):
    separate = generation(length=56, width=64, height=32, seed=9, prefix="H3/separate")
    combined = with_decode_and_save(separate, "H3/combined")
    combined["20"] = {"class_type": "PreviewImage", "inputs": {"images": ["8", 0]}}  # the frames passed on
    entries = [server.run(separate)]
    events = list(server.events(combined, timeout=300))
    entries.append(server.wait(events[0][1]["prompt_id"]))
    # the node says when the soundtrack is done and when the video VAE is loaded, before its tiles
    told = [text for kind, (node, text) in (e for e in events if e[0] == "text") if node == "8"]
    device = "cuda:0" if os.environ.get("H3_COMFY_GPU") == "1" else "cpu"
    assert told == ["soundtrack decoded", f"video VAE ready on {device}"], told
    for entry in entries:
        assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    (reference,), (streamed,) = (mp4_files(entry, server.output) for entry in entries)
    check_mp4(streamed, 56, 64, 32)
    (video, audio, _), (video_2, audio_2, tags) = contents(reference), contents(streamed)
    assert np.array_equal(video, video_2) and np.array_equal(audio, audio_2)
    assert json.loads(tags["prompt"])["8"]["class_type"] == "H3DecodeAndSave"
    assert len(entries[1]["outputs"]["20"]["images"]) == 56
    assert "the mp4 was complete" in server.log_tail(100)


def test_a_cancel_during_decode_and_save_leaves_no_file(server):
    prompt = with_decode_and_save(generation(width=320, steps=2, prefix="H3/unused"), "H3/cancel_decode_and_save")
    prompt["8"]["inputs"]["tiles_per_batch"] = 1
    interrupted = False
    for kind, data in server.events(prompt, timeout=300):
        if kind == "queued":
            prompt_id = data["prompt_id"]
        elif kind == "progress" and data.get("node") == "8" and data["value"] >= 3 and not interrupted:
            interrupted = True  # a window's frames are with the encoder by now
            server.interrupt()
    assert kind == "execution_interrupted", kind
    assert not server.wait(prompt_id).get("outputs") and nothing_written(server, "cancel_decode_and_save")
    next_prompt_runs(server, "H3/after_cancel_decode_and_save")


def test_an_encoder_that_does_not_open_here_is_refused_when_queued(server):
    from test_host_errors import refused_at_validation

    from h3_core.media import mp4

    if mp4._fails_to_open("h264_nvenc", 256, 256, 24) is None:
        pytest.skip("NVENC opens on this machine")
    prompt = with_decode_and_save(generation(prefix="H3/unused"), "H3/nvenc")
    prompt["8"]["inputs"]["encoder"] = "h264_nvenc"
    refused_at_validation(server, prompt, r"encoder: h264_nvenc does not open on this machine .*pick auto or libx264")
