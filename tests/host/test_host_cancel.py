"""Cancelling in a real ComfyUI server: the sampler stops within a step, no mp4 appears, the server goes on."""

from comfy_host import error_message, mp4_files
from graphs import generation


def test_cancel_mid_sampling_stops_within_a_step_and_leaves_no_mp4(server):
    steps_seen, interrupted_at = [], None
    for kind, data in server.events(generation(steps=200, prefix="H3/cancelled"), timeout=120):
        if kind == "queued":
            prompt_id = data["prompt_id"]
        elif kind == "progress" and data.get("node") == "7":
            steps_seen.append(data["value"])
            if interrupted_at is None and data["value"] >= 2:
                interrupted_at = data["value"]
                server.interrupt()
    outcome = kind
    assert outcome == "execution_interrupted"
    assert interrupted_at is not None and max(steps_seen) <= interrupted_at + 1 < 200
    entry = server.wait(prompt_id)
    assert entry["status"]["status_str"] == "error" and not entry.get("outputs")
    assert not list((server.output / "H3").glob("cancelled*")) and not list((server.output / "H3").glob(".*"))
    after = server.run(generation(prefix="H3/after_cancel", length=22))
    assert after["status"]["status_str"] == "success", error_message(after)
    assert len(mp4_files(after, server.output)) == 1
