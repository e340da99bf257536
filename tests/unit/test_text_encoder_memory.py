"""The text encoder holds only what H3 reads, in resident memory: loading a synthetic 1 GiB file in ComfyUI's
layout for layer 50 of 64 leaves the process smaller than holding all 64 by the 14 layers' bytes that
``held_bytes`` predicts (bench/text_encoder_memory.py), measured after every held weight was read once."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "text_encoder_memory.py"


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads resident memory from /proc")
def test_the_later_layers_never_become_resident(tmp_path):
    from comfy_host import comfyui_root

    try:
        tokenizer = comfyui_root() / "comfy" / "text_encoders" / "qwen25_tokenizer"
    except RuntimeError as exc:
        pytest.skip(str(exc))
    spec = importlib.util.spec_from_file_location("text_encoder_memory", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["text_encoder_memory"] = bench
    spec.loader.exec_module(bench)
    result = bench.main(["--gib", "1", "--file", str(tmp_path / "qwen3vl.safetensors"), "--tokenizer", str(tokenizer)])
    synthetic = result["synthetic"]
    held, every = synthetic["held_layers"], synthetic["all_layers"]
    assert synthetic["layers"] == 64 and held["layer"] == 50 and held["checksum_finite"]
    tables = held["resident_bytes"] - held["held_bytes_predicted"]  # the rotary tables, computed at load
    assert 0 < tables == every["resident_bytes"] - every["held_bytes_predicted"]
    saved = synthetic["predicted_saved_bytes"]
    assert abs(synthetic["rise_saved_bytes"] - saved) < 0.1 * saved
    assert held["rise"]["RssFile"] >= held["held_bytes_predicted"]  # the held weights were all read once
    comfy, folder = result["full_size"]["comfyui_bf16_file"], result["full_size"]["huggingface_folder"]
    assert comfy["held_bytes"] == folder["held_bytes"] and comfy["saved_bytes"] < 2**20
    assert folder["saved_bytes"] > 15 * 10**9
