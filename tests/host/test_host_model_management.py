"""The pack's models in the host's own model management, in a real ComfyUI server: held by the host's
ModelPatcher (the DiT and the text encoder by subclasses that place them), listed among its loaded models,
kept across runs, unloaded by its "unload models", and the DiT freeing what the host asks of it — a block at a
time — when another model needs the room. A test-only node pack beside ours (``tests/host/probe_nodes``)
reports what the host holds and makes the host's own unload call."""

from dataclasses import replace

import av
import numpy as np

from comfy_host import error_message, mp4_files
from graphs import generation
from h3_core.sizes import sizes_metadata
from h3_core.tiny_checkpoints import TINY_DIT

def run(server, prompt):
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    return entry


def with_listing(prompt):
    """``prompt`` with the loaded-models probe after both decodes (node "1000")."""
    prompt = dict(prompt)
    prompt["1000"] = {"class_type": "H3ProbeLoadedModels",
                      "inputs": {"tag": "loaded", "after_images": ["8", 0], "after_audio": ["9", 0]}}
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
    assert {("H3DiTPatcher", "H3DiT"), ("ModelPatcher", "VideoVAE"), ("ModelPatcher", "AudioVAE"),
            ("TextEncoderPatcher", "_EncoderModule")} <= held
    first = loads(server)
    counts = {name: requested(server, name) for name in ("H3DiT", "VideoVAE", "AudioVAE")}
    prompt["7"]["inputs"]["seed"] = 123  # a new sample from the same loaded models
    listed = listing(run(server, prompt))
    assert loads(server) == first
    assert {name: requested(server, name) for name in counts} == counts  # still loaded: nothing loaded anew
    assert len([m for m in listed if m["patcher"] == "H3DiTPatcher"]) == 1  # listed once, not once per run
    unloaded = server.log_path.read_text().count("the DiT was unloaded")
    server.post("/free", {"unload_models": True})
    server.wait_for_log("the DiT was unloaded", unloaded + 1)  # the host's worker takes the flag when it wakes
    prompt["7"]["inputs"]["seed"] = 456
    run(server, prompt)  # the loaders' outputs are still cached: the host loads the same models again
    assert loads(server) == first
    assert {name: requested(server, name) for name in counts} == {name: n + 1 for name, n in counts.items()}


def test_the_dit_frees_what_the_host_asks_a_block_at_a_time(server):
    """A six-block DiT: the host asks it for two and a half blocks' bytes; it streams the last blocks from host
    memory until at least that much is free (never a whole block more) and stays loaded; asked for more than
    streaming can free, it is unloaded whole. Each time the sampler then runs with it and makes the same clip."""
    import torch
    from safetensors.torch import save_file

    from h3_core.models.dit import H3DiT, keeps_fp32

    cfg = replace(TINY_DIT, layers=6)
    torch.manual_seed(4)
    model = H3DiT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    name = "h3_probe_six_blocks.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(server.models / "diffusion_models" / name), metadata=sizes_metadata(cfg))
    prompt = generation(length=22, prefix="H3/six_blocks", dit=name, branch="none")
    before = frames(run(server, prompt), server)
    # the loader holds it in bf16 (weight_dtype), the released fp32 islands in fp32
    block = max(sum(t.numel() * (4 if keeps_fp32(f"blocks.{i}.{name}") else 2) for name, t in b.state_dict().items())
                for i, b in enumerate(model.blocks))
    for blocks, stays in ((2.5, True), (100, False)):
        asked = int(blocks * block)
        probed = dict(prompt)
        probed["1001"] = {"class_type": "H3ProbeHostUnload",
                          "inputs": {"megabytes": asked / 2**20, "tag": str(blocks), "model": ["1", 0]}}
        probed["7"] = {"class_type": "H3Sampler", "inputs": {**prompt["7"]["inputs"], "model": ["1001", 0]}}
        entry = run(server, probed)
        report = entry["outputs"]["1001"]["unload"][0]
        assert report["loaded"] and report["stays_loaded"] is stays, report
        if stays:
            assert abs(report["asked"] - asked) <= 1 and report["asked"] == report["wanted"]
            assert report["asked"] <= report["freed"] < report["asked"] + report["largest_block"], report
            assert report["before"] - report["after"] == report["freed"]
            assert "the DiT freed" in server.log_tail(200)
        assert np.array_equal(frames(entry, server), before)


def test_two_prompts_queued_back_to_back_share_the_loaded_models(server):
    first = loads(server)
    answers = [server.queue(generation(length=22, seed=seed, prefix=f"H3/back_to_back_{seed}")) for seed in (31, 32)]
    entries = [server.wait(answer["prompt_id"]) for answer in answers]
    for entry in entries:
        assert entry["status"]["status_str"] == "success", error_message(entry)
        assert len(mp4_files(entry, server.output)) == 1
    assert loads(server) - first <= 1  # at most once, for both (none when an earlier test left it loaded)
