"""Progress in a real ComfyUI server: the sampler reports every step and the decoder every tile, and the
sampler shows its memory decision on the node."""

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


def test_the_sampler_shows_its_memory_decision_on_the_node(server):
    texts = [data for kind, data in server.events(generation(length=22, seed=77, prefix="H3/told")) if kind == "text"]
    told = [text for node, text in texts if node == "7"]
    # on the CPU there is nothing to plan; on a GPU (H3_COMFY_GPU=1) the policy says what it chose and why
    assert told and (
        told[-1] == "running on the CPU; no memory plan needed" or told[-1].startswith("memory policy auto")
    )
