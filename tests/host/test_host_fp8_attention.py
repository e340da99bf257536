"""H3 Attention & Memory's attention_precision through a real ComfyUI server: fp8 samples the clip with the window
softmax in e4m3 (emulated on this CPU, and said so), close to the bf16 clip and not equal to it; fp8 with the flex
backend is refused at validation, naming the input.

The tiny DiT's attention adds little to its residual stream, so its weights load in fp16, whose finer rounding
keeps the difference e4m3 makes."""

import importlib.util
import json
import os

import pytest
import torch
from comfy_host import error_message
from graphs import generation

LENGTH = 22
# on a GPU the fp8 window softmax is cuDNN's (nvidia-cudnn-frontend, in the server's environment as in this one)
NO_FP8_KERNEL = os.environ.get("H3_COMFY_GPU") == "1" and importlib.util.find_spec("cudnn") is None


def kept(server, name):
    return torch.load(server.output / "probes" / f"{name}.pt", weights_only=False)["samples"].float()


def test_fp8_attention_is_listed_off_by_default(server):
    optional = server.object_info()["H3AttentionSettings"]["input"]["optional"]
    spec = optional["attention_precision"]
    assert spec[1]["options"] == ["bf16", "fp8"] and spec[1]["default"] == "bf16"


@pytest.mark.skipif(NO_FP8_KERNEL, reason="a server on a GPU without nvidia-cudnn-frontend: no fp8 kernel")
def test_an_fp8_clip_is_close_to_the_bf16_clip(server):
    prompt = generation(length=LENGTH, prefix="H3/fp8_attention")
    prompt["1"]["inputs"]["weight_dtype"] = "fp16"
    for node in ("8", "9", "10"):
        prompt.pop(node)
    for suffix, precision, seed in (("a", "bf16", 0), ("b", "fp8", 0), ("c", "bf16", 1)):
        settings = dict(prompt["6"]["inputs"], attention_precision=precision)
        prompt[f"6{suffix}"] = {"class_type": "H3AttentionSettings", "inputs": settings}
        sampler = dict(prompt["7"]["inputs"], attention=[f"6{suffix}", 0], seed=seed)
        prompt[f"7{suffix}"] = {"class_type": "H3Sampler", "inputs": sampler}
        prompt[f"8{suffix}"] = {
            "class_type": "H3ProbeKeep",
            "inputs": {"value": [f"7{suffix}", 0], "name": f"fp8_attention_{precision}_{seed}"},
        }
    prompt.pop("7")
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    said = server.log_tail(400)
    assert "window softmax in fp8 (emulated kernel)" in said  # the sampler, before loading
    # as it ran (said once per server process)
    assert "window softmax in fp8 on cpu: the decomposed plan on the emulated kernel" in server.log_path.read_text()
    bf16, fp8, other_seed = (kept(server, f"fp8_attention_{p}_{s}") for p, s in (("bf16", 0), ("fp8", 0), ("bf16", 1)))
    rounding = (fp8 - bf16).norm()
    assert rounding > 0
    # what e4m3 changes is a small part of what another seed changes
    assert rounding < (other_seed - bf16).norm() / 10, (rounding, (other_seed - bf16).norm())


def test_fp8_with_the_flex_backend_is_refused_at_validation(server):
    prompt = generation(length=LENGTH, prefix="H3/fp8_flex")
    prompt["6"]["inputs"].update(window_backend="flex", attention_precision="fp8")
    answer = server.queue(prompt)
    assert "prompt_id" not in answer
    errors = json.dumps(answer["node_errors"])
    assert "attention_precision: 'fp8' runs on window_backend 'auto' or 'decomposed'" in errors, errors
