"""The pack's models in the host's own model management, in a real ComfyUI server: held by the host's
ModelPatcher (the DiT and the text encoder by subclasses that place them, the VAEs by one that reads them at its
first load), listed among its loaded models,
kept across runs, unloaded by its "unload models", and the DiT freeing what the host asks of it — a block at a
time — when another model needs the room. A test-only node pack beside ours (``tests/host/probe_nodes``)
reports what the host holds and makes the host's own unload call."""

import os
from dataclasses import replace

import av
import numpy as np
import pytest
from comfy_host import error_message, mp4_files
from graphs import generation
from tiny_checkpoints import TINY_DIT

from h3_core.formats.sizes import sizes_metadata


def run(server, prompt):
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    return entry


def with_listing(prompt):
    """``prompt`` with the loaded-models probe after both decodes (node "1000")."""
    prompt = dict(prompt)
    prompt["1000"] = {
        "class_type": "H3ProbeLoadedModels",
        "inputs": {"tag": "loaded", "after_images": ["8", 0], "after_audio": ["9", 0]},
    }
    return prompt


def listing(entry):
    return [m for m in entry["outputs"]["1000"]["loaded"] if m["ours"]]


def frames(entry, server):
    (path,) = mp4_files(entry, server.output)
    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def loads(server, name="h3_tiny_random_dit.safetensors"):
    return server.log_path.read_text().count(f"loaded {name} into host memory")


def requested(server, model):
    """How often the host loaded ``model`` (a class name) to its device anew: its own log line."""
    return server.log_path.read_text().count(f"Requested to load {model}")


def test_the_models_are_the_hosts_stay_loaded_and_go_when_it_unloads(server):
    prompt = with_listing(generation(length=22, prefix="H3/resident"))
    held = {(m["patcher"], m["model"]) for m in listing(run(server, prompt))}
    assert {
        ("H3DiTPatcher", "H3DiT"),
        ("VAEPatcher", "VideoVAE"),
        ("VAEPatcher", "AudioVAE"),
        ("TextEncoderPatcher", "_EncoderModule"),
    } <= held
    first = loads(server)
    counts = {name: requested(server, name) for name in ("H3DiT", "VideoVAE", "AudioVAE")}
    prompt["7"]["inputs"]["seed"] = 123  # a new sample from the same loaded models
    listed = listing(run(server, prompt))
    assert loads(server) == first
    assert {name: requested(server, name) for name in counts} == counts  # still loaded: nothing loaded anew
    assert len([m for m in listed if m["patcher"] == "H3DiTPatcher"]) == 1  # listed once, not once per run
    server.free("the DiT was unloaded")
    prompt["7"]["inputs"]["seed"] = 456
    run(server, prompt)  # the loaders' outputs are still cached: the host loads the same models again
    assert loads(server) == first
    assert {name: requested(server, name) for name in counts} == {name: n + 1 for name, n in counts.items()}


def write_probe_dit(server, name, cfg, seed=4):
    """A random DiT of ``cfg`` in the server's diffusion_models; returns its largest block's bytes as the loader
    holds it (bf16, the released fp32 islands in fp32)."""
    import torch
    from safetensors.torch import save_file

    from h3_core.models.dit import H3DiT
    from h3_core.models.precision import keeps_fp32

    torch.manual_seed(seed)
    model = H3DiT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(server.models / "diffusion_models" / name),
        metadata=sizes_metadata(cfg),
    )
    return max(
        sum(t.numel() * (4 if keeps_fp32(f"blocks.{i}.{key}") else 2) for key, t in b.state_dict().items())
        for i, b in enumerate(model.blocks)
    )


def probed_before_sampler(prompt, node):
    """``prompt`` with the probe ``node`` (id "1001", taking the DiT) between the DiT loader and the sampler."""
    probed = dict(prompt)
    probed["1001"] = {**node, "inputs": {**node["inputs"], "model": ["1", 0]}}
    probed["7"] = {"class_type": "H3Sampler", "inputs": {**prompt["7"]["inputs"], "model": ["1001", 0]}}
    return probed


def test_the_dit_frees_what_the_host_asks_a_block_at_a_time(server):
    """A six-block DiT: the host asks it for two and a half blocks' bytes; it streams the last blocks from host
    memory until at least that much is free (never a whole block more) and stays loaded; asked for more than
    streaming can free, it is unloaded whole. Each time the sampler then runs with it and makes the same clip."""
    name = "h3_probe_six_blocks.safetensors"
    block = write_probe_dit(server, name, replace(TINY_DIT, layers=6))
    prompt = generation(length=22, prefix="H3/six_blocks", dit=name, branch="none")
    before = frames(run(server, prompt), server)
    for blocks, stays in ((2.5, True), (100, False)):
        asked = int(blocks * block)
        entry = run(
            server,
            probed_before_sampler(
                prompt, {"class_type": "H3ProbeHostUnload", "inputs": {"megabytes": asked / 2**20, "tag": str(blocks)}}
            ),
        )
        report = entry["outputs"]["1001"]["unload"][0]
        assert report["loaded"] and report["stays_loaded"] is stays, report
        if stays:
            assert abs(report["asked"] - asked) <= 1 and report["asked"] == report["wanted"]
            assert report["asked"] <= report["freed"] < report["asked"] + report["largest_block"], report
            assert report["before"] - report["after"] == report["freed"]
            assert "the DiT freed" in server.log_tail(200)
        assert np.array_equal(frames(entry, server), before)


@pytest.mark.skipif(
    os.environ.get("H3_COMFY_GPU") != "1",
    reason="the host frees device memory for a load only on a GPU (load_models_gpu skips the CPU)",
)
def test_another_model_loaded_while_the_dit_is_resident_gets_the_bytes_the_host_asked_for(server):
    """The host loads another model (through its own load_models_gpu) with working memory that leaves it short by
    two and a half of the DiT's blocks: the host asks the resident DiT for what is missing, the DiT streams its
    last blocks until at least that much is free (never a whole block more) and stays loaded, the other model
    comes onto the device, and the next run with the DiT makes the same clip."""
    name = "h3_probe_wide_blocks.safetensors"
    block = write_probe_dit(server, name, replace(TINY_DIT, layers=6, hidden=1024, heads=8, head_dim=128, ffn=4096))
    prompt = generation(length=22, prefix="H3/wide_blocks", dit=name, branch="none")
    before = frames(run(server, prompt), server)
    wanted = int(2.5 * block)
    entry = run(
        server,
        probed_before_sampler(
            prompt,
            {
                "class_type": "H3ProbeLoadAnother",
                "inputs": {"megabytes": wanted / 2**20, "other_megabytes": 64.0, "tag": "another"},
            },
        ),
    )
    report = entry["outputs"]["1001"]["load"][0]
    assert report["loaded"] and report["stays_loaded"], report
    assert report["other_loaded"] == report["other_size"], report
    # what the host asked is the shortfall it measured itself: ours, less what the device gained meanwhile
    assert abs(report["asked"] - wanted) <= 2 * 2**20, report
    assert report["asked"] <= report["freed"] < report["asked"] + report["largest_block"], report
    assert report["before"] - report["after"] == report["freed"], report
    assert np.array_equal(frames(entry, server), before)


def test_two_prompts_queued_back_to_back_share_the_loaded_models(server):
    first = loads(server)
    answers = [server.queue(generation(length=22, seed=seed, prefix=f"H3/back_to_back_{seed}")) for seed in (31, 32)]
    entries = [server.wait(answer["prompt_id"]) for answer in answers]
    for entry in entries:
        assert entry["status"]["status_str"] == "success", error_message(entry)
        assert len(mp4_files(entry, server.output)) == 1
    assert loads(server) - first <= 1  # at most once, for both (none when an earlier test left it loaded)


def test_each_loader_places_its_model_on_the_device_chosen_and_refuses_one_there_is_not(server):
    """A device per model: the DiT, the VAEs and the text encoder on the device their loader names (with the
    server on the CPU all on the CPU, which the host would give them anyway; with the server on a GPU the DiT and
    the video VAE on cuda:0 beside the text encoder and the audio VAE on the CPU: the choice reaches the host's
    model management, which lists each where it was asked), and a device this process does not have refused at
    validation, by name."""
    gpu = "cuda:0" if os.environ.get("H3_COMFY_GPU") == "1" else "cpu"
    chosen = {"1": gpu, "2": gpu, "3": "cpu", "4": "cpu"}  # DiT, video VAE, audio VAE, text encoder
    prompt = with_listing(generation(length=22, prefix="H3/device_per_model"))
    for node, device in chosen.items():
        prompt[node]["inputs"]["device"] = device
    listed = listing(run(server, prompt))
    devices = {m["model"]: m["device"] for m in listed}
    assert devices["VideoVAE"] == gpu and devices["AudioVAE"] == devices["_EncoderModule"] == "cpu", devices
    assert devices.get("H3DiT", gpu) == gpu, devices  # listed while loaded; the decodes may have asked it off
    for node in ("1", "2"):
        bad = dict(prompt, **{node: {**prompt[node], "inputs": {**prompt[node]["inputs"], "device": "cuda:7"}}})
        answer = server.queue(bad)
        assert "prompt_id" not in answer
        assert "device" in str(answer["node_errors"]) and "cuda:7" in str(answer["node_errors"]), node
