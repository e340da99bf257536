"""Runs that stop part way, in a real ComfyUI server: a cancel during the decode or during the save, a disk that
fills while the mp4 is written, and (on a GPU) an out-of-memory in the middle of a step. Each ends with a clear
outcome, leaves no file under a final name (nor a partial one), and the next prompt runs."""

import os
import subprocess

import pytest
from comfy_host import error_message, mp4_files
from graphs import generation


def next_prompt_runs(server, prefix):
    entry = server.run(generation(prefix=prefix, length=22))
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    assert len(mp4_files(entry, server.output)) == 1


def nothing_written(server, stem):
    folder = server.output / "H3"
    return not list(folder.glob(f"{stem}*")) and not list(folder.glob(".*partial*"))


def test_cancel_during_the_decode_stops_between_tiles(server):
    prompt = generation(width=320, steps=2, prefix="H3/cancel_decode")
    prompt["8"]["inputs"]["tiles_per_batch"] = 1  # 2 tiles x 3 windows: 6 batches
    tiles, interrupted_at = [], None
    for kind, data in server.events(prompt, timeout=300):
        if kind == "queued":
            prompt_id = data["prompt_id"]
        elif kind == "progress" and data.get("node") == "8":
            tiles.append(data["value"])
            if interrupted_at is None:
                interrupted_at = data["value"]
                server.interrupt()
    assert kind == "execution_interrupted"
    assert interrupted_at is not None and max(tiles) < 6
    assert not server.wait(prompt_id).get("outputs") and nothing_written(server, "cancel_decode")
    next_prompt_runs(server, "H3/after_cancel_decode")


def test_cancel_during_the_save_leaves_no_file(server):
    """A long save (600 frames of a picture scaled to 320x240), cancelled as it starts."""
    prompt = {
        "1": {"class_type": "LoadImage", "inputs": {"image": "first.png"}},
        "2": {
            "class_type": "ImageScale",
            "inputs": {
                "image": ["1", 0],
                "upscale_method": "nearest-exact",
                "width": 320,
                "height": 240,
                "crop": "disabled",
            },
        },
        "3": {"class_type": "RepeatImageBatch", "inputs": {"image": ["2", 0], "amount": 600}},
        "4": {
            "class_type": "H3SaveVideo",
            "inputs": {"images": ["3", 0], "filename_prefix": "H3/cancel_save", "fps": 24},
        },
    }
    for kind, data in server.events(prompt, timeout=300):
        if kind == "queued":
            prompt_id = data["prompt_id"]
        elif kind == "executing" and data.get("node") == "4":
            server.interrupt()
    assert kind == "execution_interrupted", kind
    assert not server.wait(prompt_id).get("outputs")
    assert nothing_written(server, "cancel_save")
    next_prompt_runs(server, "H3/after_cancel_save")


@pytest.fixture
def small_disk(server):
    """A 64 KiB tmpfs mounted at ``output/full`` (needs the privilege to mount, which the test machines have)."""
    folder = server.output / "full"
    folder.mkdir(exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        message = f"could not mount a small tmpfs for the full-disk test: {mounted.stderr.strip()}"
        if os.environ.get("H3_COMFY_GPU") == "1":
            pytest.skip(message + " (the GPU machine's sandbox; the test machines run it)")
        pytest.fail(message)
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def test_a_disk_that_fills_during_the_save_is_a_clear_error_and_leaves_nothing(server, small_disk):
    prompt = generation(length=56, width=320, height=192, prefix="full/clip")
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "error"
    message = error_message(entry)
    assert "clip_00001.mp4" in message and "No space left on device" in message, message
    assert os.listdir(small_disk) == []
    next_prompt_runs(server, "H3/after_full_disk")


@pytest.mark.skipif(os.environ.get("H3_COMFY_GPU") != "1", reason="an out-of-memory on a GPU: the server on the GPU")
def test_an_out_of_memory_mid_step_is_a_clear_error_and_the_server_goes_on(server):
    def ballast(release):
        entry = server.run(
            {"1": {"class_type": "H3ProbeBallast", "inputs": {"leave_megabytes": 256.0, "release": release}}}
        )
        assert entry["status"]["status_str"] == "success", error_message(entry)

    next_prompt_runs(server, "H3/before_oom")  # every model loaded and small; what is left goes to the ballast
    ballast(False)
    try:
        prompt = generation(length=362, width=2048, height=1152, prefix="H3/oom")
        prompt["6"]["inputs"]["memory_mode"] = "off"
        entry = server.run(prompt)
    finally:
        ballast(True)
    assert entry["status"]["status_str"] == "error"
    assert "out of memory" in error_message(entry).lower(), error_message(entry) + server.log_tail()
    assert nothing_written(server, "oom")
    next_prompt_runs(server, "H3/after_oom")
