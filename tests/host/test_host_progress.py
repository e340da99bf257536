"""Progress and model residency in a real ComfyUI server: the sampler reports every step and the decoder
every tile; loaded models stay loaded across runs and are released when the host frees memory."""

import requests

from comfy_host import error_message
from graphs import generation


def progress_of(server, prompt):
    """Each node's progress values (in order) over one run, from the host's websocket."""
    seen = {}
    for kind, data in server.events(prompt):
        if kind == "queued":
            prompt_id = data["prompt_id"]
        elif kind == "progress":
            seen.setdefault(data["node"], []).append((data["value"], data["max"]))
    entry = server.wait(prompt_id)
    assert entry["status"]["status_str"] == "success", error_message(entry)
    return seen


def test_every_step_and_every_tile_is_reported(server):
    seen = progress_of(server, generation(steps=5, width=320, height=32, prefix="H3/progress"))
    assert seen["7"] == [(i, 5) for i in range(1, 6)]
    # 56 frames = 17 latents: 3 temporal windows; 320 px wide: 2 tiles of 256 px with the trained overlap
    tiles = seen["8"]
    assert [value for value, _ in tiles] == list(range(1, len(tiles) + 1)) and tiles[-1] == (6, 6)


def test_models_stay_loaded_across_runs_and_are_released_when_the_host_frees_memory(server):
    loads = lambda: server.log_path.read_text().count("loaded h3_tiny_random_dit.safetensors")  # noqa: E731
    prompt = generation(length=22, prefix="H3/resident")
    server.run(prompt)
    first = loads()
    prompt["7"]["inputs"]["seed"] = 123  # a new sample from the same loaded models
    assert server.run(prompt)["status"]["status_str"] == "success"
    assert loads() == first
    released = server.log_path.read_text().count("the DiT was released")
    requests.post(server.url + "/free", json={"unload_models": True, "free_memory": True}, timeout=30)
    server.wait_for_log("the DiT was released", released + 1)  # the host's worker has taken the request
    prompt["7"]["inputs"]["seed"] = 456
    assert server.run(prompt)["status"]["status_str"] == "success"
    assert loads() == first + 1


def test_the_sampler_shows_its_memory_decision_on_the_node(server):
    texts = [data for kind, data in server.events(generation(length=22, seed=77, prefix="H3/told")) if kind == "text"]
    told = [text for node, text in texts if node == "7"]
    # on the CPU there is nothing to plan; on a GPU (H3_COMFY_GPU=1) the policy says what it chose and why
    assert told and (told[-1] == "running on the CPU; no memory plan needed" or told[-1].startswith("memory policy auto"))


def test_the_hosts_unload_reaches_every_model_and_the_server_goes_on(server):
    def released(name):
        return server.log_path.read_text().count(f"the {name} was released")

    names = ("DiT", "video VAE", "audio VAE", "text encoder")
    prompt = generation(length=22, prefix="H3/unload")
    for seed in (1, 2):  # twice with the same loaded models: listed once each by the host, not twice
        prompt["7"]["inputs"]["seed"] = seed
        assert server.run(prompt)["status"]["status_str"] == "success"
    before = {name: released(name) for name in names}
    requests.post(server.url + "/free", json={"unload_models": True}, timeout=30)
    server.wait_for_log("the DiT was released", before["DiT"] + 1)  # the host's worker has taken the request
    prompt["7"]["inputs"]["seed"] = 3
    entry = server.run(prompt)  # the server goes on, with every model loaded again
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    assert {name: released(name) for name in names} == {name: before[name] + 1 for name in names}