"""Cancelling in a real ComfyUI server: the sampler stops within a step, no mp4 appears, the server goes on."""

import json

import websocket

from comfy_host import error_message, mp4_files
from graphs import generation


def test_cancel_mid_sampling_stops_within_a_step_and_leaves_no_mp4(server):
    ws = websocket.create_connection(f"ws://127.0.0.1:{server.port}/ws?clientId={server.client_id}", timeout=120)
    try:
        answer = server.queue(generation(steps=200, prefix="H3/cancelled"))
        prompt_id = answer["prompt_id"]
        steps_seen, interrupted_at, outcome = [], None, None
        while outcome is None:
            message = ws.recv()
            if not isinstance(message, str):
                continue  # previews
            event = json.loads(message)
            data = event.get("data", {})
            if data.get("prompt_id") not in (None, prompt_id):
                continue
            if event["type"] == "progress" and data.get("node") == "7":
                steps_seen.append(data["value"])
                if interrupted_at is None and data["value"] >= 2:
                    interrupted_at = data["value"]
                    server.interrupt()
            elif event["type"] in ("execution_interrupted", "execution_error", "execution_success"):
                outcome = event["type"]
    finally:
        ws.close()
    assert outcome == "execution_interrupted"
    assert interrupted_at is not None and max(steps_seen) <= interrupted_at + 1 < 200
    entry = server.wait(prompt_id)
    assert entry["status"]["status_str"] == "error" and not entry.get("outputs")
    assert not list((server.output / "H3").glob("cancelled*")) and not list((server.output / "H3").glob(".*"))
    after = server.run(generation(prefix="H3/after_cancel", length=22))
    assert after["status"]["status_str"] == "success", error_message(after)
    assert len(mp4_files(after, server.output)) == 1
