"""A block's GEMMs with their epilogues, as the nodes run them against torch inductor's Triton GEMM templates with the
epilogue fused (``torch.compile(mode="max-autotune-no-cudagraphs")``), at the release rows (104,266): ``out_proj``
and ``fc2`` each followed by the gated residual ``x + gate[row] · y``, in fp8 (row-wise ``torch._scaled_mm``, the
fp8 linears' fast path, then ``gated_residual_triton``) and in bf16 (cuBLAS through ``F.linear``, then the same
kernel); and ``fc1`` with SiLU · up (bf16: ``swiglu_triton`` after the GEMM). Each pair is timed in one process
(CUDA events, median of ``--reps``), with the largest difference of the fused result from the separate one. The
gate rows come from a two-row table, as a T2VA sequence's video and audio rows use two.

    python3 bench/gemm_epilogue.py --out gemm_epilogue.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import record

from h3_core.models.fp8_linear import fp8_linear_scaled_mm, quantize_input

RELEASE_ROWS = 104266
HIDDEN, INNER, FFN = 5120, 7168, 14336


def times_ms(fn, reps: int) -> list[float]:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(stop))
    return out


def gated_pair(rows: int, k: int, dtype_mode: str, device):
    """The separate GEMM + gated residual and the compiled one, for a ``[rows, k] → [rows, HIDDEN]`` linear."""
    from h3_core.models.block_triton import gated_residual_triton

    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(rows, k, device=device, generator=g, dtype=torch.bfloat16)
    x = torch.randn(rows, HIDDEN, device=device, generator=g, dtype=torch.bfloat16)
    gate = torch.randn(2, HIDDEN, device=device, generator=g, dtype=torch.bfloat16)
    table = (torch.arange(rows, device=device) >= rows - rows // 20).long()  # the last rows: the second table row
    w = torch.randn(HIDDEN, k, device=device, generator=g, dtype=torch.bfloat16) / k**0.5
    if dtype_mode == "fp8":
        w_scale = w.float().abs().amax(1).clamp(min=1e-12) / 448.0
        w_codes = (w.float() / w_scale[:, None]).to(torch.float8_e4m3fn)
        rows_in = quantize_input(h)

        def separate():
            y = fp8_linear_scaled_mm(rows_in, w_codes, w_scale, None, torch.bfloat16)
            return gated_residual_triton(x, y, gate, table)

        def fusable(codes, scale, w_codes, w_scale, x, gate, table):
            y = torch._scaled_mm(
                codes, w_codes.t(), scale_a=scale, scale_b=w_scale.view(1, -1), out_dtype=torch.bfloat16,
                use_fast_accum=True,
            )  # fmt: skip
            return (x.float() + y.float() * gate.float()[table]).to(torch.bfloat16)

        args = (rows_in.codes, rows_in.scale, w_codes, w_scale, x, gate, table)
    else:

        def separate():
            return gated_residual_triton(x, torch.nn.functional.linear(h, w), gate, table)

        def fusable(h, w, x, gate, table):
            y = torch.nn.functional.linear(h, w)
            return (x.float() + y.float() * gate.float()[table]).to(torch.bfloat16)

        args = (h, w, x, gate, table)
    return separate, fusable, args


def swiglu_pair(rows: int, device):
    from h3_core.models.block_triton import swiglu_triton

    g = torch.Generator(device=device).manual_seed(1)
    h = torch.randn(rows, HIDDEN, device=device, generator=g, dtype=torch.bfloat16)
    w = torch.randn(2 * FFN, HIDDEN, device=device, generator=g, dtype=torch.bfloat16) / HIDDEN**0.5

    def separate():
        return swiglu_triton(torch.nn.functional.linear(h, w))

    def fusable(h, w):
        gate, up = torch.nn.functional.linear(h, w).float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)

    return separate, fusable, (h, w)


def measure(name, separate, fusable, args, reps: int) -> dict:
    torch.cuda.synchronize()
    compiled = torch.compile(fusable, mode="max-autotune-no-cudagraphs", dynamic=False)
    started = time.perf_counter()
    fused_out = compiled(*args)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - started
    reference = separate()
    diff = float((fused_out.float() - reference.float()).abs().max())
    scale = float(reference.float().abs().max())
    separate_ms = times_ms(separate, reps)
    fused_ms = times_ms(lambda: compiled(*args), reps)
    result = dict(
        separate_ms=statistics.median(separate_ms),
        fused_ms=statistics.median(fused_ms),
        compile_s=compile_s,
        max_abs_diff=diff,
        max_abs=scale,
    )
    result["gain"] = 1 - result["fused_ms"] / result["separate_ms"]
    print(name, result, flush=True)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=RELEASE_ROWS)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--cases", nargs="+", default=["out_proj-fp8", "fc2-fp8", "out_proj-bf16", "fc2-bf16", "fc1-bf16"]
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this bench needs CUDA (inductor's GEMM templates are Triton kernels)")
    device = torch.device("cuda")
    result = dict(record.header("gemm_epilogue.py", argv), rows=args.rows, cases={})
    for case in args.cases:
        layer, mode = case.split("-")
        if layer == "fc1":
            pair = swiglu_pair(args.rows, device)
        else:
            pair = gated_pair(args.rows, INNER if layer == "out_proj" else FFN, mode, device)
        result["cases"][case] = measure(case, *pair, args.reps)
        torch.cuda.empty_cache()
    record.write(result, args.out)
    return result


if __name__ == "__main__":
    main()
