"""ComfyUI's quantised files through the nodes in a real ComfyUI server: an int8_convrot DiT and video VAE and an
int8_convrot or nvfp4_awq single-file text encoder, each written from the tiny random models by comfy-kitchen's
own quantiser (``tests/tiny_checkpoints.py``). Where comfy-kitchen has no kernels for the host's device (the
CPU)
every quantised layer is dequantised on load with one line saying so, and the clip is, frame for frame, the one
the same workflow makes from files holding comfy-kitchen's own dequantisation of those layers. Where it has
kernels (a GPU), the int8 layers stay comfy-kitchen layers, the line says so, and the clip differs from the
dequantised one only by the int8 rounding of the activations. A LoRA on the int8 DiT patches its layers as the
host loads it (dequantised, patched and quantised afresh by comfy-kitchen where the layers are kept) and comes off
again: the plain clip returns exactly."""

import os

import av
import numpy as np
import pytest
import torch
from comfy_host import error_message, mp4_files
from graphs import generation
from test_host_loras import lora_files, with_loras
from tiny_checkpoints import (
    INT8_CONVROT_FILES,
    TINY_TEXT_ENCODER_FILE,
    write_tiny_quantized_checkpoints,
    write_tiny_quantized_text_encoder_file,
)

ON_GPU = os.environ.get("H3_COMFY_GPU") == "1"


def dequantised(name: str) -> str:
    return name.replace(".safetensors", "_dequantised.safetensors")


def text_encoder(kind: str) -> str:
    return TINY_TEXT_ENCODER_FILE.replace(".safetensors", f"_{kind}.safetensors")


@pytest.fixture(scope="module")
def files(server):
    """The quantised files (and the dequantised copies) in the server's model folders, in the dtypes the nodes
    read them in on this device, so that on the CPU the copies hold exactly the weights the loaders make."""
    vae_dtype = torch.float16 if ON_GPU else torch.float32
    write_tiny_quantized_checkpoints(server.models, dequantised={"dit": torch.bfloat16, "video_vae": vae_dtype})
    write_tiny_quantized_text_encoder_file(
        server.models, "int8_convrot", dequantised=torch.bfloat16 if ON_GPU else torch.float32
    )
    write_tiny_quantized_text_encoder_file(server.models, "nvfp4_awq")
    return server


def workflow(dit: str, video_vae: str, text_encoder_name: str, prefix: str) -> dict:
    prompt = generation(length=22, prefix=prefix, dit=dit, video_vae=video_vae)
    prompt["4"]["inputs"]["text_encoder_name"] = text_encoder_name
    return prompt


def clip(server, prompt) -> np.ndarray:
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    (path,) = mp4_files(entry, server.output)
    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]).astype(np.float64)


def test_int8_convrot_dit_video_vae_and_text_encoder(files):
    server = files
    log_start = len(server.log_path.read_text())
    quantised = clip(
        server,
        workflow(
            INT8_CONVROT_FILES["dit"], INT8_CONVROT_FILES["video_vae"], text_encoder("int8_convrot"), "H3/int8_convrot"
        ),
    )
    said = server.log_path.read_text()[log_start:]
    for name, layers in (
        (INT8_CONVROT_FILES["dit"], 8),
        (INT8_CONVROT_FILES["video_vae"], 4),
        (text_encoder("int8_convrot"), None),
    ):
        line = next((line for line in said.splitlines() if f"{name}: " in line and "int8_convrot" in line), None)
        assert line is not None, f"no line about {name}:\n{said[-3000:]}"
        if layers is not None:
            assert f"int8_convrot ({layers} layers)" in line, line
        if ON_GPU and name != text_encoder("int8_convrot"):
            assert "kept quantised as comfy-kitchen layers for cuda" in line, line
        elif not ON_GPU:
            assert "dequantised on load" in line and "no int8_convrot kernels for cpu" in line, line
    reference = clip(
        server,
        workflow(
            dequantised(INT8_CONVROT_FILES["dit"]),
            dequantised(INT8_CONVROT_FILES["video_vae"]),
            dequantised(text_encoder("int8_convrot")),
            "H3/int8_convrot_dequantised",
        ),
    )
    assert quantised.shape == reference.shape
    if ON_GPU:
        # int8 activations through three models of random weights, then 8-bit video: close (often equal once
        # rounded to 8 bits; the log lines above say the layers were kept)
        difference = np.abs(quantised - reference).mean()
        assert difference < 0.25 * reference.std(), (difference, reference.std())
    else:
        assert np.array_equal(quantised, reference)


def test_nvfp4_awq_text_encoder(files):
    server = files
    log_start = len(server.log_path.read_text())
    frames = clip(
        server,
        workflow(
            dequantised(INT8_CONVROT_FILES["dit"]),
            dequantised(INT8_CONVROT_FILES["video_vae"]),
            text_encoder("nvfp4_awq"),
            "H3/nvfp4_awq",
        ),
    )
    said = server.log_path.read_text()[log_start:]
    assert any(f"{text_encoder('nvfp4_awq')}: " in line and "nvfp4" in line for line in said.splitlines()), said[-3000:]
    assert frames.shape[0] == 22 and np.isfinite(frames).all()


def test_a_lora_on_the_int8_convrot_dit(files):
    server = files
    lora_files(server)
    chain = [("style.safetensors", 0.8), ("motion.safetensors", 0.8)]
    base = workflow(
        INT8_CONVROT_FILES["dit"], INT8_CONVROT_FILES["video_vae"], text_encoder("int8_convrot"), "H3/int8_lora_plain"
    )
    plain = clip(server, base)
    patched = clip(server, with_loras(base, *chain))
    reference = clip(
        server,
        with_loras(
            workflow(
                dequantised(INT8_CONVROT_FILES["dit"]),
                dequantised(INT8_CONVROT_FILES["video_vae"]),
                dequantised(text_encoder("int8_convrot")),
                "H3/int8_lora_dequantised",
            ),
            *chain,
        ),
    )
    assert not np.array_equal(patched, plain)
    if ON_GPU:
        difference = np.abs(patched - reference).mean()
        assert difference < 0.25 * reference.std(), (difference, reference.std())
    else:
        assert np.array_equal(patched, reference)
    assert np.array_equal(clip(server, base), plain)  # the LoRAs taken off: the file's own weights again
