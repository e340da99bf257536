"""Window softmax at the VDN-H3 release geometry, every variant side by side in one run.

Geometry (PERFORMANCE.md): 102 latent frames × 1008 tokens (24×42), 1450 global rows (300 text + 1150
audio), chunk 5, radius 1, anchors both, head_dim 128, bf16. T = 104,266 rows.

Variants: the dense kernel over all pairs (the ceiling), FlexAttention (Triton; FLASH when flash-attn-4
is importable), the published decomposed scheme (dense leg + varlen over gathered K/V copies; kept here
for comparison only), and ours (``window_softmax(backend="decomposed")``). Each reports the median of 7
CUDA-event timings after warm-up, TFLOP/s on kept pairs, extra peak GiB measured warm (the one-time
mask/plan build is timed separately as "first call"), and the relative error against an fp32
reference on sampled rows.

    python bench/window_attention.py --heads 56 7 --out results.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

from h3_core.attention import (
    SequenceLayout,
    WindowSpec,
    dense_attention,
    force_kernel,
    resolve_kernel,
    window_flex,
    window_softmax,
)
from h3_core.attention.layout import anchor_frames, clamped_window, window_bounds
from h3_core.attention.window_decomposed import window_softmax_decomposed


def release_geometry(frames=102, frame_h=24, frame_w=42, text=300, audio=1150):
    return SequenceLayout.packed(frames=frames, frame_h=frame_h, frame_w=frame_w, text=text, audio=audio)


def key_frames(layout, window, frame):
    """Frames whose rows video query ``frame`` keeps, or None when it keeps every row."""
    F = layout.num_frames
    anchors = anchor_frames(F)
    if window.anchor_rows and frame in anchors:
        return None
    lo, hi = clamped_window(window_bounds(F, window.radius, window.chunk)[frame], F)
    frames = set(range(lo, hi + 1))
    if window.anchor_columns:
        frames.update(anchors)
    return sorted(frames)


def kept_pairs(layout, window) -> int:
    T, G, S = layout.seq_len, layout.num_global_rows, layout.tokens_per_frame
    total = G * T
    for f in range(layout.num_frames):
        frames = key_frames(layout, window, f)
        total += S * (T if frames is None else G + S * len(frames))
    return total


def key_mask(layout, window, row, device):
    keep = torch.zeros(layout.seq_len, dtype=torch.bool, device=device)
    if not (layout.video_start <= row < layout.video_stop):
        keep[:] = True
        return keep
    frames = key_frames(layout, window, (row - layout.video_start) // layout.tokens_per_frame)
    if frames is None:
        keep[:] = True
        return keep
    for a, b in layout.global_ranges():
        keep[a:b] = True
    for f in frames:
        a, b = layout.frame_rows(f)
        keep[a:b] = True
    return keep


def sample_rows(layout, window, count=192, seed=0):
    gen = torch.Generator().manual_seed(seed)
    F, S, v0 = layout.num_frames, layout.tokens_per_frame, layout.video_start
    picks = set(torch.randint(0, layout.seq_len, (count,), generator=gen).tolist())
    # Always include global rows, both anchor frames, edge chunks and a few interior frames.
    for a, b in layout.global_ranges():
        picks.update({a, b - 1})
    for f in {0, 1, 4, 5, 9, 10, F // 2, F - 3, F - 2, F - 1}:
        if 0 <= f < F:
            picks.update({v0 + f * S, v0 + f * S + S // 2, v0 + f * S + S - 1})
    return sorted(picks)


def reference_rows(q, k, v, layout, window, rows, scale):
    """fp32 window attention for the sampled query rows, computed directly from the rule."""
    kf, vf = k.float(), v.float()
    out = []
    for r in rows:
        keep = key_mask(layout, window, r, q.device)
        s = torch.einsum("hd,thd->ht", q[r].float(), kf[keep]) * scale
        out.append(torch.einsum("ht,thd->hd", torch.softmax(s, -1), vf[keep]))
    return torch.stack(out)


def published_decomposed(layout, window, device):
    """The published scheme: dense leg + one varlen call over K/V rows gathered (copied) per window group."""
    F, G = layout.num_frames, torch.cat([torch.arange(a, b) for a, b in layout.global_ranges()])
    anchors = anchor_frames(F)
    dense_frames = [f for f in anchors if window.anchor_rows]
    dense_q = torch.cat([G] + [torch.arange(*layout.frame_rows(f)) for f in dense_frames])
    groups: dict = {}
    for f in range(F):
        if f in dense_frames:
            continue
        groups.setdefault(tuple(key_frames(layout, window, f)), []).append(f)
    win_q, kv, cu_q, cu_k, max_q, max_k = [], [], [0], [0], 0, 0
    for frames, qf in groups.items():
        rows_q = torch.cat([torch.arange(*layout.frame_rows(f)) for f in qf])
        rows_k = torch.cat([G] + [torch.arange(*layout.frame_rows(f)) for f in frames])
        win_q.append(rows_q)
        kv.append(rows_k)
        cu_q.append(cu_q[-1] + len(rows_q))
        cu_k.append(cu_k[-1] + len(rows_k))
        max_q, max_k = max(max_q, len(rows_q)), max(max_k, len(rows_k))
    to = lambda x, dt=torch.int64: x.to(device=device, dtype=dt)  # noqa: E731
    plan = dict(
        dense_q=to(dense_q),
        win_q=to(torch.cat(win_q)),
        kv=to(torch.cat(kv)),
        cu_q=to(torch.tensor(cu_q), torch.int32),
        cu_k=to(torch.tensor(cu_k), torch.int32),
        max_q=max_q,
        max_k=max_k,
    )
    fa4 = None
    if importlib.util.find_spec("flash_attn") and importlib.util.find_spec("flash_attn.cute"):
        from flash_attn.cute import flash_attn_varlen_func as fa4

    def run(q, k, v, scale):
        out = torch.empty_like(q)
        with force_kernel("cudnn"):
            out[plan["dense_q"]] = dense_attention(q[plan["dense_q"]], k, v, scale=scale).out
        qw, kw, vw = q[plan["win_q"]], k[plan["kv"]], v[plan["kv"]]
        if fa4 is not None:
            o = fa4(
                qw,
                kw,
                vw,
                cu_seqlens_q=plan["cu_q"],
                cu_seqlens_k=plan["cu_k"],
                max_seqlen_q=plan["max_q"],
                max_seqlen_k=plan["max_k"],
                softmax_scale=scale,
            )[0]
        else:
            from torch.nn.attention.varlen import varlen_attn

            o = varlen_attn(qw, kw, vw, plan["cu_q"], plan["cu_k"], plan["max_q"], plan["max_k"], scale=scale)
        out[plan["win_q"]] = o
        return out

    return run, ("FA4 varlen" if fa4 is not None else "torch varlen (FA2)")


def timed(fn, reps=7, warmup=2):
    """(output, stats): the first call's wall time, then ``reps`` timings after ``warmup`` calls
    (``record.event_times_ms``: CUDA events on a GPU, the wall clock on the CPU, where the script only dry-runs)
    and the extra device memory of one warm call (``record.peak_gib``; 0 on the CPU)."""
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    first_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        fn()
    times = record.event_times_ms(fn, reps, cuda)
    out, peak = record.peak_gib(fn, cuda)
    return out, dict(
        ms=statistics.median(times),
        spread_ms=max(times) - min(times),
        first_ms=first_ms,
        extra_peak_gib=peak or 0.0,
        times=times,
    )


def environment(argv) -> dict:
    """``record.header`` and the versions of Triton, flash-attn-4 (None when not installed) and the driver."""
    info = record.header("window_attention.py", argv)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        info["flash_attn_4"] = version("flash-attn-4")
    except Exception:
        info["flash_attn_4"] = None
    try:
        info["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except Exception:
        pass
    return info


def bench_heads(heads, layout, window, variants, reps):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    T, D = layout.seq_len, 128
    gen = torch.Generator(device=device).manual_seed(heads)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(T, heads, D, device=device, dtype=dtype, generator=gen) for _ in range(3))
    scale = D**-0.5
    rows = sample_rows(layout, window)
    ref = reference_rows(q, k, v, layout, window, rows, scale)
    kept, all_pairs = kept_pairs(layout, window), T * T
    fa4 = window_flex.FLEX.flash_usable(device)
    results = []

    def measure(name, kernel, fn, pairs=kept, check=True):
        if variants and not any(name.startswith(x) for x in variants):
            return
        try:
            out, m = timed(fn, reps=reps)
        except Exception as exc:  # keep going: one failing variant must not hide the others
            results.append(dict(variant=name, kernel=kernel, error=f"{type(exc).__name__}: {exc}"[:400]))
            print(f"[{heads} heads] {name}: FAILED {exc}", flush=True)
            torch.cuda.empty_cache()
            return
        if check:
            got = out[rows].float()
            m["rel_err"] = ((got - ref).norm() / ref.norm()).item()
            m["finite"] = bool(torch.isfinite(out).all())
        m["tflops"] = 4 * pairs * heads * D / (m["ms"] * 1e-3) / 1e12
        results.append(dict(variant=name, kernel=kernel, **m))
        print(
            f"[{heads} heads] {name} ({kernel}): {m['ms']:.1f} ms, {m['tflops']:.0f} TF/s, "
            f"+{m['extra_peak_gib']:.2f} GiB, err {m.get('rel_err', float('nan')):.2e}",
            flush=True,
        )
        del out
        torch.cuda.empty_cache()

    dense_kernel = resolve_kernel(device, q.dtype, D)
    cudnn_ok = device.type == "cuda"
    measure(
        "dense over all pairs",
        dense_kernel,
        lambda: dense_attention(q, k, v, scale=scale).out,
        pairs=all_pairs,
        check=False,
    )
    if cudnn_ok and dense_kernel != "cudnn":
        with force_kernel("cudnn"):
            measure(
                "dense over all pairs",
                "cudnn",
                lambda: dense_attention(q, k, v, scale=scale).out,
                pairs=all_pairs,
                check=False,
            )
    pinned = {"triton": window_flex.FlexKernel("triton"), "flash": window_flex.FlexKernel("flash")}
    measure(
        "flex block mask",
        "triton",
        lambda: window_flex.window_softmax_flex(q, k, v, layout, window, scale, pinned["triton"]),
    )
    if fa4:
        measure(
            "flex block mask",
            "FLASH (FA4)",
            lambda: window_flex.window_softmax_flex(q, k, v, layout, window, scale, pinned["flash"]),
        )
    run_pub, pub_kernel = published_decomposed(layout, window, device)
    if cudnn_ok:
        measure("published decomposed", f"cudnn + {pub_kernel}", lambda: run_pub(q, k, v, scale))

    def ours(**options):
        return lambda: window_softmax_decomposed(q, k, v, layout, window, scale, **options)

    runs = []
    measure(
        "ours decomposed",
        f"{dense_kernel}, default (staged)",
        lambda: window_softmax(q, k, v, layout, window, backend="decomposed", on_run=runs.append),
    )
    assert runs[-1].backend == "decomposed"
    if cudnn_ok:
        measure(
            "ours decomposed", f"{dense_kernel}, staged in {q.dtype}".replace("torch.", ""), ours(stage_dtype=q.dtype)
        )
    if cudnn_ok and dense_kernel != "cudnn":
        with force_kernel("cudnn"):
            measure(
                "ours decomposed",
                "cudnn, default (staged)",
                lambda: window_softmax(q, k, v, layout, window, backend="decomposed"),
            )
    q = k = v = None  # the inputs freed
    torch.cuda.empty_cache()
    return dict(
        heads=heads, seq_len=T, kept_pairs=kept, kept_fraction=kept / all_pairs, sampled_rows=len(rows), results=results
    )


def table(run):
    flex = next((r for r in run["results"] if r["variant"] == "flex block mask" and "ms" in r), None)
    lines = [
        f"### {run['heads']} heads (T = {run['seq_len']:,}, kept {run['kept_fraction']:.1%} of pairs, "
        f"error on {run['sampled_rows']} sampled rows)",
        "",
        "| variant | kernel | ms | × flex (Triton) | TFLOP/s | extra peak GiB | first call ms | rel err vs fp32 |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in run["results"]:
        if "ms" not in r:
            lines.append(f"| {r['variant']} | {r['kernel']} | failed: {r['error'][:120]} | | | | | |")
            continue
        ratio = f"{r['ms'] / flex['ms']:.2f}" if flex else "—"
        err = f"{r['rel_err']:.2e}" if "rel_err" in r else "—"
        lines.append(
            f"| {r['variant']} | {r['kernel']} | {r['ms']:.1f} | {ratio} | {r['tflops']:.0f} | "
            f"{r['extra_peak_gib']:.2f} | {r['first_ms']:.0f} | {err} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, nargs="+", default=[56, 7])
    parser.add_argument("--variants", nargs="*", default=None, help="name prefixes to run (default: all)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=None, help="write the JSON results here")
    parser.add_argument("--smoke", action="store_true", help="a small geometry, to check the script itself")
    args = parser.parse_args(argv)
    layout = release_geometry(frames=22, frame_h=8, frame_w=12, text=30, audio=40) if args.smoke else release_geometry()
    window = WindowSpec(radius=1, chunk=5, anchors="both")
    report = environment(argv)
    print(json.dumps(report), flush=True)
    report["runs"] = [bench_heads(h, layout, window, args.variants, args.reps) for h in args.heads]
    report["markdown"] = "\n\n".join(table(r) for r in report["runs"])
    record.write(report, args.out)
    print(report["markdown"])
    return report


if __name__ == "__main__":
    main()
