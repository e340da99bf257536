"""The exact window softmax's kernel configurations at the release geometry, side by side in one process.

The decomposed window softmax (``window_softmax_decomposed``, staged, 56 heads, T = 104,266) is timed whole with
each candidate serving every one of its dense calls: PyTorch's cuDNN SDPA as the library calls it (with and
without the log-sum-exp it does not need there), every execution plan cuDNN's heuristics list for the same
graphs through ``nvidia-cudnn-frontend`` (when importable), and flash-attn-4 at the library's call and at other
tile shapes and pipeline flags of its Hopper forward (when importable). Each row: the median of ``--reps``
CUDA-event timings after a warm-up, and the output's largest difference from the library's own call.

    python3 bench/attention_configs.py --out r.json
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record
from window_attention import release_geometry

import h3_core.attention.window_decomposed as decomposed
from h3_core.attention import WindowSpec, force_kernel
from h3_core.attention.kernels import AttnOut

FA4_CONFIGS = (  # (tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap); None = the library's call
    None,
    (128, 128, True, True),
    (128, 176, True, True),
    (128, 160, True, True),
    (128, 144, True, True),
    (128, 192, True, True),
    (128, 112, True, True),
    (128, 128, False, True),
    (128, 176, False, True),
    (192, 128, False, True),
)


def _batched(x):
    return x if x.dim() == 4 else x.unsqueeze(0)


def torch_cudnn(lse: bool):
    def call(q, k, v, scale, out=None):
        b = q.dim() == 3
        qh, kh, vh = (_batched(x).transpose(1, 2) for x in (q, k, v))
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(qh, kh, vh, None, lse, is_causal=False, scale=scale)
        o = res[0].transpose(1, 2)
        return AttnOut(o[0] if b else o, None)

    return call


class FrontendPlans:
    """cuDNN's fp16/bf16 SDPA forward graphs per geometry, every plan of heuristics A, B and the fallback."""

    def __init__(self):
        self.cudnn = importlib.import_module("cudnn")
        self.handle = self.cudnn.create_handle()
        self.graphs = {}

    def graph(self, q, k, v, o):
        cudnn = self.cudnn
        key = tuple((tuple(x.shape), x.stride(), x.dtype) for x in (q, k, v, o))
        if key in self.graphs:
            return self.graphs[key]
        io = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[q.dtype]
        g = cudnn.pygraph(
            handle=self.handle,
            io_data_type=io,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
        )

        def head_major(x):
            B, T, H, D = x.shape
            s = x.stride()
            return [B, H, T, D], [s[0], s[2], s[1], s[3]]

        ts = [
            g.tensor(name=n, dim=head_major(x)[0], stride=head_major(x)[1], data_type=io, uid=i + 1)
            for i, (n, x) in enumerate(zip("qkv", (q, k, v)))
        ]
        out, _ = g.sdpa(
            q=ts[0], k=ts[1], v=ts[2], attn_scale=self.scale, generate_stats=False, use_causal_mask=False, name="window"
        )
        dims, strides = head_major(o)
        out.set_uid(4).set_output(True).set_dim(dims).set_stride(strides).set_data_type(io)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
        g.check_support()
        entry = {"graph": g, "built": set(), "count": g.get_execution_plan_count()}
        self.graphs[key] = entry
        return entry

    def names(self, q, k, v, o):
        entry = self.graph(q, k, v, o)
        return [entry["graph"].get_plan_name_at_index(i) for i in range(entry["count"])]

    def call(self, index: int):
        def run(q, k, v, scale, out=None):
            self.scale = scale
            b = q.dim() == 3
            q4, k4, v4 = (_batched(x) for x in (q, k, v))
            o4 = torch.empty_like(q4) if out is None else _batched(out)
            entry = self.graph(q4, k4, v4, o4)
            g = entry["graph"]
            if index not in entry["built"]:
                g.build_plan_at_index(index)
                entry["built"].add(index)
                entry.setdefault("workspace", {})[index] = g.get_workspace_size_plan_at_index(index)
            ws = torch.empty(max(1, entry["workspace"][index]), dtype=torch.uint8, device=q.device)
            g.execute_plan_at_index({1: q4, 2: k4, 3: v4, 4: o4}, ws, index=index, handle=self.handle)
            return AttnOut(o4[0] if b else o4, None)

        return run


def fa4_call(config):
    fwd = importlib.import_module("flash_attn.cute.interface")._flash_attn_fwd
    extra = {} if config is None else dict(tile_mn=config[:2], mma_pv_is_rs=config[2], intra_wg_overlap=config[3])
    lse = config is None

    def run(q, k, v, scale, out=None):
        b = q.dim() == 3
        res = fwd(
            *(_batched(x) for x in (q, k, v)),
            softmax_scale=scale,
            return_lse=lse,
            out=None if out is None else _batched(out),
            **extra,
        )
        return AttnOut(res[0][0] if b else res[0], None)

    return run


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--dtype", choices=("bf16",), default="bf16")
    parser.add_argument("--max-plans", type=int, default=24)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = record.header("attention_configs.py", argv)
    torch.manual_seed(0)
    layout, window = release_geometry(), WindowSpec(radius=1, chunk=5, anchors="both")
    T, H, D = layout.seq_len, args.heads, 128
    q, k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = D**-0.5
    library = decomposed.dense_attention
    run_leg = lambda: decomposed.window_softmax_decomposed(q, k, v, layout, window, scale)  # noqa: E731
    with force_kernel("cudnn"):
        reference = run_leg()
    rows = []

    def measure(name, fn, note=""):
        decomposed.dense_attention = lambda q_, k_, v_, scale=None, out=None: fn(q_, k_, v_, scale, out)
        try:
            got = run_leg()
            torch.cuda.synchronize()
            times = record.event_times_ms(run_leg, args.reps, True)
            diff = (got.float() - reference.float()).abs().max().item()
            row = dict(
                candidate=name,
                ms=round(statistics.median(times), 3),
                spread_ms=round(max(times) - min(times), 3),
                max_abs_diff=diff,
                note=note,
            )
        except Exception as exc:  # a configuration the kernel refuses is a result, not a stop
            row = dict(candidate=name, error=f"{type(exc).__name__}: {exc}"[:400])
            traceback.print_exc()
        finally:
            decomposed.dense_attention = library
        rows.append(row)
        print(row, flush=True)

    with force_kernel("cudnn"):
        measure(
            "library (cuDNN through torch, log-sum-exp asked)",
            lambda q_, k_, v_, s, out: library(q_, k_, v_, scale=s, out=out),
        )
    measure("cuDNN through torch, no log-sum-exp", torch_cudnn(False))
    try:
        plans = FrontendPlans()
        plans.scale = scale
        probe = torch.empty(1, 5040, H, D, device="cuda", dtype=torch.float16)
        names = plans.names(probe, probe, probe, probe)
        result["frontend_plans"] = names
        for i, name in enumerate(names[: args.max_plans]):
            measure(f"cuDNN frontend plan {i}", plans.call(i), note=name)
    except Exception as exc:
        result["frontend_error"] = f"{type(exc).__name__}: {exc}"[:400]
        traceback.print_exc()
    try:
        importlib.import_module("flash_attn.cute.interface")
        with force_kernel("fa4"):
            measure("library (FA4)", lambda q_, k_, v_, s, out: library(q_, k_, v_, scale=s, out=out))
        for config in FA4_CONFIGS:
            measure(f"FA4 {config or 'as called'}", fa4_call(config), note="no log-sum-exp" if config else "")
    except ImportError:
        result["fa4"] = "not installed"
    result["rows"] = rows
    print(record.write(result, args.out))
    return result


if __name__ == "__main__":
    main()
