"""One small call of each library routine the models run, made once per process ahead of the real ones, and the
dense-attention kernel chosen for each (dtype, head dim) the models attend with.

A process's first call of a cuBLAS product or a cuDNN convolution loads the library's kernels and sets up its
state; a later call at a new shape costs a few milliseconds (``bench/first_calls.py`` measures both). The same
holds for the staged reader's page-locked buffers, allocated once and kept by PyTorch's host allocator. Made on a
thread while a server starts, these calls take that first cost off the first prompt. cuDNN's attention plans are
not among them: PyTorch keeps those per thread and per shape, so only the thread that runs the prompt can make them.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ..formats.staged_read import pin_staging_buffers

__all__ = ["LOADER_CALLS", "choose_attention_kernels", "make_first_calls"]

LOADER_CALLS = ("pinned staging buffers",)  # what the loaders meet, before any model runs
STAGES = ("loaders", "runs")


def _scaled_mm(device):
    a = torch.ones(64, 128, device=device).to(torch.float8_e4m3fn)
    b = torch.ones(128, 128, device=device).to(torch.float8_e4m3fn)
    ones = torch.ones(64, 1, device=device), torch.ones(1, 128, device=device)
    return torch._scaled_mm(a, b.t(), scale_a=ones[0], scale_b=ones[1], out_dtype=torch.bfloat16)


def _calls(device: torch.device) -> dict:
    """The calls by name, in the order a prompt needs them: on a GPU the staged reader's page-locked buffers (the
    loaders'), then the DiT's bf16 and the video decoder's fp16 products, the DiT's fp8 row-scaled product, the
    audio decoder's fp32 convolutions and the linear branch's bf16 depthwise convolution."""
    calls = {"pinned staging buffers": pin_staging_buffers} if device.type == "cuda" else {}
    calls |= {
        "bf16 product": lambda: F.linear(*(torch.ones(64, 128, device=device, dtype=torch.bfloat16) for _ in "xw")),
        "fp16 product": lambda: F.linear(*(torch.ones(64, 128, device=device, dtype=torch.float16) for _ in "xw")),
        "fp32 conv1d": lambda: F.conv1d(torch.ones(1, 8, 64, device=device), torch.ones(8, 8, 3, device=device)),
        "fp32 conv_transpose1d": lambda: F.conv_transpose1d(
            torch.ones(1, 8, 64, device=device), torch.ones(8, 4, 4, device=device), stride=2
        ),
        "bf16 depthwise conv2d": lambda: F.conv2d(
            torch.ones(1, 8, 6, 8, device=device, dtype=torch.bfloat16),
            torch.ones(8, 1, 3, 3, device=device, dtype=torch.bfloat16),
            padding=1,
            groups=8,
        ),
    }
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        calls["fp8 row-scaled product"] = lambda: _scaled_mm(device)
    return calls


def make_first_calls(device: torch.device | str, stage: str | None = None) -> dict[str, float | None]:
    """Make each call once on ``device`` (with ``stage``, only the loaders' calls, ``LOADER_CALLS``, or only the
    models' runs'): seconds per call, None for one that failed (the run that needs it then meets the failure
    itself)."""
    if stage not in (None, *STAGES):
        raise ValueError(f"stage must be None or one of {STAGES}, got {stage!r}")
    device = torch.device(device)
    seconds = {}
    for name, call in _calls(device).items():
        if stage is not None and (name in LOADER_CALLS) != (stage == "loaders"):
            continue
        start = time.perf_counter()
        try:
            with torch.no_grad():
                call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds[name] = time.perf_counter() - start
        except Exception:
            seconds[name] = None
    return seconds


def choose_attention_kernels(device) -> dict[str, str]:
    """Probe now the dense-attention kernel for each (dtype, head dim) the pack's models attend with on ``device``
    (the DiT's windows staged in fp16 and its other calls in bf16, the video decoder's fp16): each probe runs its
    candidates on a small case (``kernels.resolve_kernel``), the first launches a first prompt would otherwise
    pay. Returns the kernel per ``dtype d=head_dim``; a probe that fails is left to the first prompt."""
    from ..attention.kernels import resolve_kernel
    from ..models.dit import DiTConfig
    from ..models.video_vae import VideoVAEConfig

    dit, decoder = DiTConfig().head_dim, VideoVAEConfig().decoder_head_dim
    chosen = {}
    for dtype, head_dim in ((torch.float16, dit), (torch.bfloat16, dit), (torch.float16, decoder)):
        label = f"{str(dtype).removeprefix('torch.')} d={head_dim}"
        try:
            chosen[label] = resolve_kernel(torch.device(device), dtype, head_dim)
        except Exception as exc:  # the first prompt probes it again and reports what fails
            chosen[label] = f"not probed ({type(exc).__name__})"
    return chosen
