"""The video decoder's transformer on one batch of tiles at the release geometry (4 tiles of 7×16×16 latents +
5 suffix tokens = 1797 tokens each, 36 blocks of width 2048, random fp16 weights), per way of running its blocks:

* ``eager``: the blocks' halves as written (``EAGER_BLOCKS``);
* ``compiled``: the halves through ``torch.compile`` (``compiled_decoder_blocks``);
* ``triton``: the halves' per-element work as hand-written Triton passes (``triton_decoder_blocks``, what the nodes
  run on CUDA);
* ``compiled-graph``: the same batch captured once in a CUDA graph and replayed (no launches, no guards);
* ``autotune``: the halves compiled with ``mode="max-autotune-no-cudagraphs"`` (inductor's Triton GEMM
  templates beside cuBLAS, pointwise epilogues fused into the chosen GEMM);
* ``autotune-split``: as ``autotune`` with ``w1`` as two GEMMs (gate, up) so that ``silu(gate)·up`` can sit in
  the second one's epilogue.

Per path: milliseconds per batch (median of ``--reps`` after a warm-up), the first call's seconds, and the
largest difference from the eager output relative to its largest value. Then each of the decoder's GEMMs alone
(cuBLAS, as ``F.linear`` runs them) in ms and TFLOP/s, and the attention call; and, with ``--first-call``, the
first call of the compiled path in new processes (the compile caches filled by this one).

    python3 bench/decoder_paths.py --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record
from vae_decode import random_video_vae

from h3_core.models import video_vae
from h3_core.models.video_vae import EAGER_BLOCKS, VideoVAEConfig, compiled_decoder_blocks, triton_decoder_blocks


def finish_split(x, attn, out_w, out_b, scale1, norm2_w, w1_w, w1_b, w2_w, w2_b, scale2, eps: float):
    """``block_finish`` with ``w1`` run as its gate and up halves (same arithmetic per element)."""
    B, H, T, D = attn.shape
    x = x + F.linear(attn.transpose(1, 2).reshape(B, T, H * D), out_w, out_b).float() * scale1
    h = F.rms_norm(x, (x.shape[-1],), norm2_w, eps).to(w1_w.dtype)
    hidden = w1_w.shape[0] // 2
    gate = F.linear(h, w1_w[:hidden], w1_b[:hidden])
    up = F.linear(h, w1_w[hidden:], w1_b[hidden:])
    return x + F.linear(F.silu(gate) * up, w2_w, w2_b).float() * scale2


def paths(names):
    made = {}
    for name in names:
        if name == "eager":
            made[name] = EAGER_BLOCKS
        elif name in ("compiled", "compiled-graph"):
            made[name] = compiled_decoder_blocks()
        elif name == "triton":
            made[name] = triton_decoder_blocks(torch.device("cuda"))
        elif name == "autotune":
            made[name] = {
                k: torch.compile(fn, dynamic=False, mode="max-autotune-no-cudagraphs") for k, fn in EAGER_BLOCKS.items()
            }
        elif name == "autotune-split":
            made[name] = {
                "attention_inputs": torch.compile(
                    EAGER_BLOCKS["attention_inputs"], dynamic=False, mode="max-autotune-no-cudagraphs"
                ),
                "finish": torch.compile(finish_split, dynamic=False, mode="max-autotune-no-cudagraphs"),
            }
        else:
            raise SystemExit(f"unknown path {name!r}")
    return made


def median_ms(fn, reps):
    return statistics.median(record.event_times_ms(fn, reps, True))


def gemm_table(M, cfg, reps, quack=False):
    dim, hidden = cfg.decoder_dim, cfg.decoder_dim * cfg.ffn_mult
    out_px = 3 * cfg.temporal_ratio * cfg.spatial_ratio**2
    shapes = {
        "to_qkv": (dim, 3 * dim, torch.float16),
        "to_out": (dim, dim, torch.float16),
        "w1 (gate|up)": (dim, 2 * hidden, torch.float16),
        "w2": (hidden, dim, torch.float16),
        "proj_out fp32": (dim, out_px, torch.float32),
    }
    rows = []
    for name, (k, n, dtype) in shapes.items():
        x = torch.randn(M, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
        b = torch.randn(n, device="cuda", dtype=dtype)
        F.linear(x, w, b)
        ms = median_ms(lambda: F.linear(x, w, b), reps)
        rows.append(dict(gemm=name, m=M, k=k, n=n, dtype=str(dtype), ms=ms, tflops=2 * M * k * n / ms / 1e9))
        if dtype == torch.float32:
            torch.backends.cuda.matmul.allow_tf32 = True
            ms = median_ms(lambda: F.linear(x, w, b), reps)
            torch.backends.cuda.matmul.allow_tf32 = False
            rows.append(
                dict(gemm=name + " (TF32)", m=M, k=k, n=n, dtype="tf32", ms=ms, tflops=2 * M * k * n / ms / 1e9)
            )
    if quack:
        rows += quack_table(M, shapes, hidden, reps)
    swiglu_in = torch.randn(M, 2 * hidden, device="cuda", dtype=torch.float16)
    swiglu = torch.compile(lambda t: F.silu(t[:, :hidden]) * t[:, hidden:])
    swiglu(swiglu_in)
    rows.append(dict(gemm="silu(gate)·up alone (compiled)", m=M, ms=median_ms(lambda: swiglu(swiglu_in), reps)))
    return rows


def quack_table(M, shapes, hidden, reps):
    """The fp16 GEMMs through quack-kernels' Hopper GEMM (default config, then autotuned), and ``w1`` with
    ``silu(gate)·up`` in its epilogue (the [gate | up] weight as it is stored)."""
    from quack.gemm_interface import gemm, gemm_act

    rows = []
    for name, (k, n, dtype) in shapes.items():
        if dtype != torch.float16:
            continue
        x = torch.randn(M, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
        b = torch.randn(n, device="cuda", dtype=dtype)
        want = F.linear(x, w, b).float()
        calls = {"quack gemm": lambda tuned: gemm(x, w.T, bias=b, tuned=tuned)}
        if n == 2 * hidden:
            gated = F.silu(want[:, :hidden]) * want[:, hidden:]
            calls["quack gemm_act swiglu"] = lambda tuned: gemm_act(
                x, w.T, bias=b, activation="swiglu", store_preact=False, concat_layout=("B", "bias"), tuned=tuned
            )[1]
        for label, call in calls.items():
            for tuned in (False, True):
                row = dict(gemm=f"{name}: {label}{' (tuned)' if tuned else ''}", m=M, k=k, n=n)
                try:
                    t0 = time.perf_counter()
                    got = call(tuned).float()
                    torch.cuda.synchronize()
                    row["first_s"] = time.perf_counter() - t0
                    ref = gated if "swiglu" in label else want
                    row["max_rel_diff"] = float((got - ref).abs().max() / ref.abs().max())
                    row["ms"] = median_ms(lambda: call(tuned), reps)
                    row["tflops"] = 2 * M * k * n / row["ms"] / 1e9
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(row, flush=True)
                rows.append(row)
    return rows


def first_call(path: str) -> dict:
    """In this (new) process: the seconds of the first batch through ``path`` and of the second."""
    cfg = VideoVAEConfig()
    vae = random_video_vae(torch.device("cuda"))
    z = torch.randn(4, cfg.latent_channels, 7, 16, 16, device="cuda")
    blocks = paths([path])[path]
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            vae.decoder(z, None, blocks)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return dict(path=path, first_s=times[0], second_s=times[1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--paths", nargs="*", default=["eager", "compiled", "compiled-graph", "autotune", "autotune-split"]
    )
    parser.add_argument("--tiles", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--first-call", nargs="*", default=[], help="paths whose first call runs in new processes")
    parser.add_argument(
        "--precompile", action="store_true", help="the first calls also with dynamo's traced frames cached"
    )
    parser.add_argument("--quack", action="store_true", help="also quack-kernels' GEMMs (where it is installed)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decoder_paths.py times the decoder on a GPU: run it where CUDA is available")
    if args.child:
        print(record.write(first_call(args.child), None))
        return {}
    torch.backends.cuda.matmul.allow_tf32 = False
    report = dict(record.header("decoder_paths.py", argv), tiles=args.tiles, paths=[], gemms=[], first_calls=[])
    cfg = VideoVAEConfig()
    vae = random_video_vae(torch.device("cuda"))
    z = torch.randn(args.tiles, cfg.latent_channels, 7, 16, 16, device="cuda")
    tokens = 7 * 16 * 16 + cfg.register_tokens + 1
    reference = None
    for name, blocks in paths(args.paths).items():
        row = dict(path=name)
        try:
            with torch.no_grad():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = vae.decoder(z, None, blocks)
                torch.cuda.synchronize()
                row["first_s"] = time.perf_counter() - t0
                run = lambda: vae.decoder(z, None, blocks)  # noqa: E731
                if name == "compiled-graph":
                    for _ in range(2):
                        run()
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        out = run()
                    graph.replay()
                    run = graph.replay
                row["ms"] = median_ms(run, args.reps)
                row["window_s"] = row["ms"] * 7 / 1e3  # 28 tiles per window, 20 windows per clip below
                row["clip_blocks_s"] = row["ms"] * 7 * 20 / 1e3
                if reference is None and name == "eager":
                    reference = out.float().clone()
                if reference is not None:
                    row["max_rel_diff_vs_eager"] = float((out.float() - reference).abs().max() / reference.abs().max())
                row["finite"] = bool(torch.isfinite(out).all())
        except Exception as exc:  # one failing path must not hide the others
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        print(row, flush=True)
        report["paths"].append(row)
    with torch.no_grad():
        report["gemms"] = gemm_table(args.tiles * tokens, cfg, args.reps, args.quack)
        q = torch.randn(args.tiles, cfg.decoder_heads, tokens, cfg.decoder_head_dim, device="cuda", dtype=torch.float16)
        ms = median_ms(lambda: video_vae.vae_attention(q, q, q, component="video_vae"), args.reps)
        report["gemms"].append(dict(gemm="attention (auto backend)", m=args.tiles * tokens, ms=ms))
    for row in report["gemms"]:
        print(row, flush=True)
    # each path's first call in a new process: twice plain (this process filled the caches), then twice with
    # dynamo's traced frames cached too (the first of those fills that cache)
    for name in args.first_call:
        for precompile in ("0", "0", "1", "1") if args.precompile else ("0", "0"):
            env = dict(os.environ, TORCH_CACHING_PRECOMPILE=precompile)
            done = subprocess.run(
                [sys.executable, __file__, "--child", name], capture_output=True, text=True, env=env, timeout=300
            )
            text = done.stdout.strip()
            try:
                row = json.loads(text[text.index("{") :])
            except ValueError:
                row = dict(path=name, error=(done.stderr or text)[-600:])
            row["TORCH_CACHING_PRECOMPILE"] = precompile
            print(row, flush=True)
            report["first_calls"].append(row)
    return record.finish(report, args.out, True)


if __name__ == "__main__":
    main()
