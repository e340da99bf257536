"""The fp8 path's per-element stages at the release length (T = 104,266 rows), each timed (median of ``--reps``
CUDA-event timings after a warm-up) beside the two-step form it replaces and checked against it: the row
quantiser (eager and the library's Triton pass) at the widths of the block's linear inputs; the block's
norms — the attention's input (norm and modulation), the FFN's (the residual, norm, modulation and ``fc1``'s
quantisation) — as ``torch.compile``'s passes and as the library's single pass (``norm_modulate_quantized``,
``residual_norm``, and ``block_fused.run("norm_modulate")`` for the attention's input); ``out_proj``'s input
— the softmax gate and the quantisation — in two passes and as the library's single one
(``block_fused.gate_heads_input``); the FFN's SiLU·up and the quantisation of ``fc2``'s input, two passes as
before and the library's single pass (``block_fused.swiglu_quantized``); for a bf16 ``fc2`` the SiLU·up
written into ``fc1``'s output, torch.compile's form (before) and the library's Triton pass. ``--tiny`` runs the
eager forms (the fused functions as written, ``tests/fused_eager.py``) on a few rows on the CPU.

    python3 bench/fp8_stages.py --out results.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fused functions as written
import record
from fused_eager import EAGER, mode_for

from h3_core.models import block_fused, branch_fused
from h3_core.models.fp8_linear import quantize_rows, quantize_rows_reference

WIDTHS = {"qkv / fc1 input": 5376, "out_proj / to_out_linear input": 7168, "fc2 input": 14336}


def main(argv=None) -> dict:
    args, cuda = record.stage_arguments(__doc__.splitlines()[0], argv)
    device = "cuda" if cuda else "cpu"
    rows = 104266 if cuda else 64
    widths = WIDTHS if cuda else {name: width // 64 for name, width in WIDTHS.items()}
    result = dict(record.header("fp8_stages.py", argv), rows=rows, ms={}, codes_equal={})
    ms, equal = result["ms"], result["codes_equal"]
    time_it = record.timer(cuda, args.reps)

    def same_codes(a, b) -> float:
        return float((a.view(torch.uint8) == b.view(torch.uint8)).float().mean())

    def same_values(a, b) -> float:
        return float((a == b).float().mean())

    g = torch.Generator().manual_seed(0)
    mode, running = mode_for("compiled" if cuda else EAGER)
    with torch.no_grad(), running:
        for name, width in widths.items():
            x = torch.randn(rows, width, generator=g).to(device, torch.bfloat16)
            ms[f"quantise {name} [{rows}, {width}] (eager)"] = time_it(lambda: quantize_rows_reference(x))
            ms[f"quantise {name} [{rows}, {width}] (library)"] = time_it(lambda: quantize_rows(x))
            equal[f"quantise {name}: library vs eager"] = same_codes(quantize_rows(x)[0], quantize_rows_reference(x)[0])
        # the block's norms: the attention's input (norm + modulation, bf16 rows), the FFN's (the residual after
        # the attention, then norm + modulation, quantised for an fp8 fc1), each as torch.compile's passes and
        # as the library's one Triton pass
        hidden = widths["qkv / fc1 input"]
        x = torch.randn(rows, hidden, generator=g).to(device, torch.bfloat16)
        y = torch.randn(rows, hidden, generator=g).to(device, torch.bfloat16)
        weight = torch.randn(hidden, generator=g).to(device, torch.bfloat16)
        gate, shift, scale = (torch.randn(6, hidden, generator=g).to(device, torch.bfloat16) for _ in range(3))
        table_rows = torch.randint(0, 6, (rows,), generator=g).to(device)
        compiled = torch.compile if cuda else (lambda fn: fn)
        norm_passes, residual_passes = compiled(block_fused.norm_modulate), compiled(block_fused.gated_residual_)
        norm = (weight, shift, scale, table_rows, 1e-6)
        ms["norm + modulation (torch.compile, before)"] = time_it(lambda: norm_passes(x, *norm))
        if cuda:
            library_norm = lambda: block_fused.run(mode, "norm_modulate", x, *norm)  # noqa: E731
            ms["norm + modulation (library: one Triton pass)"] = time_it(library_norm)
            equal["norm + modulation: Triton vs torch.compile (bf16 values)"] = same_values(
                library_norm(), norm_passes(x, *norm)
            )
        norm_two = lambda: quantize_rows(norm_passes(x, *norm))  # noqa: E731
        norm_one = lambda: block_fused.norm_modulate_quantized(mode, x, *norm)  # noqa: E731
        ms["norm + modulation then quantise (two passes)"] = time_it(norm_two)
        ms["norm + modulation and quantise in one pass (library)"] = time_it(norm_one)
        equal["norm + modulation + quantise: one pass vs two"] = same_codes(norm_one().codes, norm_two()[0])
        ms["copy of the attention's output (inside the residual timings)"] = time_it(lambda: y.clone())
        for quantized in (False, True):
            what = "norm + modulation" + (" + quantise" if quantized else "")

            def passes():
                x1 = residual_passes(x, y.clone(), gate, table_rows)
                return quantize_rows(norm_passes(x1, *norm))[0] if quantized else norm_passes(x1, *norm)

            def one():
                h = block_fused.residual_norm(
                    mode, x, y.clone(), gate, table_rows, weight, shift, scale, 1e-6, quantized
                )[1]
                return h.codes if quantized else h

            ms[f"residual, then {what} ({3 if quantized else 2} passes)"] = time_it(passes)
            ms[f"residual + {what} in one pass (library)"] = time_it(one)
            same = same_codes if quantized else same_values
            equal[f"residual + {what}: one pass vs the passes"] = same(one(), passes())
        # out_proj's input: the window softmax's output times its per-head gate, then quantised
        heads = 56
        soft = torch.randn(rows, heads, widths["out_proj / to_out_linear input"] // heads, generator=g)
        soft = soft.to(device, torch.bfloat16)
        gate = torch.rand(rows, heads, generator=g).to(device, torch.bfloat16)
        gated = lambda: block_fused.run(mode, "gate_heads_", soft.clone(), gate).view(rows, -1)  # noqa: E731
        gate_two = lambda: quantize_rows(gated())  # noqa: E731
        # the eager form gates in place, as the two-step path: give it a copy
        gate_one = lambda: block_fused.gate_heads_input(mode, soft if cuda else soft.clone(), gate, True)  # noqa: E731
        ms["copy of the softmax output (inside the two-pass timing)"] = time_it(lambda: soft.clone())
        ms["softmax gate then quantise (two passes)"] = time_it(gate_two)
        ms["softmax gate and quantise in one pass (library)"] = time_it(gate_one)
        equal["softmax gate + quantise: one pass vs two"] = same_codes(gate_one().codes, gate_two()[0])
        ffn = widths["fc2 input"]
        gate_up = torch.randn(rows, 2 * ffn, generator=g).to(device, torch.bfloat16)
        two_pass = lambda: quantize_rows(block_fused.run(mode, "swiglu_", gate_up.clone()))  # noqa: E731
        ms["copy of fc1's output (inside the two-pass timing)"] = time_it(lambda: gate_up.clone())
        ms["SiLU·up then quantise (two passes, as before)"] = time_it(two_pass)
        one_pass = lambda: block_fused.swiglu_quantized(mode, gate_up if cuda else gate_up.clone())  # noqa: E731
        ms["SiLU·up and quantise in one pass (library)"] = time_it(one_pass)
        equal["SiLU·up + quantise: one pass vs two"] = same_codes(one_pass().codes, two_pass()[0])
        # a bf16 fc2's input: SiLU·up written into fc1's output, torch.compile's form and the library's
        compiled_swiglu = lambda: branch_fused.call(mode, block_fused.swiglu_, gate_up.clone())  # noqa: E731
        library_swiglu = lambda: block_fused.run(mode, "swiglu_", gate_up.clone())  # noqa: E731
        ms["SiLU·up in place, bf16 FFN (torch.compile, before; with a copy of fc1's output)"] = time_it(compiled_swiglu)
        ms["SiLU·up in place, bf16 FFN (library; with a copy of fc1's output)"] = time_it(library_swiglu)
        equal["SiLU·up in place, bf16 FFN: library vs torch.compile (bf16 values)"] = same_values(
            library_swiglu(), compiled_swiglu()
        )
    return record.finish(result, args.out, cuda)


if __name__ == "__main__":
    main()
