"""What a ComfyUI server on a GPU does for the pack while it starts, on a thread of its own (``nodes._host``):
the staged reader's page-locked buffers allocated and the libraries' first products and convolutions made, the
compilers' modules imported and Triton's first launch, the dense-attention kernels chosen and the hardware video
encoders probed, each said in the log. On the CPU nothing is compiled and the thread does not start. Either way the
objects alive when the pack is registered are set aside from the host's collections (``nodes._gc``)."""

import os

import pytest

ON_GPU = os.environ.get("H3_COMFY_GPU") == "1"


@pytest.mark.skipif(not ON_GPU, reason="the start thread runs where the compiled paths run: the server on a GPU")
def test_the_start_thread_does_its_work_ahead_and_says_so(server):
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


@pytest.mark.skipif(ON_GPU, reason="the CPU server")
def test_on_the_cpu_the_start_thread_does_not_run(server):
    said = server.log_path.read_text(errors="replace")
    assert "compiled kernels are kept in" in said  # the pack loaded
    assert "objects alive at start-up set aside from the host's garbage collections" in said
    assert "hardware video encoders probed" not in said and "first calls made ahead" not in said
