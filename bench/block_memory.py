"""Peak device memory of one full-size DiT block, phase by phase, for several geometries and lower-memory
options: the measurements the memory model (``h3_core.memory.predict``) is checked against.

For each clip length, block kind (dense, hybrid) and option set ``G:R`` (G head groups, FFN chunks of R
rows; R = 0 for none) it runs one forward after a warm-up and reports, above what was allocated when
the block was called (weights, inputs, RoPE tables): the peak inside the attention (or hybrid attention),
the peak inside the FFN, the whole block's peak, and the model's prediction of each.

    python3 bench/block_memory.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # dit_block's helpers, also when this file is loaded from elsewhere
import dit_block
import record

from h3_core.memory.predict import BlockShape, block_peaks
from h3_core.models.hybrid import RELEASE_WINDOW, HybridContext
from h3_core.models.low_memory import LowMemory
from h3_core.models.run_options import RunOptions, check_run_options

GiB = 2**30


class PhasePeaks:
    """Peak memory inside chosen (possibly nested) modules, above a base taken when the block starts. Every
    module entry restarts the device's peak counter after folding it into the phases still open, so each
    phase sees the largest allocation made while it ran."""

    def __init__(self, block, cuda: bool):
        self.cuda, self.base, self.peaks, self.open, self.handles = cuda, 0, {}, {}, []
        modules = [("attention", block.attn), ("ffn", block.mlp)]
        if hasattr(block.attn, "linear_attention"):
            modules.append(("branch", block.attn.linear_attention))
        for name, module in modules:
            self.handles.append(module.register_forward_pre_hook(lambda m, a, name=name: self._enter(name)))
            self.handles.append(module.register_forward_hook(lambda m, a, o, name=name: self._leave(name)))

    def _fold(self):
        if self.cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - self.base
            for name in self.open:
                self.open[name] = max(self.open[name], peak)
            torch.cuda.reset_peak_memory_stats()

    def _enter(self, name):
        self._fold()
        self.open[name] = 0

    def _leave(self, name):
        self._fold()
        value = self.open.pop(name)
        self.peaks[name] = max(value, self.peaks.get(name, 0))  # the branch runs once per head group

    def close(self):
        for handle in self.handles:
            handle.remove()


def measure(block, run, cuda: bool) -> dict[str, float]:
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    phases = PhasePeaks(block, cuda)
    phases.base = torch.cuda.memory_allocated() if cuda else 0
    with torch.no_grad():
        out = run()
    if cuda:
        torch.cuda.synchronize()
    phases.close()
    del out
    # The hooks restart the peak at each phase, so the block's peak is the largest phase peak (the norms and
    # modulations between phases hold less than either).
    peaks = {name: value / GiB for name, value in phases.peaks.items()}
    peaks["block"] = max(peaks.values(), default=0.0)
    return peaks


def parse_variant(text: str) -> LowMemory:
    """``G:R`` or ``G:R:B``: head groups, FFN chunk rows (0: none), branch statistics frames (0: all)."""
    groups, rows, frames = ([int(part) for part in text.split(":")] + [0])[:3]
    return LowMemory(ffn_chunk_rows=rows or None, head_groups=groups, branch_frames=frames or None)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, nargs="*", default=[102, 52], help="latent frames of the clip")
    parser.add_argument(
        "--variants",
        nargs="*",
        default=["1:0", "2:32768", "8:16384", "4:8192"],
        help="G:R[:B] = head groups : FFN chunk rows (0: none) : branch statistics frames (0: all)",
    )
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU: a dry run of the code")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    base_setup = dit_block.TINY if args.tiny else dit_block.RELEASE
    result = dict(record.header("block_memory.py", argv), rows=[])
    window = RELEASE_WINDOW if not args.tiny else replace(RELEASE_WINDOW, chunk=2)
    blocks = {
        kind: dit_block.build(replace(base_setup["cfg"], hybrid=kind == "hybrid"), device, dtype)
        for kind in ("dense", "hybrid")
    }
    for frames in args.frames:
        setup = dict(base_setup, frames=frames)
        packed, x, temb, rows, rope = dit_block.inputs(setup, device, dtype)
        context = HybridContext(packed.layout, window, args.backend, (0, setup["text"]))
        shape = BlockShape.of(setup["cfg"], packed, dtype)
        for kind, block in blocks.items():
            ctx = context if kind == "hybrid" else None
            with torch.no_grad():
                block(x, temb, rows, rope, ctx)  # warm-up: kernel probes, compiled masks
            for variant in args.variants:
                options = parse_variant(variant)
                run_options = check_run_options(RunOptions().with_low_memory(options), block)
                measured = measure(block, lambda: block(x, temb, rows, rope, ctx, run=run_options), cuda)
                predicted = block_peaks(shape, options, hybrid=kind == "hybrid")
                row = dict(
                    frames=frames,
                    rows=int(x.shape[0]),
                    kind=kind,
                    head_groups=options.head_groups,
                    ffn_chunk_rows=options.ffn_chunk_rows,
                    branch_frames=options.branch_frames,
                    measured_gib=measured,
                    predicted_gib={k: v / GiB for k, v in predicted.items()},
                )
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
        x = rope = packed = None  # freed before the next size
    record.write(result, args.out)
    return result


if __name__ == "__main__":
    main()
