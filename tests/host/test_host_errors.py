"""Bad input through a real ComfyUI server: each gives a node error whose message names the input and what
is allowed, and the server goes on to run the next prompt."""

import json
import re

import pytest
from safetensors.torch import save_file
import torch

from comfy_host import error_message, mp4_files
from graphs import TINY_AUDIO_VAE, generation, with_references


@pytest.fixture(scope="module")
def broken_files(server):
    """A DiT file with the wrong tensors and a text file posing as a checkpoint, in the host's folders."""
    save_file({"blocks.0.attn.qkv_proj.weight": torch.zeros(3, 3)}, str(server.models / "diffusion_models" / "broken.safetensors"))
    (server.models / "vae" / "notes.safetensors").write_bytes(b"\x00\x01 not a checkpoint")
    # the host caches folder listings; a new file shows after its folder's mtime changes, which writing did
    return server


def expect_node_error(server, prompt, pattern):
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "error"
    message = error_message(entry)
    assert re.search(pattern, message), message
    assert not mp4_files(entry, server.output)


@pytest.mark.parametrize("change, pattern", [
    (dict(dit="broken.safetensors"), r"dit_name|base: .*broken\.safetensors: not a MiniMax H3 DiT checkpoint"),
    (dict(video_vae=TINY_AUDIO_VAE), r"h3_tiny_random_audio_vae\.safetensors: not a MiniMax H3 video VAE checkpoint"),
    (dict(video_vae="notes.safetensors"), r"notes\.safetensors: .*safetensors"),
    (dict(length=60), r"length must be 17k \+ 5 frames .* got 60; nearest: 56 or 73"),
    (dict(mode="FL2VA"), r"mode FL2VA needs a first_frame, a last_frame or both"),
    (dict(first="first.png"), r"mode T2VA takes no keyframes, but first_frame is connected"),
], ids=["wrong-dit-file", "audio-vae-as-video-vae", "not-a-checkpoint", "length-off-grid", "fl2va-without-images",
        "t2va-with-an-image"])
def test_bad_input_is_a_clear_node_error_and_the_next_prompt_runs(broken_files, change, pattern):
    server = broken_files
    expect_node_error(server, generation(prefix="H3/bad", **change), pattern)
    entry = server.run(generation(prefix="H3/after", length=22))
    assert entry["status"]["status_str"] == "success", error_message(entry)
    assert len(mp4_files(entry, server.output)) == 1


def test_a_file_not_in_the_folder_is_refused_before_running(server):
    answer = server.queue(generation(dit="no_such_model.safetensors"))
    assert "prompt_id" not in answer
    errors = json.dumps(answer["node_errors"])
    assert "dit_name" in errors and "no_such_model.safetensors" in errors


def _without_encoder_references(prompt):
    del prompt["5"]["inputs"]["references"]
    return prompt


@pytest.mark.parametrize("build, pattern", [
    (lambda: with_references(generation("T2VA", prefix="H3/bad"), image="first.png"),
     r"mode T2VA takes no references, but references are connected"),
    (lambda: generation("Ref2VA", prefix="H3/bad"), r"mode Ref2VA needs references"),
    (lambda: _without_encoder_references(with_references(generation("Ref2VA", prefix="H3/bad"), image="first.png")),
     r"the conditioning was encoded with references none, but the sampler has \('image',\) at length 56"),
], ids=["t2va-with-references", "ref2va-without-references", "references-not-encoded"])
def test_bad_ref2va_requests_are_clear_node_errors(server, build, pattern):
    expect_node_error(server, build(), pattern)
