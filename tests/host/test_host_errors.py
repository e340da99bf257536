"""Bad input through a real ComfyUI server. What needs no model — the files' kinds from their headers, the
canvas and length grids, the mode against what is connected — is refused when the prompt is queued, before any
loader runs, with a message naming the input, what was given and what is allowed; what only a run can tell is a
node error. Either way the server goes on to run the next prompt."""

import json
import pickle
import re

import pytest
import torch
from comfy_host import error_message, mp4_files
from graphs import TINY_AUDIO_VAE, TINY_BRANCH, TINY_DIT, generation, with_references
from safetensors.torch import save_file


@pytest.fixture(scope="module")
def bad_files(server):
    """Files a user may pick by mistake, in the host's folders: a DiT-named file of the wrong tensors, text posing
    as a checkpoint, a truncated DiT, a DiT whose header length lies, an audio VAE among the DiTs and a DiT
    among the VAEs, a pickle renamed .safetensors."""
    dit_folder, vae_folder = server.models / "diffusion_models", server.models / "vae"
    save_file({"blocks.0.attn.qkv_proj.weight": torch.zeros(3, 3)}, str(dit_folder / "broken.safetensors"))
    (vae_folder / "notes.safetensors").write_bytes(b"\x00\x01 not a checkpoint")
    whole = (dit_folder / TINY_DIT).read_bytes()
    (dit_folder / "truncated.safetensors").write_bytes(whole[: len(whole) // 2])
    lying = bytearray(whole)
    lying[:8] = (len(whole) * 4).to_bytes(8, "little")
    (dit_folder / "lying_header.safetensors").write_bytes(bytes(lying))
    (dit_folder / "picked_audio_vae.safetensors").write_bytes((vae_folder / TINY_AUDIO_VAE).read_bytes())
    (vae_folder / "picked_dit.safetensors").write_bytes((dit_folder / TINY_DIT).read_bytes())
    with open(dit_folder / "pickled.safetensors", "wb") as out:
        pickle.dump({"blocks.0.attn.qkv_proj.weight": [0.0] * 4}, out)
    return server


def refused_at_validation(server, prompt, pattern):
    """The prompt is refused when queued (nothing runs), with a message matching ``pattern``; the next runs."""
    loads = server.log_path.read_text().count("into host memory")
    answer = server.queue(prompt)
    assert "prompt_id" not in answer, answer
    errors = json.dumps(answer.get("node_errors", {}))
    assert re.search(pattern, errors), errors
    assert server.log_path.read_text().count("into host memory") == loads, "a loader ran for a refused prompt"


def expect_node_error(server, prompt, pattern):
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "error"
    message = error_message(entry)
    assert re.search(pattern, message), message
    assert not mp4_files(entry, server.output)


def next_prompt_runs(server):
    entry = server.run(generation(prefix="H3/after", length=22))
    assert entry["status"]["status_str"] == "success", error_message(entry)
    assert len(mp4_files(entry, server.output)) == 1


@pytest.mark.parametrize(
    "change, pattern",
    [
        (dict(dit="broken.safetensors"), r"dit_name: 'broken\.safetensors' cannot be loaded as an H3 DiT checkpoint"),
        (
            dict(dit="truncated.safetensors"),
            r"dit_name: 'truncated\.safetensors' cannot be loaded .*(truncated|header)",
        ),
        (dict(dit="lying_header.safetensors"), r"dit_name: 'lying_header\.safetensors' cannot be loaded .*safetensors"),
        (
            dict(dit="pickled.safetensors"),
            r"dit_name: 'pickled\.safetensors' cannot be loaded .*not a safetensors file",
        ),
        (
            dict(dit="picked_audio_vae.safetensors"),
            r"dit_name: 'picked_audio_vae\.safetensors' is the H3 audio VAE, not an "
            r"H3 DiT checkpoint; pick it in H3 Audio VAE Loader",
        ),
        (
            dict(video_vae=TINY_AUDIO_VAE),
            r"vae_name: 'h3_tiny_random_audio_vae\.safetensors' is the H3 audio VAE, not the "
            r"H3 video VAE; pick it in H3 Audio VAE Loader",
        ),
        (dict(video_vae="picked_dit.safetensors"), r"vae_name: 'picked_dit\.safetensors' is an H3 DiT checkpoint"),
        (dict(video_vae="notes.safetensors"), r"vae_name: 'notes\.safetensors' cannot be loaded .*safetensors"),
        (
            dict(dit="no_such_model.safetensors"),
            r"dit_name: 'no_such_model\.safetensors' is not a file in the "
            r"diffusion_models folder",
        ),
        (dict(length=60), r"length must be 17k \+ 5 frames .* got 60; nearest: 56 or 73"),
        (dict(width=100), r"width must be a multiple of 16 px .* got 100; nearest: 96"),
        (dict(mode="FL2VA"), r"mode FL2VA: needs a first_frame, a last_frame or both"),
        (dict(first="first.png"), r"mode T2VA: takes no keyframes, but first_frame is connected"),
    ],
    ids=[
        "wrong-tensors",
        "truncated",
        "lying-header-length",
        "pickle-renamed",
        "audio-vae-as-dit",
        "audio-vae-as-video-vae",
        "dit-as-video-vae",
        "not-a-checkpoint",
        "file-not-in-folder",
        "length-off-grid",
        "width-off-grid",
        "fl2va-without-images",
        "t2va-with-an-image",
    ],
)
def test_what_needs_no_model_is_refused_before_anything_loads(bad_files, change, pattern):
    refused_at_validation(bad_files, generation(prefix="H3/bad", **change), pattern)


def test_a_missing_file_is_said_once_per_file_the_loader_checks(bad_files):
    """The host lists a node's refusal under every input its check takes: the DiT loader's under its two files
    (the model and the branch) and its device, a VAE loader's under its file and device; not under the lists checked
    when the node runs (five and three times before)."""
    answer = bad_files.queue(generation(prefix="H3/missing", dit="no_such_model.safetensors"))
    loader = next(e["errors"] for e in answer["node_errors"].values() if e["class_type"] == "H3DiTLoader")
    said = [error for error in loader if "no_such_model.safetensors" in json.dumps(error)]
    listed = {error["extra_info"]["input_name"] for error in said}
    assert len(said) == len(listed) and "dit_name" in listed <= {"device", "dit_name", "linear_branch"}, loader
    answer = bad_files.queue(generation(prefix="H3/missing", video_vae="no_such_vae.safetensors"))
    loader = next(e["errors"] for e in answer["node_errors"].values() if e["class_type"] == "H3VideoVAELoader")
    listed = {error["extra_info"]["input_name"] for error in loader}
    assert len(loader) == len(listed) and "vae_name" in listed <= {"device", "vae_name"}, loader


@pytest.mark.parametrize(
    "file, mode, branch, pattern",
    [
        (
            "minimax_h3_ref2va_tiny.safetensors",
            "T2VA",
            "none",
            r"dit_name: minimax_h3_ref2va_tiny\.safetensors is H3's Ref2VA checkpoint, but mode T2VA of plain H3 runs "
            r"on H3's FL2VA checkpoint \(minimax_h3_fl2va_\*\); load that checkpoint in H3 DiT Loader, or choose mode "
            r"Ref2VA",
        ),
        (
            "minimax_h3_ref2va_tiny.safetensors",
            "T2VA",
            TINY_BRANCH,
            r"is H3's Ref2VA checkpoint, but VDN-H3's linear branch was trained on H3's FL2VA transformer",
        ),
        (
            "minimax_h3_fl2va_tiny.safetensors",
            "Ref2VA",
            "none",
            r"is H3's FL2VA checkpoint, but mode Ref2VA of plain H3 runs on H3's Ref2VA checkpoint",
        ),
    ],
    ids=["t2va-on-ref2va", "vdn-on-ref2va", "ref2va-on-fl2va"],
)
def test_a_mode_the_checkpoint_was_not_released_for_is_refused(server, file, mode, branch, pattern):
    folder = server.models / "diffusion_models"
    if not (folder / file).exists():
        (folder / file).write_bytes((folder / TINY_DIT).read_bytes())
    prompt = generation(mode, prefix="H3/mismatch", dit=file, branch=branch)
    if mode == "Ref2VA":
        prompt = with_references(prompt, image="first.png")
    expect_node_error(server, prompt, pattern)


def _with_sampler(prompt, **inputs):
    sampler = next(node for node in prompt.values() if node["class_type"] == "H3Sampler")
    sampler["inputs"].update(inputs)
    return prompt


def _without_encoder_references(prompt):
    del prompt["5"]["inputs"]["references"]
    return prompt


@pytest.mark.parametrize(
    "build, pattern",
    [
        (
            lambda: with_references(generation("T2VA", prefix="H3/bad"), image="first.png"),
            r"mode T2VA: takes no references, but references are connected",
        ),
        (lambda: generation("Ref2VA", prefix="H3/bad"), r"mode Ref2VA: needs references"),
        (
            lambda: _with_sampler(generation("T2VA", prefix="H3/bad"), reference_audio_t=0.9),
            r"reference_audio_t: 0\.9 mixes noise into audio references, which only mode Ref2VA has \(mode T2VA\)",
        ),
        (
            lambda: _with_sampler(generation("T2VA", prefix="H3/bad"), reference_audio_t=1.5),
            r"reference_audio_t: got 1\.5; allowed: a number from 0\.5 to 1\.0",
        ),
    ],
    ids=["t2va-with-references", "ref2va-without-references", "t2va-reference-audio-t", "reference-audio-t-range"],
)
def test_bad_ref2va_requests_are_refused_when_queued(server, build, pattern):
    refused_at_validation(server, build(), pattern)


def test_after_the_refusals_the_server_runs_the_next_prompt(bad_files):
    """A refused prompt never reaches the worker, so one run after them all shows the server goes on."""
    next_prompt_runs(bad_files)


def test_keyframes_and_references_together_are_refused_at_the_text_encode(server):
    prompt = with_references(generation("Ref2VA", prefix="H3/bad"), image="first.png")
    prompt["31"] = {"class_type": "LoadImage", "inputs": {"image": "first.png"}}
    prompt["5"]["inputs"]["first_frame"] = ["31", 0]
    refused_at_validation(
        server,
        prompt,
        r"keyframes \(first_frame / last_frame: FL2VA\) and references \(Ref2VA\) "
        r"cannot be used together",
    )


def test_conditioning_encoded_without_the_references_is_a_node_error(server):
    prompt = _without_encoder_references(with_references(generation("Ref2VA", prefix="H3/bad"), image="first.png"))
    expect_node_error(
        server,
        prompt,
        r"conditioning: was encoded with references none, but the sampler has "
        r"\('image',\) at length 56",
    )
    next_prompt_runs(server)
