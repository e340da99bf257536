"""The window softmax in fp8: q, k and v quantised to e4m3 once (one scale each), then the decomposed plan's
dense calls on e4m3 inputs (``fp8.fp8_attention``), the output written in q's dtype.

The dense queries attend to every key in one call. Each window group attends to a staging buffer
``[extra keys | window slots]`` in e4m3 filled from the quantised k and v (the rotating slots of
``window_decomposed``), so every query sees all its keys in one call and no extra rounding. The reference,
``window_softmax_fp8_ref``, quantises the same way and loops over frames with the emulated kernel.
"""

from __future__ import annotations

import logging

import torch

from .fp8 import E4M3, Fp8Rows, fp8_attention, fp8_attention_reference, quantize_e4m3, resolve_fp8_kernel
from .layout import SequenceLayout, WindowSpec
from .window_decomposed import DEFAULT_STAGE_BYTES, _heads_per_pass, _put_rows, _rows, cached_plan, stage_walk
from .window_ref import frame_keys

__all__ = ["window_softmax_fp8", "window_softmax_fp8_ref", "quantized_qkv"]

log = logging.getLogger(__name__)
_said: set = set()


def quantized_qkv(q, k, v) -> tuple[Fp8Rows, Fp8Rows, Fp8Rows]:
    return quantize_e4m3(q), quantize_e4m3(k), quantize_e4m3(v)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """e4m3 values as their bytes: copies and concatenations of them need no float8 support."""
    return x.view(torch.uint8)


def window_softmax_fp8(
    q, k, v, layout: SequenceLayout, window: WindowSpec, scale: float, *, stage_bytes: int = DEFAULT_STAGE_BYTES
) -> tuple[torch.Tensor, str]:
    """The window softmax on e4m3 inputs (see the module docstring); returns the output and the kernel that ran."""
    kernel = resolve_fp8_kernel(q.device, q.shape[-1])
    if (str(q.device), kernel) not in _said:
        _said.add((str(q.device), kernel))
        log.info("window softmax in fp8 on %s: the decomposed plan on the %s kernel", q.device, kernel)
    plan = cached_plan(layout, window)
    q8, k8, v8 = quantized_qkv(q, k, v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if plan.dense_runs:
        dense_q = Fp8Rows(_rows(_bytes(q8.values), plan.dense_runs).view(E4M3), q8.descale)
        _put_rows(out, fp8_attention(dense_q, k8, v8, scale=scale, out_dtype=q.dtype), plan.dense_runs)
    if plan.batches:
        _window_leg(q8, k8, v8, out, plan, scale, stage_bytes)
    return out, kernel


def _window_leg(q8, k8, v8, out, plan, scale, stage_bytes):
    T, H, D = q8.values.shape
    extra_rows = sum(b - a for a, b in plan.extra_runs)
    stage_rows = extra_rows + max(b.k_rows for b in plan.batches)
    widest = max(plan.batches, key=lambda b: b.q_rows * b.groups)
    heads = _heads_per_pass(H, max(1, stage_bytes // (2 * stage_rows * D)), widest.q_rows, q8.values.device)
    for step in stage_walk(plan, H, heads):
        if step[0] == "pass":
            hs = step[1]
            stage_k = torch.empty(stage_rows, hs.stop - hs.start, D, dtype=torch.uint8, device=q8.values.device)
            stage_v = torch.empty_like(stage_k)
            keys, values = Fp8Rows(stage_k.view(E4M3), k8.descale), Fp8Rows(stage_v.view(E4M3), v8.descale)
        elif step[0] == "load":
            _, dst, src, n = step
            stage_k[dst : dst + n] = _bytes(k8.values[src : src + n, hs])
            stage_v[dst : dst + n] = _bytes(v8.values[src : src + n, hs])
        elif step[0] == "call":
            _, rows, used = step
            fp8_attention(
                Fp8Rows(q8.values[rows, hs], q8.descale),
                keys.rows(used),
                values.rows(used),
                scale=scale,
                out_dtype=out.dtype,
                out=out[rows, hs],
            )


def window_softmax_fp8_ref(
    q, k, v, layout: SequenceLayout, window: WindowSpec, scale: float, out_fp8: bool = False
) -> torch.Tensor:
    """One emulated fp8 call per video frame over its kept keys, on the same quantised q, k, v: the oracle for
    ``window_softmax_fp8``'s plan (float32 output). ``out_fp8``: each output also rounded to e4m3 on v's scale,
    as a kernel that writes e4m3 (``fp8_cudnn.writes_e4m3_output``) returns it."""
    q8, k8, v8 = quantized_qkv(q, k, v)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for rows, keys in frame_keys(layout, window, q.device):
        kk = k8 if keys is None else Fp8Rows(_bytes(k8.values)[keys].view(E4M3), k8.descale)
        vv = v8 if keys is None else Fp8Rows(_bytes(v8.values)[keys].view(E4M3), v8.descale)
        out[rows] = fp8_attention_reference(q8.rows(rows), kk, vv, scale, out_fp8)[0]
    return out
