"""One model evaluation of the full-size DiT (random weights of the released shapes and dtypes; timings do
not depend on the values) at 345 frames, 1344×768, T2VA: seconds, peak GiB, the memory model's prediction
and where the time goes, for each variant in one process.

Variants: ``dense-bf16`` (plain H3), ``bf16-decomposed``, ``bf16-flex``, ``fp8-decomposed``, ``fp8-flex``
(VDN-H3 with the release window; fp8 = the fp8 linears of ``h3_core.models.fp8_linear``). The variants run in
that order, whatever the order asked: the model is quantised in place for the first fp8 one.
``--attention-precision bf16 fp8`` runs each VDN-H3 variant with the exact and the fp8 window softmax.
``--low-memory G:R`` runs attention and the branch in G head groups and the FFN over R rows at a time.
``--cap-gib`` (one variant) lets the memory model plan for that much device memory (``plan_for_memory``:
lower-memory paths, AdaLN projections in host memory, block streaming), applies the plan and then limits the
process to the cap (``torch.cuda.set_per_process_memory_fraction``). ``--tiny`` runs a tiny model on the CPU
(a dry run of the code).
``--gpus N`` runs every evaluation across N ranks (``h3_core.parallel``: plain Ulysses, or with
``--softmax-ranks n`` VDN-H3's branch split), one process per rank started here, or by ``torchrun
--nproc-per-node N`` (then ``--gpus`` is not needed); each rank's seconds, peak and the seconds one evaluation
spends in the collectives (``ranks.timed_collectives``) are gathered and written by rank 0. ``--fake-ranks P
--fake-rank r ...`` runs rank r's share of an evaluation across P ranks alone on this device (torch's fake process
group: the collectives move nothing), one rank after the other: each rank's peak memory and its own work, on one
GPU, for layouts of more GPUs than the machine has.

    python3 bench/dit_step.py --out results.json
    python3 bench/dit_step.py --variants fp8-decomposed --fused-blocks compiled --gpus 8 --softmax-ranks 6 \
        --out multi.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # dit_block's helpers, also when this file is loaded from elsewhere
import dit_block
import ranks
import record
from device_idle import idle_table

from h3_core.attention.window import PRECISIONS
from h3_core.formats.meta_shapes import cast_as_loaded
from h3_core.memory.apply import apply_plan
from h3_core.memory.predict import BlockShape, ModelForm, evaluation_peak, plan_for_memory
from h3_core.models.adaln_tables import prepare_adaln_tables
from h3_core.models.dit import DiTConfig, H3DiT, rope_inv_freq
from h3_core.models.fp8_linear import quantize_linears
from h3_core.models.hybrid import RELEASE_WINDOW, HybridContext
from h3_core.models.low_memory import LowMemory
from h3_core.models.precision import keeps_fp32
from h3_core.models.run_options import RunOptions, check_run_options
from h3_core.parallel import SequenceShards
from h3_core.pipeline.geometry import audio_latents, latent_frames
from h3_core.pipeline.noise import row_timesteps
from h3_core.pipeline.packing import pack_sequence

GiB = record.GiB
CAP_USABLE = 0.95  # of a cap, what the plan may fill: the rest is the allocator's slack
VARIANTS = ("dense-bf16", "bf16-decomposed", "bf16-flex", "fp8-decomposed", "fp8-flex")
RELEASE = dict(cfg=DiTConfig(hybrid=True), text=300, height=48, width=84, frames=345)
TINY = dict(
    cfg=DiTConfig(
        hidden=64,
        layers=2,
        heads=2,
        head_dim=32,
        ffn=96,
        text_dim=40,
        freq_dim=16,
        time_hidden=32,
        time_embed=16,
        rope_freqs=4,
        hybrid=True,
    ),
    text=6,
    height=4,
    width=6,
    frames=73,
)


def random_model(cfg: DiTConfig, device, dtype) -> H3DiT:
    """The released layout on ``device`` with no host round trip: built on meta, cast (fp32 islands kept),
    allocated on the device and filled with N(0, 1/fan_in)."""
    with torch.device("meta"):
        model = H3DiT(cfg)
    cast_as_loaded(model, dtype, keeps_fp32)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.normal_(0, fan_in**-0.5)
        model.rope.inv_freq.copy_(rope_inv_freq(cfg).to(device))
    return model.eval()


def request(setup, device):
    """The packed T2VA request and the model's inputs at the first step (t = 0 for every generated row)."""
    cfg = setup["cfg"]
    packed = pack_sequence(
        torch.ones(setup["text"], dtype=torch.long),
        latent_frames(setup["frames"]),
        setup["height"],
        setup["width"],
        audio_latents(setup["frames"]),
    )
    g = torch.Generator().manual_seed(0)
    timesteps, index = row_timesteps(packed, 0.0, 0.0)
    inputs = (
        torch.randn(packed.video_index.numel(), cfg.video_row, generator=g).to(device),
        torch.randn(packed.audio_index.numel(), cfg.audio_channels, generator=g).to(device),
        torch.randn(setup["text"], cfg.text_dim, generator=g).to(device),
        timesteps.to(device),
        index.to(device),
        *packed.model_inputs(device),
    )
    return packed, inputs


def evaluate(model, inputs, ctx, run: RunOptions, reps: int, cuda: bool, first_profile: int = 0) -> dict:
    """Seconds of ``reps`` evaluations, each given ``run`` (``RunOptions``), after a warm-up
    (``record.event_times_ms``: median and spread), the warm-up's own wall seconds (the first evaluation of the
    process: compilation, or loading it from the caches, included; with ``first_profile`` its that many top
    functions), the device's peak over the timed evaluations (weights included) and whether the warm-up's outputs
    are finite."""

    def warm_up():  # kernel probes, masks, compiled shapes
        out = model(*inputs, hybrid=ctx, run=run)
        if cuda:
            torch.cuda.synchronize()
        return out

    with torch.no_grad():
        if first_profile:
            out, first_s, first = record.profiled(warm_up, first_profile)
        else:
            start, first = time.perf_counter(), None
            out = warm_up()
            first_s = time.perf_counter() - start
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = [ms / 1e3 for ms in record.event_times_ms(lambda: model(*inputs, hybrid=ctx, run=run), reps, cuda)]
    peak = torch.cuda.max_memory_allocated() / GiB if cuda else None
    stats = dict(
        seconds=statistics.median(times),
        spread_s=max(times) - min(times),
        first_s=first_s,
        peak_gib=peak,
        finite=bool(torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all()),
    )
    if first is not None:
        stats["first_profile"] = first
    return stats


def profile(model, inputs, ctx, run: RunOptions, cuda: bool) -> dict:
    """Seconds of one evaluation given ``run`` (``RunOptions``) in linears, attention kernels, the linear branch,
    the AdaLN tables with the blocks' norms and modulation, and the rest."""
    import h3_core.models.dit as dit_module
    import h3_core.models.hybrid as hybrid_module

    clock = dit_block.SectionClock(cuda)
    dit_block.time_linears(clock, model.blocks)
    branches = [block.attn.linear_attention for block in model.blocks if hasattr(block.attn, "linear_attention")]
    for branch in branches:
        clock.module("linear branch", branch)
    if branches:
        clock.function("linear branch", type(branches[0]), "text_state")
    dit_block.time_modulation(clock, model.blocks)
    clock.function("attention kernel", hybrid_module, "window_softmax")
    clock.function("attention kernel", dit_module, "dense_attention")
    clock.module("whole evaluation", model)
    with torch.no_grad():
        model(*inputs, hybrid=ctx, run=run)
    times = clock.close()
    whole = times.pop("whole evaluation")
    times["elementwise and the rest"] = whole - sum(times.values())
    return {name: round(ms / 1e3, 3) for name, ms in times.items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--low-memory", default="1:0", help="G:R = head groups : FFN chunk rows (0: none)")
    parser.add_argument("--cap-gib", type=float, default=None, help="limit this process to that much device memory")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--first-profile", type=int, default=0, help="the first evaluation's top functions (cProfile), this many"
    )
    parser.add_argument(
        "--idle",
        type=int,
        default=0,
        help="one evaluation's device idle time by launch site, and this many of its longest gaps",
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
    parser.add_argument(
        "--attention-precision",
        nargs="*",
        default=["bf16"],
        choices=PRECISIONS,
        help="the window softmax's precision; several: each hybrid variant once per choice",
    )
    parser.add_argument("--gpus", type=int, default=1, help="ranks to run each evaluation across (one per GPU)")
    parser.add_argument(
        "--softmax-ranks", type=int, default=0, help="with --gpus: VDN-H3's branch split, n softmax ranks (0: none)"
    )
    parser.add_argument(
        "--fake-ranks", type=int, default=0, help="one rank's share of an evaluation across this many ranks, alone"
    )
    parser.add_argument("--fake-rank", type=int, nargs="+", default=[0], help="with --fake-ranks: the ranks to run")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: a dry run of the code")
    parser.add_argument("--out", type=Path, default=None)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.gpus > 1 and not ranks.launched():
        if args.cap_gib is not None or args.profile or args.idle or args.first_profile:
            parser.error("--gpus runs plain timings: leave out --cap-gib, --profile, --idle and --first-profile")
        ranks.launch(args.gpus, main, argv)
        return json.loads(args.out.read_text()) if args.out else {}
    spread = ranks.launched()
    device = ranks.join(cuda) if spread else torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.cap_gib is not None and len(args.variants) != 1:
        parser.error("--cap-gib plans for one variant at a time: name exactly one with --variants")
    setup = TINY if args.tiny else RELEASE
    cfg = setup["cfg"]
    groups, rows = (int(part) for part in args.low_memory.split(":"))
    options = LowMemory(ffn_chunk_rows=rows or None, head_groups=groups)
    packed, inputs = request(setup, device)
    shape = BlockShape.of(cfg, packed, dtype)
    window = RELEASE_WINDOW if not args.tiny else replace(RELEASE_WINDOW, chunk=2)
    result = dict(
        record.header("dit_step.py", argv),
        rows=shape.rows,
        low_memory=args.low_memory,
        cap_gib=args.cap_gib,
        fused_branch=args.fused_branch,
        fused_blocks=args.fused_blocks,
        alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        variants={},
    )
    model = random_model(cfg, device, dtype)
    run = RunOptions(branches_fused=args.fused_branch).with_low_memory(options)
    if args.fused_blocks:
        run = run.fused(args.fused_blocks)  # the blocks and their branches
    check_run_options(run, model)
    fused = args.fused_blocks is not None  # the memory model knows fused blocks, not the fused branch alone
    quantised = False
    ordered = sorted(set(args.variants), key=VARIANTS.index)  # bf16 before fp8, whatever the order asked
    simulated = args.fake_ranks > 1
    if simulated and (spread or args.cap_gib is not None):
        parser.error("--fake-ranks runs one process alone: leave out --gpus and --cap-gib")
    precisions = list(dict.fromkeys(args.attention_precision))
    runs_of = [
        (v, p, r)
        for v in ordered
        for p in (precisions if not v.startswith("dense") else ["bf16"])
        for r in (args.fake_rank if simulated else [None])
    ]
    for variant, precision, fake_rank in runs_of:
        key = variant
        if precision != "bf16":
            key += f"/attention-{precision}"
        if fake_rank is not None:
            key += f"/rank{fake_rank}-of-{args.fake_ranks}"
            ranks.join_fake(fake_rank, args.fake_ranks)
        hybrid = not variant.startswith("dense")
        linears = "fp8" if variant.startswith("fp8") else "dtype"
        if linears == "fp8" and not quantised:
            quantize_linears(model, compute_dtype=dtype)
            quantised = True
            if cuda:
                torch.cuda.empty_cache()
        backend = variant.split("-")[-1] if hybrid else None
        runs = []  # what each window softmax ran
        ctx = None
        if hybrid:
            ctx = HybridContext(packed.layout, window, backend, (0, setup["text"]), runs.append, precision=precision)
        if spread or simulated:
            ctx = SequenceShards.of(shape.rows, cfg.heads, inner=ctx, softmax_ranks=args.softmax_ranks if hybrid else 0)
        plan = None
        if args.cap_gib is not None:
            form = ModelForm(cfg, hybrid=hybrid, dtype=dtype, linears=linears, fused=fused)
            plan = plan_for_memory(form, shape, args.cap_gib * GiB * CAP_USABLE, steps=1)
            fitted = apply_plan(model, plan, device)
            if plan.options != LowMemory():  # the plan's lower-memory paths in place of --low-memory's
                run = check_run_options(run.with_low_memory(plan.options), model)
            if plan.adaln_on_host:
                prepare_adaln_tables(model, [inputs[3]], device)
            result["plan"] = dict(said=fitted.said, steps=list(plan.steps), resident_blocks=plan.resident_blocks)
            if cuda:
                torch.cuda.empty_cache()
                total = torch.cuda.get_device_properties(device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GiB / total))
        before = torch.cuda.memory_allocated() / GiB if cuda else None  # the weights as placed, and the inputs
        try:
            stats = evaluate(model, inputs, ctx, run, args.reps, cuda, args.first_profile)
            stats["allocated_before_gib"] = before
            if hybrid:
                stats["window_backend"] = runs[-1].backend if runs else None  # a branch rank runs none
                stats["window_kernel"] = runs[-1].kernel if runs else None
                stats["attention_precision"] = precision
            # Weights counted as loaded: the branch's parameters are on the device in every variant here.
            if plan is not None:
                predicted = plan.predicted
            else:
                form = ModelForm(
                    cfg, hybrid=hybrid, dtype=dtype, linears=linears, fused=fused, attention_precision=precision
                )
                predicted = evaluation_peak(form, shape, options)
            if simulated:
                stats["rows"] = ctx.mine.stop - ctx.mine.start
            elif not spread:  # the memory model is one process's
                stats["predicted_gib"] = {k: v / GiB for k, v in predicted.items()}
            else:
                exchanged = []
                with torch.no_grad(), ranks.timed_collectives(cuda, exchanged):
                    model(*inputs, hybrid=ctx, run=run)
                stats["collectives_s"], stats["collectives"] = sum(exchanged), len(exchanged)
            if args.profile:
                stats["profile_s"] = profile(model, inputs, ctx, run, cuda)
            if args.idle and cuda:
                with torch.no_grad():
                    stats["idle"] = idle_table(lambda: model(*inputs, hybrid=ctx, run=run), args.idle)
        except torch.OutOfMemoryError as exc:
            stats = dict(error=f"out of memory: {str(exc).splitlines()[0]}", allocated_before_gib=before)
        if spread:  # every rank's figures, in rank order, on every rank
            per_rank = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(per_rank, stats)
            stats = dict(ranks=per_rank, seconds=max(r.get("seconds", float("inf")) for r in per_rank))
        result["variants"][key] = stats
        print(key, json.dumps(stats), flush=True)
        if fake_rank is not None:
            torch.distributed.destroy_process_group()
        if cuda:
            torch.cuda.empty_cache()
    if simulated:
        result.update(fake_ranks=args.fake_ranks, softmax_ranks=args.softmax_ranks)
    if spread:
        result.update(gpus=torch.distributed.get_world_size(), softmax_ranks=args.softmax_ranks)
        rank = torch.distributed.get_rank()
        torch.distributed.destroy_process_group()
        if rank != 0:
            return result
    record.write(result, args.out)
    return result


if __name__ == "__main__":
    main()
