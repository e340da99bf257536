"""H3 Multi-GPU through a real ComfyUI server on the CPU, the ranks joined with gloo: the clip sampled across worker
processes is the one-process clip (the released sampler with plain Ulysses; a LoRA'd model, the VDN-H3 branch split
and one of the host's samplers, which rank 0 alone runs and the workers follow), and the video decoded with its tiles
shared among them is the one-process decode, into IMAGE and into an mp4; a cancel stops every rank and closes the
workers, an unload closes them, and the server keeps serving; a bad choice is refused before anything runs."""

import json
import os
import time
from pathlib import Path

import av
import pytest
import torch
from comfy_host import error_message, mp4_files
from graphs import generation, with_decode_and_save
from test_host_loras import lora_files

LENGTH = 22
# the ranks beside a server on a GPU need a GPU each
pytestmark = pytest.mark.skipif(
    os.environ.get("H3_COMFY_GPU") == "1" and torch.cuda.device_count() < 2,
    reason="a server on one GPU: H3 Multi-GPU needs two",
)


def kept(server, name):
    return torch.load(server.output / "probes" / f"{name}.pt", weights_only=False)


def sampler_copy(prompt, node, name, *, gpus=None, softmax_ranks=0, lora=None, sampler=None):
    """A copy of sampler ``7`` as ``node`` on a model through H3 LoRA (``lora``) and H3 Multi-GPU (``gpus``), with
    KSamplerSelect's ``sampler``; its latent kept as ``name``."""
    inputs = dict(prompt["7"]["inputs"])
    if lora is not None:
        prompt[f"{node}1"] = {
            "class_type": "H3LoraLoader",
            "inputs": {"model": inputs["model"], "lora_name": lora, "strength": 10.0},
        }
        inputs["model"] = [f"{node}1", 0]
    if gpus is not None:
        prompt[f"{node}2"] = {
            "class_type": "H3MultiGPU",
            "inputs": {"model": inputs["model"], "gpus": gpus, "softmax_ranks": softmax_ranks},
        }
        inputs["model"] = [f"{node}2", 0]
    if sampler is not None:
        prompt[f"{node}3"] = {"class_type": "KSamplerSelect", "inputs": {"sampler_name": sampler}}
        inputs["sampler"] = [f"{node}3", 0]
    prompt[node] = {"class_type": "H3Sampler", "inputs": inputs}
    prompt[f"{node}4"] = {"class_type": "H3ProbeKeep", "inputs": {"value": [node, 0], "name": name}}


def latents_only(**options):
    """``generation`` without its decode and save nodes: only what a kept latent needs runs."""
    prompt = generation(length=LENGTH, **options)
    for node in ("8", "9", "10"):
        prompt.pop(node)
    return prompt


def rank_workers(server) -> list[int]:
    """The server's worker processes (multiprocessing spawns them through ``spawn_main``)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if parent == server.process.pid and b"spawn_main" in command:
            pids.append(int(stat.parent.name))
    return pids


def wait_until_gone(server, timeout=60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := rank_workers(server)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_a_clip_sampled_across_ranks_is_the_one_process_clip(server):
    lora_files(server)
    prompt = latents_only(seed=4, prefix="H3/ranks")
    sampler_copy(prompt, "50", "alone")
    sampler_copy(prompt, "51", "ranks", gpus=2)
    prompt["512"]["inputs"]["video_vae"] = ["2", 0]
    decode = {"latent": ["51", 0], "tile_size": 64, "overlap": 32, "tiles_per_batch": 1}
    prompt["60"] = {"class_type": "H3VideoDecode", "inputs": dict(decode, video_vae=["512", 1])}
    prompt["61"] = {"class_type": "H3VideoDecode", "inputs": dict(decode, video_vae=["2", 0])}
    for node, name in (("60", "frames_ranks"), ("61", "frames_alone")):
        prompt[f"{node}4"] = {"class_type": "H3ProbeKeep", "inputs": {"value": [node, 0], "name": name}}
    sampler_copy(prompt, "52", "lora_euler_alone", lora="style.safetensors", sampler="euler")
    sampler_copy(prompt, "53", "lora_euler_ranks", gpus=2, softmax_ranks=1, lora="style.safetensors", sampler="euler")
    prompt.pop("7")
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    latents = {
        name: kept(server, name)["samples"] for name in ("alone", "ranks", "lora_euler_alone", "lora_euler_ranks")
    }
    # differences of clips from one starting noise: what the LoRA changes, against what sampling across ranks
    # changes (bf16 weights: the rows' GEMMs run on shards, whose rounding may differ; on this CPU none did)
    lora_change = (latents["lora_euler_alone"] - latents["alone"]).abs().max()
    assert lora_change > 0
    for alone, ranks in (("alone", "ranks"), ("lora_euler_alone", "lora_euler_ranks")):
        assert latents[alone].shape == latents[ranks].shape
        assert (latents[ranks] - latents[alone]).abs().max() <= lora_change / 10, (alone, lora_change)
    frames = kept(server, "frames_ranks")
    assert frames.shape[0] == LENGTH and torch.equal(frames, kept(server, "frames_alone"))
    assert len(rank_workers(server)) == 1  # one worker beside the server, kept for the next run
    log = server.log_path.read_text()
    assert "starting 1 worker process(es) for the ranks on cpu" in log


def test_a_cancel_stops_every_rank_and_closes_the_workers_and_the_server_goes_on(server):
    prompt = latents_only(steps=200, prefix="H3/ranks_cancel")
    sampler_copy(prompt, "50", "ranks_cancelled", gpus=2)
    prompt.pop("7")
    interrupted_at, seen = None, []
    for kind, data in server.events(prompt, timeout=300):
        if kind == "progress" and data.get("node") == "50":
            seen.append(data["value"])
            if interrupted_at is None and data["value"] >= 2:
                assert len(rank_workers(server)) == 1
                interrupted_at = data["value"]
                server.interrupt()
    assert kind == "execution_interrupted"
    assert interrupted_at is not None and max(seen) <= interrupted_at + 1
    assert wait_until_gone(server) == []
    again = with_decode_and_save(generation(length=LENGTH), "H3/ranks_after_cancel")
    sampler_copy(again, "50", "after_cancel", gpus=2)
    again["502"]["inputs"]["video_vae"] = ["2", 0]
    again["8"]["inputs"].update(latent=["50", 0], video_vae=["502", 1])
    again.pop("7")
    entry = server.run(again)
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    (clip,) = mp4_files(entry, server.output)
    with av.open(str(clip)) as container:
        assert sum(1 for _ in container.decode(video=0)) == LENGTH
    assert len(rank_workers(server)) == 1
    # and the node cache: later tests start afresh; the workers are said closed after they were joined
    server.free("closed the 1 rank worker process(es): the host unloaded the DiT", free_memory=True)
    assert wait_until_gone(server) == []


def test_a_choice_the_ranks_cannot_take_is_refused_before_anything_runs(server):
    prompt = latents_only(prefix="H3/ranks_refused")
    sampler_copy(prompt, "50", "refused", gpus=2, softmax_ranks=2)
    prompt.pop("7")
    answer = server.queue(prompt)
    assert "prompt_id" not in answer
    errors = json.dumps(answer["node_errors"])
    assert "softmax_ranks: got 2 with 2 GPUs" in errors and "1 to 1" in errors
    assert rank_workers(server) == []
    too_many = latents_only(prefix="H3/ranks_too_many")
    sampler_copy(too_many, "50", "too_many", gpus=3)
    too_many.pop("7")
    entry = server.run(too_many)
    assert entry["status"]["status_str"] == "error"
    message = error_message(entry)
    assert "gpus: got 3 (softmax_ranks 0) for a DiT of 2 attention heads" in message, message
    assert rank_workers(server) == []


def test_the_workers_end_with_the_server(server, tmp_path):
    """A server stopped as a service manager stops it (SIGTERM, no clean shutdown) leaves no worker behind."""
    from comfy_host import ComfyServer

    base = tmp_path / "exiting"
    base.mkdir()
    (base / "models").symlink_to(server.models, target_is_directory=True)
    exiting = ComfyServer(base).start()
    try:
        prompt = generation(length=LENGTH, prefix="H3/ranks_exiting")
        prompt["71"] = {"class_type": "H3MultiGPU", "inputs": {"model": ["1", 0], "gpus": 2, "softmax_ranks": 0}}
        prompt["7"]["inputs"]["model"] = ["71", 0]
        entry = exiting.run(prompt)
        assert entry["status"]["status_str"] == "success", error_message(entry) + exiting.log_tail()
        workers = rank_workers(exiting)
        assert len(workers) == 1
    finally:
        exiting.stop()
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in workers)


def alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" not in status.read_text()
    except OSError:
        return False


def test_the_node_is_labelled_experimental_until_a_run_on_several_gpus_is_recorded(server):
    info = server.object_info()["H3MultiGPU"]
    assert info["display_name"] == "H3 Multi-GPU (experimental)"
    assert info["description"].startswith("Experimental: no run on several GPUs has been recorded yet")
