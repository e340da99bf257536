"""A bf16 hybrid block's attention GEMMs in the forms the model could run them, at the release rows (104,266),
each timed in one process (CUDA events, median of ``--reps``) with its largest difference from the library's form:

* q, k and v: three row slices of ``qkv_proj``'s weight (the library: each a dense ``[T, inner]``), one GEMM
  over the stacked weight (q, k, v strided views of ``[T, 3 · inner]``), and one batched GEMM over the three
  slices with x broadcast (``torch.bmm`` on a stride-0 batch: three dense outputs from one launch);
* the output: ``out_proj`` of the gated softmax output, ``to_out_linear`` of the readout, then the add (the
  library), the second GEMM accumulated into the first's output (``addmm_``, β = 1), and one GEMM over both
  inputs side by side (K = 2 · inner; the inputs written into one buffer, which the timing excludes).

    python3 bench/block_gemms.py --out block_gemms.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import record

RELEASE_ROWS = 104266
HIDDEN, INNER = 5120, 7168


def _qkv_forms(x, w):
    inner = w.shape[0] // 3
    stacked_w = w.view(3, inner, -1)

    def slices():
        return [F.linear(x, w[i * inner : (i + 1) * inner]) for i in range(3)]

    def stacked():
        return F.linear(x, w).view(x.shape[0], 3, inner).unbind(1)

    def batched():
        return torch.bmm(x.expand(3, *x.shape), stacked_w.transpose(1, 2)).unbind(0)

    return {"three row slices (library)": slices, "one stacked GEMM, strided views": stacked, "batched": batched}


def _output_forms(attended, readout, w_out, w_lin):
    both_in = torch.cat([attended, readout], 1)
    both_w = torch.cat([w_out, w_lin], 1)

    def separate():
        return F.linear(attended, w_out).add_(F.linear(readout, w_lin))

    def accumulated():
        return F.linear(attended, w_out).addmm_(readout, w_lin.t())

    def side_by_side():
        return F.linear(both_in, both_w)

    return {
        "out_proj, to_out_linear, add (library)": separate,
        "to_out_linear accumulated (addmm_)": accumulated,
        "one GEMM over both inputs (K = 2 inner)": side_by_side,
    }


def _timed(forms, flops, time_ms):
    reference = None
    rows = {}
    for name, fn in forms.items():
        out = fn()
        out = torch.cat([t.reshape(t.shape[0], -1) for t in out], 1) if isinstance(out, (tuple, list)) else out
        reference = out if reference is None else reference
        diff = (out.float() - reference.float()).abs().max().item()
        del out
        ms = time_ms(fn)
        rows[name] = {"ms": ms, "tflops": round(flops / ms / 1e9, 1), "max_abs_diff": diff}
    return rows


def main(argv=None):
    args, cuda = record.stage_arguments(__doc__.split("\n\n")[0], argv)
    device = torch.device("cuda" if cuda else "cpu")
    rows, hidden, inner = (RELEASE_ROWS, HIDDEN, INNER) if cuda else (64, 32, 48)
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device=device, dtype=dtype, generator=g) * scale

    result = record.header("block_gemms.py", argv)
    result["size"] = {"rows": rows, "hidden": hidden, "inner": inner}
    time_ms = record.timer(cuda, args.reps)
    x, w_qkv = randn(rows, hidden), randn(3 * inner, hidden, scale=hidden**-0.5)
    result["qkv"] = _timed(_qkv_forms(x, w_qkv), 2 * rows * hidden * 3 * inner, time_ms)
    del x, w_qkv
    attended, readout = randn(rows, inner), randn(rows, inner)
    w_out, w_lin = randn(hidden, inner, scale=inner**-0.5), randn(hidden, inner, scale=inner**-0.5)
    forms = _output_forms(attended, readout, w_out, w_lin)
    result["output"] = _timed(forms, 2 * rows * 2 * inner * hidden, time_ms)
    return record.finish(result, args.out, cuda)


if __name__ == "__main__":
    main()
