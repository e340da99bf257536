"""What a process pays the first time it calls each kind of GPU work the nodes run, apart from Triton (whose
first launch ``bench/first_launch.py`` times): the pack's dense attention (the kernel the start thread chooses)
at the DiT's head size in fp16 and bf16 and at the video decoder's in fp16, the matrix products (bf16 and fp16
``F.linear``, the fp8 row-scaled ``torch._scaled_mm``) and the convolutions (the audio decoder's fp32 ``conv1d``
and ``conv_transpose1d``, the linear branch's bf16 depthwise ``conv2d``), each first at one shape, then again at
it, then at shapes it has not run yet, and the staged reader's page-locked slabs allocated. Separates the
once-per-process costs (libraries, handles) a server's start could pay ahead from the once-per-shape ones that
only the run itself knows the shapes for.

Run in a new process for every repetition (``--processes``), each timing with the device synchronised around
every call, nothing else on the GPU. ``--with-warm-thread`` runs as many processes again, each first doing on
another thread what a server's start thread does with the libraries (``pipeline.first_library_calls``: the
attention kernels chosen, one small product and convolution of each kind): what of a first call that thread takes
off the thread that runs the prompt (the cuDNN attention plans are kept per thread in PyTorch).
``--with-same-shapes-thread`` runs as many processes again, each first making, on another thread, that work and
then every timed call at the very shapes this thread then times: whether what cuDNN builds for a shape on one
thread (its plan per thread, any kernel it compiles or loads for the process) shortens the same shape's first call
on another.

    python3 bench/first_calls.py --processes 2 --with-warm-thread --with-same-shapes-thread \
        --out bench/results/first_calls.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import record

# rows of the attention calls: the first, the same again, then new lengths (a window's rows vary with the canvas)
ATTENTION_ROWS = (4096, 4096, 6144, 12288, 24576)
# (rows, in, out) of the products: the first, the same again, then new shapes
PRODUCT_SHAPES = ((8192, 7168, 7168), (8192, 7168, 7168), (12288, 7168, 21504), (20000, 7168, 7168))
TINY_ROWS, TINY_SHAPES = (64, 64, 96, 128), ((64, 96, 96), (64, 96, 96), (96, 96, 160), (80, 96, 96))
# (channels, kernel, dilation, length) of the audio decoder's fp32 convolutions: the first, the same again, then
# new ones (its stages change channels, kernel and dilation)
CONV1D_SHAPES = ((512, 3, 1, 8000), (512, 3, 1, 8000), (512, 7, 3, 8000), (256, 11, 5, 16000), (64, 3, 1, 256000))
TINY_CONV1D = ((8, 3, 1, 64), (8, 3, 1, 64), (8, 7, 3, 64), (4, 11, 5, 128), (4, 3, 1, 256))
# (channels, height, width) of the linear branch's depthwise 2-D convolution in bf16
DEPTHWISE_SHAPES = ((7168, 48, 84), (7168, 48, 84), (7168, 40, 72))
TINY_DEPTHWISE = ((16, 6, 8), (16, 6, 8), (16, 5, 7))


def _timed(fn, device, *args, **kwargs) -> float:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn(*args, **kwargs)
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def one_process(device: torch.device, tiny: bool, warm_thread: bool = False, same_shapes: bool = False) -> dict:
    """The timings of this process (it must not have touched the GPU before). ``warm_thread``: first make every
    kind of call once at the small shapes on a thread of its own (as a server's start thread could), then time
    this thread's calls; ``same_shapes``: that thread also makes every timed call first, at the same shapes."""
    import threading

    out = {"context_s": _timed(lambda: torch.empty(1, device=device), device)}
    if warm_thread or same_shapes:

        def work():
            _start_thread_work(device)
            if same_shapes:
                _calls(device, tiny)

        start = time.perf_counter()
        thread = threading.Thread(target=work, name="warm")
        thread.start()
        thread.join()
        out["warm_thread_s"] = time.perf_counter() - start
    out.update(_calls(device, tiny))
    out["pinned_slabs"] = _pinned_slabs(device, tiny)
    return out


def _start_thread_work(device: torch.device) -> None:
    """What the pack's warm-up thread does with the libraries (``nodes._host.warm_up``, at the first H3 prompt)."""
    from h3_core.pipeline.first_library_calls import choose_attention_kernels, make_first_calls

    make_first_calls(device)
    choose_attention_kernels(device)


def _pinned_slabs(device: torch.device, tiny: bool) -> dict:
    """The staged reader's page-locked slabs (``staged_read``: two buffers and the read-ahead's slabs) allocated the
    first time in this process, then again once freed (PyTorch's host allocator keeps them)."""
    from h3_core.formats import staged_read

    slabs = 2 + staged_read.AHEAD_SLABS
    nbytes = (1 << 20) if tiny else staged_read.CHUNK_BYTES
    pin = device.type == "cuda"
    timings = {}
    for label in ("first_s", "again_s"):
        start = time.perf_counter()
        buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(slabs)]
        timings[label] = time.perf_counter() - start
        del buffers
    return dict(slabs=slabs, bytes=nbytes, **timings)


def _calls(device: torch.device, tiny: bool) -> dict:
    import torch.nn.functional as F

    from h3_core.attention.kernels import dense_attention, resolve_kernel
    from h3_core.models.dit import DiTConfig
    from h3_core.models.video_vae import VideoVAEConfig

    attention_rows, product_shapes = (TINY_ROWS, TINY_SHAPES) if tiny else (ATTENTION_ROWS, PRODUCT_SHAPES)
    conv1d_shapes, depthwise_shapes = (TINY_CONV1D, TINY_DEPTHWISE) if tiny else (CONV1D_SHAPES, DEPTHWISE_SHAPES)
    out = {}
    dit, vae = DiTConfig(), VideoVAEConfig()
    attention = {}
    for label, dtype, heads, head_dim in (
        ("dit_fp16", torch.float16, dit.heads, dit.head_dim),
        ("dit_bf16", torch.bfloat16, dit.heads, dit.head_dim),
        ("decoder_fp16", torch.float16, vae.decoder_heads, vae.decoder_head_dim),
    ):
        start = time.perf_counter()
        kernel = resolve_kernel(device, dtype, head_dim)
        chosen = time.perf_counter() - start
        calls = []
        for rows in attention_rows:
            q, k, v = (torch.randn(1, rows, heads, head_dim, device=device, dtype=dtype) for _ in range(3))
            calls.append(dict(rows=rows, seconds=_timed(dense_attention, device, q, k, v)))
        attention[label] = dict(kernel=kernel, choose_s=chosen, calls=calls)
    out["attention"] = attention
    products = {}
    for label, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16 if device.type == "cuda" else torch.float32)):
        calls = []
        for rows, n_in, n_out in product_shapes:
            x = torch.randn(rows, n_in, device=device, dtype=dtype)
            w = torch.randn(n_out, n_in, device=device, dtype=dtype)
            calls.append(dict(shape=[rows, n_in, n_out], seconds=_timed(F.linear, device, x, w)))
        products[label] = calls
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        calls = []
        for rows, n_in, n_out in product_shapes:
            a = torch.randn(rows, n_in, device=device).to(torch.float8_e4m3fn)
            b = torch.randn(n_out, n_in, device=device).to(torch.float8_e4m3fn)
            sa = torch.ones(rows, 1, device=device)
            sb = torch.ones(1, n_out, device=device)
            calls.append(
                dict(
                    shape=[rows, n_in, n_out],
                    seconds=_timed(
                        torch._scaled_mm, device, a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16
                    ),
                )
            )
        products["fp8_rowwise"] = calls
    out["products"] = products
    convolutions = {"conv1d_fp32": [], "conv_transpose1d_fp32": [], "depthwise_conv2d_bf16": []}
    for channels, kernel, dilation, length in conv1d_shapes:
        x = torch.randn(1, channels, length, device=device)
        w = torch.randn(channels, channels, kernel, device=device)
        seconds = _timed(F.conv1d, device, x, w, padding=(kernel * dilation - dilation) // 2, dilation=dilation)
        convolutions["conv1d_fp32"].append(dict(shape=[channels, kernel, dilation, length], seconds=seconds))
        up = torch.randn(channels, channels // 2, 4, device=device)
        seconds = _timed(F.conv_transpose1d, device, x, up, stride=2, padding=1)
        convolutions["conv_transpose1d_fp32"].append(dict(shape=[channels, 4, 2, length], seconds=seconds))
    depthwise_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for channels, height, width in depthwise_shapes:
        x = torch.randn(1, channels, height, width, device=device, dtype=depthwise_dtype)
        w = torch.randn(channels, 1, 3, 3, device=device, dtype=depthwise_dtype)
        seconds = _timed(F.conv2d, device, x, w, padding=1, groups=channels)
        convolutions["depthwise_conv2d_bf16"].append(dict(shape=[channels, height, width], seconds=seconds))
    out["convolutions"] = convolutions
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="small shapes (a dry run on the CPU)")
    parser.add_argument(
        "--with-warm-thread",
        action="store_true",
        help="as many processes again, each making every kind of call once at small shapes on another thread first",
    )
    parser.add_argument(
        "--with-same-shapes-thread",
        action="store_true",
        help="as many processes again, each making every timed call on another thread first, at the same shapes",
    )
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: print its timings
    parser.add_argument("--warm-thread", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--same-shapes-thread", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.one:
        print(json.dumps(one_process(device, args.tiny, args.warm_thread, args.same_shapes_thread)))
        return {}
    result = record.header("first_calls.py", argv)
    child = [sys.executable, __file__, "--one", "--device", args.device, *(["--tiny"] if args.tiny else [])]
    variants = {"runs": child} | ({"runs_warm_thread": [*child, "--warm-thread"]} if args.with_warm_thread else {})
    if args.with_same_shapes_thread:
        variants["runs_same_shapes_thread"] = [*child, "--same-shapes-thread"]
    for key, command in variants.items():
        result[key] = []
        for _ in range(args.processes):
            answer = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT).stdout
            result[key].append(json.loads(answer.strip().splitlines()[-1]))
            print(key, json.dumps(result[key][-1]), flush=True)
    return record.finish(result, args.out, False)


if __name__ == "__main__":
    main()
