"""The sampler's model followed from the node to the kernels in a real ComfyUI server crosses back up the pack's
layers (docs/architecture.md) at most 4 times: a crossing is a call of a pack function from one of a lower layer
(the nearest pack frame below it on the stack; the host's and torch's frames between them skipped, and a decorator's
wrapper taken as the function it wraps), counted once
per caller and callee however often it is made. Recorded by the test pack's tracer on the thread that runs the
prompt, while the H3 Sampler runs T2VA and FL2VA clips, with the host's previews off and on. The crossings left are
the host's services the node gives with the run (the memory plan made when the sequence is known, progress or
previews, cancel); nothing inside h3_core calls back into a layer above its own."""

import pytest
from comfy_host import error_message
from graphs import generation

MOST = 4


def traced(server, prompt: dict) -> dict:
    """``prompt`` with the tracer started before the sampler (it takes the model through the probe) and stopped
    after it: the upward calls and the pack functions the sampler's ``execute`` called."""
    prompt = {
        **prompt,
        "90": {"class_type": "H3ProbeTraceLayersStart", "inputs": {"model": ["1", 0]}},
        "91": {"class_type": "H3ProbeTraceLayersStop", "inputs": {"after": ["7", 0]}},
    }
    prompt["7"]["inputs"]["model"] = ["90", 0]
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    return entry["outputs"]["91"]


@pytest.mark.parametrize("previews", [False, True], ids=["previews-off", "previews-on"])
@pytest.mark.parametrize("mode", ["T2VA", "FL2VA"])
def test_the_sampler_crosses_back_up_at_most_four_times(request, mode, previews):
    server = request.getfixturevalue("previewing_server" if previews else "server")
    frames = {"first": "first.png"} if mode == "FL2VA" else {}
    seen = traced(server, generation(mode, length=22, steps=2, prefix=f"H3/layers_{mode}", **frames))
    upward = seen["upward"]
    said = "\n".join(f"{u['caller']} ({u['from']}) -> {u['callee']} ({u['to']}) x{u['calls']}" for u in upward)
    assert len(upward) <= MOST, said
    assert {u["to"] for u in upward} == {"nodes"}, said
    callees = {u["callee"].split(":")[1] for u in upward}
    assert "H3Sampler.execute.<locals>.fit" in callees, said  # the plan, made once the sequence is known
    assert "check_cancel" in callees, said
    assert ("PreviewProgress.preview" if previews else "Progress.__call__") in callees, said
    assert any(name.endswith("generate_clip") for name in seen["descents"]), seen["descents"]
