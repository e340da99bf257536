"""One DiT block at full size on random weights: the dense H3 block and the VDN-H3 hybrid block side by
side in one run, at the release geometry (T2VA, 102 latent frames of 48×84, 300 text rows, 575 audio
latents per channel: T = 104,266 rows), bf16.

Reports per block: the median of ``--reps`` CUDA-event timings of one forward after warm-up, the peak GPU
memory above the weights and inputs, and which window backend ran. ``--tiny`` runs the same code on a
small model and geometry (a dry run that works on the CPU).

    python3 bench/dit_block.py --out results.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record
from device_idle import idle_table

from h3_core.models.dit import Block, DiTConfig, rope_cos_sin, rope_inv_freq
from h3_core.models.fp8_linear import quantize_linears
from h3_core.models.hybrid import RELEASE_WINDOW, HybridContext
from h3_core.models.low_memory import LowMemory
from h3_core.models.run_options import RunOptions, check_run_options
from h3_core.pipeline.packing import pack_sequence

GiB = record.GiB
RELEASE = dict(cfg=DiTConfig(), text=300, frames=102, height=48, width=84, audio=575)
TINY = dict(
    cfg=DiTConfig(hidden=64, layers=1, heads=2, head_dim=32, ffn=96, time_embed=16, rope_freqs=4),
    text=6,
    frames=12,
    height=4,
    width=6,
    audio=10,
)


def inputs(setup, device, dtype):
    cfg = setup["cfg"]
    packed = pack_sequence(
        torch.ones(setup["text"], dtype=torch.long), setup["frames"], setup["height"], setup["width"], setup["audio"]
    )
    g = torch.Generator().manual_seed(0)
    T = packed.positions.shape[0]
    x = torch.randn(T, cfg.hidden, generator=g).to(device, dtype)
    temb = torch.randn(2, cfg.time_embed, generator=g).to(device, torch.float32)
    rows = packed.tags.clone()  # timestep 0 for every row: table rows 0..2
    rope = rope_cos_sin(packed.positions.to(device), rope_inv_freq(cfg).to(device))
    return packed, x, temb, rows.to(device), rope


def build(cfg, device, dtype):
    with torch.device(device):
        block = Block(cfg).to(dtype)
    g = torch.Generator(device="cpu").manual_seed(1)
    with torch.no_grad():
        for p in block.parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_((torch.randn(p.shape, generator=g) / fan_in**0.5).to(p.dtype))
    return block.eval()


def timed(fn, reps):
    """The median and spread of ``reps`` timings of ``fn`` after a warm-up (``record.event_times_ms``), and the
    device memory one call holds at its peak above what was allocated before it."""
    cuda = torch.cuda.is_available()
    fn()
    if cuda:
        torch.cuda.synchronize()
    times = record.event_times_ms(fn, reps, cuda)
    _, peak = record.peak_gib(fn, cuda)
    return dict(ms=statistics.median(times), spread_ms=max(times) - min(times), extra_peak_gib=peak)


class SectionClock:
    """Device time spent inside chosen modules and functions during one forward (CUDA events, or the
    wall clock on the CPU). Nested sections are reported as measured; ``split`` turns them into disjoint
    shares of the block."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks, self.handles, self.patched = cuda, [], [], []

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _elapsed(self, start, stop):
        return start.elapsed_time(stop) if self.cuda else (stop - start) * 1e3

    def module(self, name, module):
        open_marks = []
        self.handles.append(module.register_forward_pre_hook(lambda m, a: open_marks.append(self._mark())))
        self.handles.append(
            module.register_forward_hook(lambda m, a, o: self.marks.append((name, open_marks.pop(), self._mark())))
        )

    def function(self, name, owner, attr, when=None):
        """Time the calls of ``owner.attr`` (those for which ``when(*args)`` holds, if given) as ``name``."""
        real = getattr(owner, attr)

        def timed_call(*args, **kwargs):
            if when is not None and not when(*args):
                return real(*args, **kwargs)
            start = self._mark()
            out = real(*args, **kwargs)
            self.marks.append((name, start, self._mark()))
            return out

        setattr(owner, attr, timed_call)
        self.patched.append((owner, attr, real))

    def close(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        for handle in self.handles:
            handle.remove()
        for owner, attr, real in self.patched:
            setattr(owner, attr, real)
        totals: dict[str, float] = {}
        for name, start, stop in self.marks:
            totals[name] = totals.get(name, 0.0) + self._elapsed(start, stop)
        return totals


MODULATION = "AdaLN table, norm and modulation"


def time_modulation(clock: SectionClock, blocks) -> None:
    """The AdaLN table, the pre-norms and the modulation of ``blocks`` as one section: the plain path's norm
    modules and ``modulate_``, or the fused ``norm_modulate``."""
    import h3_core.models.block_fused as fused_module
    import h3_core.models.block_ops as ops_module

    for block in blocks:
        for module in (block.adaln_proj, block.norm1, block.norm2):
            clock.module(MODULATION, module)
    clock.function(MODULATION, ops_module, "modulate_")
    clock.function(MODULATION, fused_module, "run", when=lambda mode, name, *args: name == "norm_modulate")


def time_linears(clock: SectionClock, blocks) -> None:
    """The blocks' linear layers as one section: the q, k, v projections (with the fp8 rows' quantisation;
    ``Attention.project`` calls the layer's rows, not its forward), out_proj, the FFN pair, and in hybrid
    blocks to_out_linear and the softmax gate. The fp8 FFN's fused SiLU·up + quantisation stays elementwise."""
    import h3_core.models.dit as dit_module

    for block in blocks:
        attn = block.attn
        layers = [attn.out_proj, block.mlp.fc1, block.mlp.fc2]
        if hasattr(attn, "to_out_linear"):
            layers += [attn.to_out_linear, attn.softmax_gate]
        for layer in layers:
            clock.module("linears", layer)
    clock.function("linears", dit_module.Attention, "projection_input")
    clock.function("linears", dit_module.Attention, "project")


def profile_block(block, run, cuda: bool) -> dict:
    """Split one forward into linears, window (or dense) attention, linear branch, AdaLN table + norm +
    modulation, and the rest."""
    import h3_core.models.dit as dit_module
    import h3_core.models.hybrid as hybrid_module

    clock = SectionClock(cuda)
    attn = block.attn
    if hasattr(attn, "linear_attention"):
        clock.module("linear branch", attn.linear_attention)
        clock.function("linear branch", type(attn.linear_attention), "text_state")
    time_linears(clock, [block])
    time_modulation(clock, [block])
    clock.function("attention kernel", hybrid_module, "window_softmax")
    clock.function("attention kernel", dit_module, "dense_attention")
    clock.module("whole block", block)
    parts = SectionClock(cuda)  # inside the branch, on its own clock: these nest in "linear branch"
    if hasattr(attn, "linear_attention"):
        import h3_core.models.branch_fused as fused_module
        import h3_core.models.branch_ops as ops_module
        import h3_core.models.linear_branch as branch_module

        # the plain features and statistics: the text state's (the branch module's) and the frames' (its ops')
        for module in (branch_module, ops_module):
            parts.function("featurize", module, "featurize_keys_values")
            parts.function("frame_statistics", module, "frame_statistics")
        parts.function("featurize", ops_module, "featurize_queries")
        parts.function("solve", branch_module, "solve_shifted")
        for name in ("scan", "gather"):  # the branch calls both through branch_fused, plain or fused
            parts.function(name, fused_module, name)
        parts.function("featurize", fused_module, "spatial_conv")
        parts.function("frame_statistics", fused_module, "shifted_statistics")
        parts.function("fused features and readout", fused_module, "run")
    run()
    times = clock.close()
    branch_parts = parts.close()
    whole = times.pop("whole block")
    times["elementwise and the rest"] = whole - sum(times.values())
    result = dict(total_ms=whole, sections_ms={k: round(v, 2) for k, v in times.items()})
    if branch_parts:
        branch_parts["readout and the rest"] = times.get("linear branch", 0.0) - sum(branch_parts.values())
        result["linear_branch_ms"] = {k: round(v, 2) for k, v in branch_parts.items()}
    return result


def kernel_table(run, top: int) -> list[dict]:
    """The ``top`` CUDA kernels of one forward by their total device time: name (cut to 110 characters),
    calls and milliseconds; the last row sums the kernels left out."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    rows = [
        dict(kernel=e.key[:110], calls=e.count, ms=e.self_device_time_total / 1e3)
        for e in prof.key_averages()
        if e.self_device_time_total > 0
    ]
    rows.sort(key=lambda r: -r["ms"])
    rest = rows[top:]
    rows = [dict(r, ms=round(r["ms"], 3)) for r in rows[:top]]
    rows.append(
        dict(
            kernel=f"{len(rest)} other kernels",
            calls=sum(r["calls"] for r in rest),
            ms=round(sum(r["ms"] for r in rest), 3),
        )
    )
    return rows


def copy_table(run, top: int) -> list[dict]:
    """One forward's copies: ``aten::copy_`` grouped by input shapes, with calls and device milliseconds,
    largest first. (Grouping by Python call site as well gave empty stacks on the H200 runs, so the shapes
    are what tells the copies apart.)"""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        run()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        ms = getattr(e, "device_time_total", 0) / 1e3
        if e.key == "aten::copy_" and ms > 0:
            rows.append(dict(shapes=str(e.input_shapes)[:160], calls=e.count, ms=round(ms, 3)))
    rows.sort(key=lambda r: -r["ms"])
    return rows[:top]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--profile", action="store_true", help="split one forward of each block into sections")
    parser.add_argument("--ffn-chunk-rows", type=int, default=None, help="the FFN over this many rows at a time")
    parser.add_argument(
        "--head-groups", type=int, default=1, help="attention and linear branch in this many head groups"
    )
    parser.add_argument(
        "--branch-frames", type=int, default=None, help="the branch's fp32 statistics this many frames at a time"
    )
    parser.add_argument(
        "--fused-branch",
        default=None,
        choices=("compiled",),
        help="the linear branch's per-element work fused (h3_core.models.branch_fused)",
    )
    parser.add_argument(
        "--fused-blocks",
        default=None,
        choices=("compiled",),
        help="every block's per-element work fused, the branch's too (h3_core.models.block_fused)",
    )
    parser.add_argument("--fp8", action="store_true", help="fp8 linears (quantize_linears) in each block")
    parser.add_argument("--blocks", nargs="*", default=["dense", "hybrid"], choices=("dense", "hybrid"))
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        help="list this many CUDA kernels of one forward by time, and as many of its copies by shape",
    )
    parser.add_argument(
        "--idle",
        type=int,
        default=0,
        help="one forward's device idle time by launch site, and this many of its longest gaps",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    setup = TINY if args.tiny else RELEASE
    packed, x, temb, rows, rope = inputs(setup, device, dtype)
    result = dict(
        record.header("dit_block.py", argv),
        rows=int(x.shape[0]),
        dtype=str(dtype),
        ffn_chunk_rows=args.ffn_chunk_rows,
        head_groups=args.head_groups,
        fused_branch=args.fused_branch,
        fused_blocks=args.fused_blocks,
        fp8=args.fp8,
        blocks={},
    )
    window = RELEASE_WINDOW if not args.tiny else replace(RELEASE_WINDOW, chunk=2)
    runs = []  # what each window softmax ran
    context = HybridContext(packed.layout, window, args.backend, (0, setup["text"]), runs.append)
    for name in args.blocks:
        hybrid = name == "hybrid"
        block = build(replace(setup["cfg"], hybrid=hybrid), device, dtype)
        if args.fp8:
            quantize_linears(block)
        low_memory = LowMemory(args.ffn_chunk_rows, args.head_groups, args.branch_frames)
        options = RunOptions(branches_fused=args.fused_branch).with_low_memory(low_memory)
        if args.fused_blocks:
            options = options.fused(args.fused_blocks)  # the blocks and their branches
        check_run_options(options, block)
        ctx = context if hybrid else None
        with torch.no_grad():
            out = block(x, temb, rows, rope, ctx, run=options)
            stats = timed(lambda: block(x, temb, rows, rope, ctx, run=options), args.reps)
        stats["finite"] = bool(torch.isfinite(out).all())
        stats["weights_gib"] = sum(p.numel() * p.element_size() for p in block.parameters()) / GiB
        if hybrid:
            stats["window_backend"] = runs[-1].backend
        if args.profile:
            with torch.no_grad():
                stats["profile"] = profile_block(
                    block, lambda: block(x, temb, rows, rope, ctx, run=options), device.type == "cuda"
                )
        if args.kernels and device.type == "cuda":
            with torch.no_grad():
                stats["kernels"] = kernel_table(lambda: block(x, temb, rows, rope, ctx, run=options), args.kernels)
                stats["copies"] = copy_table(lambda: block(x, temb, rows, rope, ctx, run=options), args.kernels)
        if args.idle and device.type == "cuda":
            with torch.no_grad():
                stats["idle"] = idle_table(lambda: block(x, temb, rows, rope, ctx, run=options), args.idle)
        result["blocks"][name] = stats
        block = out = None  # freed before the next variant
    text = record.write(result, args.out, indent=2)
    print(text)
    return result


if __name__ == "__main__":
    main()
