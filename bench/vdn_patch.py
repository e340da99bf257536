"""One model evaluation of VDN-H3 two ways, holding the same weights, side by side in one process: the pack's own
VDN-H3 DiT (``H3DiT``) and the host's native H3 model (the re-derived ``tests/native_h3_protocol.MiniMaxH3Model``)
whose blocks are replaced by the H3 VDN-H3 Patch's ``NativeVDN.block_patch``, as the node sets them.

Variants: ``pack`` (plain), ``pack-branch-fused`` (the linear branch fused, the blocks' own parts plain: what the
patch can fuse, since the rest of a native block is the host's), ``pack-fused`` (every fused form, as the pack's own
sampler runs it, ``policy.fuse_for``) and ``native`` (the patch with ``compile="auto"``, the node's default: the
branch fused and compiled on CUDA with Triton; the q/k norm and rotation by comfy-kitchen's ``rms_rope_split_half``
where it imports, as the host calls it, else the plain form); with ``--host-compile`` also
``native-blocks-compiled``: the same with each native block under ``torch.compile``, as a compile node after the patch
runs it.

Release geometry (345 frames: 102 latent frames of 48x84 latents, 1008 rows a frame, 575 audio latents per
channel, 300 text rows) with ``--layers`` blocks of the released width (the full 50 do not fit twice, nor once
with the activations, on an 80 GB card). The weights are random (``dit_step.random_model``, made on the device)
and held once: the native model and its branch file's modules are built on meta and take the pack model's
tensors (``load_state_dict(assign=True)``). Each variant warmed up once, then timed ``--reps`` times (wall clock
between device synchronisations), in turns, each variant first in one repetition of four; each variant's device
peak over its timed evaluations (weights included); after the warm-up, how far the native model's video (and
audio) velocity is from each of the pack's, relative to the pack's largest (and, as a yardstick of the rounding,
how far the pack's fused paths are from its plain one). ``attention_parts``: block 0's attention alone, on the
inputs the warm-up gave it, ``--reps`` timed calls each: the pack's in its plain and branch-fused forms, the
patch's with the norm/rotation the node uses and with the plain one.
The native model runs under ``torch.device`` (its tensors are made without a device, as the host's are on its
own default device). ``--tiny``: the tiny model of ``tests/unit/test_native_patch.py`` on the CPU in fp32 (a dry
run; the fused forms then run eager, as written, ``tests/fused_eager.py``: ``fuse_for`` chooses none off CUDA).

    python3 bench/vdn_patch.py --layers 8 --out vdn_patch.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # the re-derived native model
sys.path.insert(0, str(ROOT / "tests" / "unit"))  # the tiny model's sizes
import dit_step
import record
import tiny_dit
from fused_eager import EAGER, mode_for
from native_h3_protocol import audio_to_rows, native_for, shifted_sigma, split_pack_state, to_rows

from h3_core.formats.vdn import BranchWeights
from h3_core.memory.policy import fuse_for
from h3_core.models.dit import DiTConfig
from h3_core.models.hybrid import RELEASE_WINDOW, HybridContext
from h3_core.models.native_hybrid import NativeAttentionSource, NativeHybridSettings, NativeVDN, kitchen_norm_rope
from h3_core.models.run_options import PLAIN, RunOptions
from h3_core.pipeline.geometry import audio_latents, latent_frames
from h3_core.pipeline.noise import row_timesteps
from h3_core.pipeline.packing import pack_sequence

GiB = record.GiB
VARIANTS = ("pack", "pack-branch-fused", "pack-fused", "native")
PACK_FORMS = VARIANTS[:3]
# the patched native model with each block under torch.compile (inductor, dynamic=False), as block-wise compile nodes
# compile a native model: a way to fuse the parts of the host's blocks the patch leaves alone. (Compiling the whole
# model, as the host's TorchCompileModel does, stops here in the re-derived model's layout code, which makes its
# position tables under the device context: dynamo mixes devices there, eager does not.)
HOST_COMPILED = "native-blocks-compiled"
# the native model against each form of the pack's; the pack's fused forms against its plain one, as a yardstick of
# the rounding
COMPARED = (
    ("native", "pack"),
    ("native", "pack-branch-fused"),
    ("native", "pack-fused"),
    ("pack-branch-fused", "pack"),
    ("pack-fused", "pack"),
)
TINY_CFG = replace(tiny_dit.CFG, hybrid=True)  # tests/unit/test_native_patch.py's


def geometry(args) -> dict:
    if args.tiny:
        return dict(cfg=TINY_CFG, text=args.text or 5, latent_t=12, height=2, width=4, audio_t=7)
    cfg = DiTConfig(hybrid=True)
    frames = latent_frames(args.frames)
    return dict(
        cfg=cfg, text=args.text or 300, latent_t=frames, height=48, width=84, audio_t=audio_latents(args.frames)
    )


def native_twin(pack, cfg: DiTConfig):
    """The native model and the branch file's modules (``BranchWeights``, as the file names them) holding the pack
    model's tensors themselves: built on meta, the tensors assigned."""
    with torch.device("meta"):
        native, branch = native_for(cfg), BranchWeights(cfg)
    native_state, branch_state = split_pack_state(pack.state_dict())
    native.load_state_dict(native_state, assign=True)
    branch.load_state_dict(branch_state, assign=True)
    shared = native.blocks[0].attn.qkv_proj.weight.data_ptr() == pack.blocks[0].attn.qkv_proj.weight.data_ptr()
    shared &= branch.transformer_blocks[0].attn.to_out_linear.weight.data_ptr() == (
        pack.blocks[0].attn.to_out_linear.weight.data_ptr()
    )
    return native.eval(), branch.eval(), shared


def requests(setup, device, dtype, sigma: float, shifts: tuple[float, float]):
    """The same T2VA request for both: the native model's latents, timestep and context, and the pack DiT's
    rows in its index order with the per-row timesteps the native model forms from that timestep."""
    cfg, text = setup["cfg"], setup["text"]
    packed = pack_sequence(
        torch.ones(text, dtype=torch.long), setup["latent_t"], setup["height"], setup["width"], setup["audio_t"]
    )
    g = torch.Generator().manual_seed(0)
    video = torch.randn(1, cfg.video_channels, setup["latent_t"], setup["height"], setup["width"], generator=g)
    audio = torch.randn(1, cfg.audio_channels, 2, setup["audio_t"], generator=g)
    context = torch.randn(1, text, cfg.text_dim, generator=g).to(device, dtype)
    video, audio = video.to(device), audio.to(device)
    timestep = torch.tensor([sigma * 1000.0], dtype=torch.float32, device=device)
    sigma_v = float((timestep[0] / 1000.0).clamp(min=1e-6))  # as the native model reads it
    timesteps, index = row_timesteps(packed, 1.0 - sigma_v, 1.0 - shifted_sigma(sigma_v, *shifts))
    pack_args = (to_rows(video), audio_to_rows(audio), context[0], timesteps.to(device), index.to(device))
    return packed, pack_args + packed.model_inputs(device), ([video, audio], timestep, context)


def timed(fn, cuda: bool):
    """``fn()``, its wall seconds between device synchronisations and the device's peak during it (GiB)."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return out, seconds, torch.cuda.max_memory_allocated() / GiB if cuda else None


def host_norm_rope():
    """comfy-kitchen's fused q/k norm and split-half rotation as the host's H3 attention calls it, or None."""
    try:
        import comfy_kitchen
    except (ImportError, OSError):
        return None
    return kitchen_norm_rope(comfy_kitchen.rms_rope_split_half)


def pack_options(name: str, mode: str | None) -> RunOptions:
    """The ``RunOptions`` of the pack's form ``name``: ``pack`` plain, ``pack-branch-fused`` its linear branches in
    the fused ``mode``, ``pack-fused`` its blocks and branches."""
    return RunOptions(
        blocks_fused=mode if name == "pack-fused" else None, branches_fused=mode if name != "pack" else None
    )


@contextlib.contextmanager
def branch_modes(seen: set):
    """Within the block, the ``branches_fused`` of the ``RunOptions`` the patch's hybrid attention completed with
    (``NativeVDN.run`` chooses them each call: the branch compiled where it may, else plain), added to ``seen``."""
    import h3_core.models.native_hybrid as native_module

    real = native_module.hybrid_attention_forward

    def recording(attn, x, rope, ctx, run=PLAIN):
        out = real(attn, x, rope, ctx, run)
        seen.add(str(run.branches_fused))
        return out

    native_module.hybrid_attention_forward = recording
    try:
        yield seen
    finally:
        native_module.hybrid_attention_forward = real


class Captured:
    """The first call's arguments of a function (block 0's attention in an evaluation)."""

    def __init__(self, fn):
        self.fn, self.args = fn, None

    def __call__(self, *args, **kwargs):
        if self.args is None:
            self.args = (args, kwargs)
        return self.fn(*args, **kwargs)


def attention_parts(pack, vdn_kinds: dict, pack_inputs, native_inputs, mode, reps, cuda) -> dict:
    """Block 0's attention alone on the warm-up's inputs: median seconds of ``reps`` calls (after one) per form.
    ``vdn_kinds``: name -> (a ``NativeVDN``, the attention source it reads, None for the warm-up's)."""
    attn = pack.blocks[0].attn

    def fused_attention(*args, **kwargs):
        with mode_for(mode)[1]:
            return attn(*args, **kwargs)

    # the attention's inputs (x, rope, ctx) as the block gave them; the run options each form's own
    args, kwargs = pack_inputs
    args, kwargs = args[:3], {key: value for key, value in kwargs.items() if key != "run"}
    calls = {}
    for name, fn in (("pack", attn), ("pack-branch-fused", fused_attention)):
        calls[name] = (fn, (args, dict(kwargs, run=pack_options(name, mode_for(mode)[0]))))
    (source, *rest), kwargs = native_inputs
    for name, (vdn, own_source) in vdn_kinds.items():
        calls[name] = (vdn.run, ((own_source or source, *rest), kwargs))
    parts = {}
    for name, (fn, (args, kwargs)) in calls.items():
        fn(*args, **kwargs)
        times = [timed(lambda: fn(*args, **kwargs), cuda)[1] for _ in range(reps)]
        parts[name] = dict(seconds=statistics.median(times), times_s=times)
    return parts


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="DiT blocks (8; --tiny: 2)")
    parser.add_argument("--frames", type=int, default=345, help="video frames, 17k + 5 (release geometry)")
    parser.add_argument("--text", type=int, default=None, help="text rows (300; --tiny: 5)")
    parser.add_argument("--sigma", type=float, default=0.6, help="the step's noise level (sets the timesteps)")
    parser.add_argument("--reps", type=int, default=None, help="timed evaluations per variant (3; --tiny: 1)")
    parser.add_argument(
        "--fused",
        default=None,
        choices=(EAGER, "compiled"),
        help="the fused forms' mode (default: what policy.fuse_for chooses for a run: compiled on CUDA with Triton; "
        "eager, the fused functions as written, where it chooses none)",
    )
    parser.add_argument("--tiny", action="store_true", help="test_native_patch's tiny model on the CPU, fp32")
    parser.add_argument(
        "--host-compile",
        action="store_true",
        help=f"also time {HOST_COMPILED}: the patched native model with each block under torch.compile",
    )
    parser.add_argument("--out", type=Path, default=None)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    setup = geometry(args)
    layers = args.layers or (setup["cfg"].layers if args.tiny else 8)
    cfg = setup["cfg"] = replace(setup["cfg"], layers=layers)
    reps = args.reps or (1 if args.tiny else 3)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None

    torch.manual_seed(0)  # the weights (drawn on the device)
    pack = dit_step.random_model(cfg, device, dtype)
    native, branch, shared = native_twin(pack, cfg)
    mode = args.fused or fuse_for(pack, device) or EAGER
    library_mode = mode_for(mode)[0]
    pack_runs = {name: pack_options(name, library_mode) for name in PACK_FORMS}
    weights_gib = torch.cuda.memory_allocated() / GiB if cuda else None
    shifts = (native.sigma_shift_video, native.sigma_shift_audio)
    packed, pack_args, native_args = requests(setup, device, dtype, args.sigma, shifts)
    windows = {name: [] for name in VARIANTS}  # what each variant's window softmax ran
    contexts = {
        name: HybridContext(packed.layout, RELEASE_WINDOW, "auto", (0, setup["text"]), windows[name].append)
        for name in PACK_FORMS
    }
    kitchen = host_norm_rope()
    settings = NativeHybridSettings(RELEASE_WINDOW, "auto")
    vdn = NativeVDN(native, branch, settings, norm_rope=kitchen, on_window_run=windows["native"].append)
    vdn.run = native_attention = Captured(vdn.run)  # block 0's inputs, for attention_parts
    pack_attention = Captured(pack.blocks[0].attn.forward)
    pack.blocks[0].attn.forward = pack_attention
    options = {"patches_replace": {"dit": {("double_block", i): vdn.block_patch(i) for i in range(layers)}}}
    variant_names = VARIANTS + ((HOST_COMPILED,) if args.host_compile else ())
    # as the node builds it: no window log, whose growing list the compiled graph would guard on
    node_vdn = NativeVDN(native, branch, settings, norm_rope=kitchen)
    node_options = {"patches_replace": {"dit": {("double_block", i): node_vdn.block_patch(i) for i in range(layers)}}}
    blocks, compiled_blocks = native.blocks, torch.nn.ModuleList(torch.compile(b) for b in native.blocks)

    def run(name):
        if name == "native":
            with torch.device(device):  # the native model makes its tensors on the default device
                return native(*native_args, options)
        if name == HOST_COMPILED:
            native.blocks = compiled_blocks
            try:
                with torch.device(device):
                    return native(*native_args, dict(node_options))  # a fresh dict a call, as the sampler's
            finally:
                native.blocks = blocks
        with mode_for(mode if name != "pack" else None)[1]:
            return pack(*pack_args, hybrid=contexts[name], run=pack_runs[name])

    stats = {name: dict(times_s=[], peaks_gib=[]) for name in variant_names}
    compared = COMPARED + (((HOST_COMPILED, "native"), (HOST_COMPILED, "pack-fused")) if args.host_compile else ())
    with torch.inference_mode():
        outs = {}
        native_modes = set()  # the modes the native variant's branch ran in, over its first evaluation
        for name in variant_names:
            with branch_modes(native_modes) if name == "native" else contextlib.nullcontext():
                outs[name], stats[name]["first_s"], _ = timed(lambda: run(name), cuda)
        for name in ("native", HOST_COMPILED)[: 1 + args.host_compile]:
            video, audio = outs.pop(name)
            outs[name] = to_rows(-video), audio_to_rows(-audio)  # the host's output is the negated velocity
        del video, audio
        agreement = {
            f"{got} vs {want}": dict(
                video=relative(outs[got][0], outs[want][0]), audio=relative(outs[got][1], outs[want][1])
            )
            for got, want in compared
        }
        del outs
        if cuda:
            torch.cuda.empty_cache()
        for rep in range(reps):
            turn = rep % len(variant_names)
            for name in variant_names[turn:] + variant_names[:turn]:  # each variant first in turn
                seconds, peak = timed(lambda: run(name), cuda)[1:]  # the output dropped before the next
                stats[name]["times_s"].append(seconds)
                stats[name]["peaks_gib"].append(peak)
        forms = {"native": (vdn, None)}
        if kitchen is not None:
            plain = NativeAttentionSource(native.blocks[0].attn, branch.transformer_blocks[0].attn, None, None)
            forms["native-plain-rope"] = (NativeVDN(native, branch, settings), plain)
        parts = attention_parts(pack, forms, pack_attention.args, native_attention.args, mode, reps, cuda)
    variants = {}
    for name in variant_names:
        times, peaks = stats[name]["times_s"], stats[name]["peaks_gib"]
        variants[name] = dict(
            seconds=statistics.median(times),
            spread_s=max(times) - min(times),
            times_s=times,
            first_s=stats[name]["first_s"],
            peak_gib=max(peaks) if cuda else None,
            window_backend=windows[name][-1].backend if windows.get(name) else None,
            window_kernel=windows[name][-1].kernel if windows.get(name) else None,
        )
    result = dict(
        record.header("vdn_patch.py", argv),
        triton=triton_version,
        args=dict(vars(args), out=str(args.out) if args.out else None, layers=layers, reps=reps),
        rows=int(packed.positions.shape[0]),
        geometry={k: v for k, v in setup.items() if k != "cfg"},
        dtype=str(dtype).removeprefix("torch."),
        fused_mode=mode,
        native_norm_rope="comfy-kitchen rms_rope_split_half" if kitchen is not None else "plain",
        native_branch_fused=sorted(native_modes),
        weights_shared=bool(shared),
        weights_gib=weights_gib,
        agreement=agreement,
        variants=variants,
        ratio_native_over_pack={
            f"{native_form} / {name}": variants[native_form]["seconds"] / variants[name]["seconds"]
            for native_form in variant_names[len(PACK_FORMS) :]
            for name in PACK_FORMS
        },
        attention_parts=parts,
    )
    print(record.write(result, args.out))
    return result


if __name__ == "__main__":
    main()
