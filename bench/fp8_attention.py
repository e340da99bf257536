"""What the fp8 window softmax (``attention_precision="fp8"``) costs in accuracy and gains in time, side by side with
the exact bf16 path, in one run.

* ``calls``: the window softmax at the release geometry (102 latent frames × 1008 tokens, 1450 global rows,
  chunk 5, radius 1, anchors both, head_dim 128) on random inputs and on outlier-heavy ones (4 channels of q and
  k ×50): the relative error of bf16 and of fp8 against fp32 attention computed from the window rule on sampled
  rows (``window_attention.reference_rows``), and the milliseconds of each (``--time-heads`` heads); with
  ``--kernels N`` the top N CUDA kernels of one call of each.
* ``block``: the first block of a random-weight model of the released sizes (fp8 linears), its output with the
  fp8 window softmax and with bf16's, each against the same block in fp32 on the same input.
* ``velocity``: one evaluation's velocity (video and audio rows) with fp8 attention against bf16's: cosine and
  relative error.
* ``trajectory``: ``--steps`` steps of the released sampler from one seed on that model, fp8 against bf16: the
  final latents' cosine and relative error, and the seconds of each run.

``--tiny`` runs a small geometry and model on the CPU (the emulated kernel): a dry run of the code.

    python3 bench/fp8_attention.py --out results.json
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import dit_block
import dit_step
import record
import window_attention as wa

from h3_core.attention import SequenceLayout, WindowSpec, window_softmax
from h3_core.attention.fp8 import fp8_kernel_refusals, resolve_fp8_kernel
from h3_core.models.fp8_linear import Fp8Linear, quantize_linears
from h3_core.models.hybrid import RELEASE_WINDOW, HybridContext
from h3_core.pipeline.generate import generate
from h3_core.pipeline.prompt import from_conditioning
from h3_core.pipeline.request import ClipRequest, Runner

TINY_LAYOUT = dict(frames=12, frame_h=4, frame_w=6, text=6, audio=10)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def inputs(layout, heads, kind, device, dtype, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(layout.seq_len, heads, 128 if device.type == "cuda" else 32, generator=gen) for _ in "qkv")
    if kind == "outliers":
        for x in (q, k):
            x[..., :4] *= 50
    return tuple(x.to(device, dtype) for x in (q, k, v))


def bench_calls(layout, window, device, dtype, error_heads, time_heads, reps, kernels=0) -> dict:
    rows = wa.sample_rows(layout, window)
    scale = (128 if device.type == "cuda" else 32) ** -0.5
    result = {"sampled_rows": len(rows), "error_heads": error_heads, "time_heads": time_heads}
    for kind in ("random", "outliers"):
        q, k, v = inputs(layout, error_heads, kind, device, dtype)
        want = wa.reference_rows(q, k, v, layout, window, rows, scale)
        entry = {}
        for precision in ("bf16", "fp8"):
            out = window_softmax(q, k, v, layout, window, backend="decomposed", precision=precision)
            entry[f"{precision}_rel_err_vs_fp32"] = relative(out[rows], want)
            entry[f"{precision}_out"] = out
        entry["fp8_rel_err_vs_bf16"] = relative(entry.pop("fp8_out"), entry.pop("bf16_out"))
        result[kind] = entry
        del q, k, v
    q, k, v = inputs(layout, time_heads, "random", device, dtype)
    for precision in ("bf16", "fp8"):
        runs = []

        def call(precision=precision, runs=runs):
            return window_softmax(
                q, k, v, layout, window, backend="decomposed", precision=precision, on_run=runs.append
            )

        _, stats = wa.timed(call, reps=reps)
        stats.pop("times")
        result[f"{precision}_timing"] = dict(stats, kernel=runs[-1].kernel)
        if kernels and device.type == "cuda":  # where a call's device time goes: the attention kernels and the rest
            result[f"{precision}_kernels"] = dit_block.kernel_table(call, kernels)
    result["speedup"] = result["bf16_timing"]["ms"] / result["fp8_timing"]["ms"]
    return result


def block_input_and_output(model, model_inputs, ctx):
    """The first block's positional and keyword inputs and its output in one evaluation."""
    seen = {}

    def before(module, args, kwargs):
        seen["args"], seen["kwargs"] = args, kwargs

    def after(module, args, kwargs, output):
        seen["out"] = output

    hooks = (
        model.blocks[0].register_forward_pre_hook(before, with_kwargs=True),
        model.blocks[0].register_forward_hook(after, with_kwargs=True),
    )
    try:
        with torch.no_grad():
            velocity = model(*model_inputs, hybrid=ctx)
    finally:
        for hook in hooks:
            hook.remove()
    return seen, velocity


def widened(block: torch.nn.Module) -> torch.nn.Module:
    """A float32 copy of ``block`` whose fp8 linears are plain linears holding the weights their codes stand for."""
    exact = copy.deepcopy(block)
    for parent in list(exact.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Fp8Linear):
                weight = child.dequantized_weight()
                linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=child.bias is not None)
                linear.weight = torch.nn.Parameter(weight, requires_grad=False)
                if child.bias is not None:
                    linear.bias = torch.nn.Parameter(child.bias.float(), requires_grad=False)
                setattr(parent, name, linear)
    return exact.float()


def as_fp32(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    if isinstance(value, (tuple, list)):
        return type(value)(as_fp32(v) for v in value)
    return value


def bench_model(setup, device, dtype, steps) -> dict:
    cfg = setup["cfg"]
    packed, model_inputs = dit_step.request(setup, device)
    model = dit_step.random_model(cfg, device, dtype)
    window = RELEASE_WINDOW if device.type == "cuda" else replace(RELEASE_WINDOW, chunk=2)
    result = {}
    if device.type == "cuda":
        quantize_linears(model, compute_dtype=dtype)
        result["linears"] = "fp8"
    contexts = {
        p: HybridContext(packed.layout, window, "decomposed", (0, setup["text"]), precision=p) for p in ("bf16", "fp8")
    }
    seen = {p: block_input_and_output(model, model_inputs, contexts[p]) for p in contexts}
    block_bf16, block_fp8 = (seen[p][0]["out"] for p in ("bf16", "fp8"))
    block = {
        "fp8_rel_err_vs_bf16": relative(block_fp8, block_bf16),
        "fp8_cosine_vs_bf16": cosine(block_fp8, block_bf16),
    }
    try:  # the same block in fp32 (its linears widened) on the bf16 evaluation's input
        exact = widened(model.blocks[0])
        args, kwargs = (as_fp32(x) for x in (seen["bf16"][0]["args"], seen["bf16"][0]["kwargs"]))
        with torch.no_grad():
            reference = exact(*args, **kwargs)
        del exact
        for p, out in (("bf16", block_bf16), ("fp8", block_fp8)):
            block[f"{p}_rel_err_vs_fp32"] = relative(out, reference)
    except Exception as exc:  # reported, not fatal: the other figures stand
        block["fp32_error"] = f"{type(exc).__name__}: {exc}"
    result["block"] = block
    velocity = {}
    for i, name in enumerate(("video", "audio")):
        a, b = (seen[p][1][i] for p in ("fp8", "bf16"))
        velocity[name] = {"rel_err": relative(a, b), "cosine": cosine(a, b)}
    result["velocity"] = velocity
    del seen
    if steps:
        prompt = from_conditioning(
            torch.randn(1, setup["text"], cfg.text_dim, generator=torch.Generator().manual_seed(1)),
            features=cfg.text_dim,
        )
        size = dict(frames=setup["frames"], width=setup["width"] * 16, height=setup["height"] * 16)
        finals, seconds = {}, {}
        for p in ("bf16", "fp8"):
            start = time.perf_counter()
            with torch.no_grad():
                finals[p] = generate(
                    model,
                    prompt,
                    ClipRequest(**size, steps=steps, seed=0, backend="decomposed", attention_precision=p),
                    Runner(device=device),
                )
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds[p] = time.perf_counter() - start
        result["trajectory"] = {
            "steps": steps,
            "seconds": seconds,
            **{
                name: {
                    "rel_err": relative(finals["fp8"][i], finals["bf16"][i]),
                    "cosine": cosine(finals["fp8"][i], finals["bf16"][i]),
                }
                for i, name in enumerate(("video", "audio"))
            },
        }
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--error-heads", type=int, default=8, help="heads of the error runs (fp32 reference rows)")
    parser.add_argument("--time-heads", type=int, default=56, help="heads of the timed calls (the model's 56)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8, help="sampler steps of the trajectory (0: none)")
    parser.add_argument("--parts", nargs="*", default=["calls", "model"], choices=("calls", "model"))
    parser.add_argument("--kernels", type=int, default=0, help="the top N CUDA kernels of one timed call of each")
    parser.add_argument("--tiny", action="store_true", help="a small geometry and model on the CPU: a dry run")
    parser.add_argument("--out", type=Path, default=None)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    head_dim = 128 if cuda else 32
    result = dict(record.header("fp8_attention.py", argv))
    result["fp8_kernel"] = resolve_fp8_kernel(device, head_dim)
    result["passed_over"] = [list(r) for r in fp8_kernel_refusals(device, head_dim)]
    if "calls" in args.parts:
        if args.tiny:
            layout, window = SequenceLayout.packed(**TINY_LAYOUT), WindowSpec(radius=1, chunk=2, anchors="both")
        else:
            layout, window = wa.release_geometry(), WindowSpec(radius=1, chunk=5, anchors="both")
        heads = (2, 3) if args.tiny else (args.error_heads, args.time_heads)
        result["calls"] = bench_calls(layout, window, device, dtype, *heads, args.reps, args.kernels)
        print("calls", record.write(result["calls"], None), flush=True)
    if "model" in args.parts:
        setup = dit_step.TINY if args.tiny else dit_step.RELEASE
        result["model"] = bench_model(setup, device, dtype, args.steps)
        print("model", record.write(result["model"], None), flush=True)
    if cuda:
        result["median_note"] = f"timings: median of {args.reps} CUDA-event timings after 2 warm-up calls"
    record.write(result, args.out)
    return result


if __name__ == "__main__":
    main()
