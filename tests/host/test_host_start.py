"""The pack is a quiet guest in a ComfyUI server (``__init__.comfy_entrypoint``, ``nodes._host``): registering it
changes nothing in the process — the environment, the garbage collector, the threads, the optional kernel
libraries imported, CUDA and its page-locked memory are as the server made them — until a prompt holding one of its
nodes is posted. That prompt starts its warm-up: on a GPU, a thread of its own allocates and frees the staged
reader's page-locked buffers, makes the libraries' first products and convolutions, imports the compilers' modules
with Triton's first launch, chooses the dense-attention kernels and probes the hardware video encoders, each said
in the log; on the CPU nothing is compiled and no thread starts."""

import os
import subprocess
import sys

import pytest
from comfy_host import ComfyServer, error_message

ON_GPU = os.environ.get("H3_COMFY_GPU") == "1"
WARM_UP_LINES = ("imported the compilers' modules", "first calls made ahead", "hardware video encoders probed")


def interpreter_freeze_count() -> int:
    """The objects a new interpreter of the server's Python has frozen out of the collector before running anything:
    what a server has before any pack runs (0 unless the environment's start-up freezes some)."""
    said = subprocess.run(
        [sys.executable, "-c", "import gc; print(gc.get_freeze_count())"], capture_output=True, text=True, check=True
    )
    return int(said.stdout)


@pytest.fixture(scope="module")
def fresh(server, tmp_path_factory):
    """A server of its own (the session's has run H3 prompts before), on the session's model and input folders."""
    host = ComfyServer.beside(server, tmp_path_factory.mktemp("comfy_start")).start()
    yield host
    host.stop()


def state(server, prompt: dict, tag: str) -> dict:
    prompt = {**prompt, "99": {"class_type": "H3ProbeProcessState", "inputs": {"tag": tag}}}
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    return entry["outputs"]["99"]["state"][0]


def test_nothing_changes_until_an_h3_prompt_is_posted(fresh):
    server = fresh
    said = server.log_path.read_text(errors="replace")
    assert not any(line in said for line in WARM_UP_LINES), "the pack did work at registration"
    first = state(server, {}, "no H3 node")
    again = state(server, {}, "still no H3 node")
    assert first["environment"] == again["environment"]
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"):
        assert "h3_hybrid" not in first["environment"].get(name, ""), name
    frozen = interpreter_freeze_count()
    assert first["gc_frozen"] == frozen and first["gc_enabled"], (first["gc_frozen"], frozen)
    assert not any(name.startswith("h3-") for name in first["threads"]), first["threads"]
    assert not {"flash_attn", "flash_attn.cute"} & set(first["kernel_modules"])
    assert first["pinned_bytes"] == 0
    canvas = {"1": {"class_type": "H3Canvas", "inputs": {"width": 64, "height": 32, "length": 22}}}
    after = state(server, canvas, "an H3 node")
    assert after["environment"] == first["environment"] and after["gc_frozen"] == frozen
    assert after["gc_threshold"] == first["gc_threshold"]
    if ON_GPU:
        server.wait_for_log("hardware video encoders probed", 1)
    else:  # nothing compiles on the CPU: no warm-up thread, nothing said
        assert not any(name.startswith("h3-") for name in after["threads"]), after["threads"]
        assert not any(line in server.log_path.read_text(errors="replace") for line in WARM_UP_LINES)


@pytest.mark.skipif(not ON_GPU, reason="the warm-up thread runs where the compiled paths run: the server on a GPU")
def test_the_warm_up_does_its_work_ahead_and_says_so(fresh):
    server = fresh
    canvas = {"1": {"class_type": "H3Canvas", "inputs": {"width": 64, "height": 32, "length": 22}}}
    state(server, canvas, "an H3 node")
    server.wait_for_log("hardware video encoders probed", 1)
    said = server.log_path.read_text(errors="replace")
    assert "imported the compilers' modules" in said and "dense attention kernels chosen ahead" in said
    made = next(line for line in said.splitlines() if "the libraries' first calls made ahead" in line)
    for kind in (
        "pinned staging buffers",
        "bf16 product",
        "fp16 product",
        "fp32 conv1d",
        "fp32 conv_transpose1d",
        "bf16 depthwise conv2d",
    ):
        assert f"{kind} " in made and f"{kind} failed" not in made, made
    assert "h264_nvenc " in next(line for line in said.splitlines() if "hardware video encoders probed" in line)
