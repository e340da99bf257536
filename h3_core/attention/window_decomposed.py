"""Window softmax as dense calls only: no mask, and no per-group copies of the global keys.

The kept (query, key) pairs split into dense rectangles:
  * dense queries — global rows and anchor-row frames — attend to every key: one call;
  * every other video query attends to the frames of its clamped window (minus anchor-column frames,
    which are always at the ends of a window) plus the *extra* keys: all global rows and, with column
    anchors, frames 0 and F-1. The extra set is the same for every such query.
Window queries form *groups* (runs of consecutive frames sharing one window); consecutive groups of equal
shape whose windows advance by a constant step form a *batch*. Each group runs in ONE call over a staging
buffer ``[extra keys | window slots]``. The slots rotate, so a group loads only the chunk that entered its
window; every output is rounded once, and staging in fp16 rounds the probabilities more finely than a bf16
kernel does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._lru import BoundedLRU
from .convert import scale_convert
from .kernels import dense_attention
from .layout import SequenceLayout, WindowSpec, anchor_frames, clamped_window, is_full_cover, window_bounds

__all__ = ["DecomposedPlan", "WindowBatch", "plan_decomposed", "window_softmax_decomposed", "plan_cache_info"]

MAX_CACHED_PLANS = 16
DEFAULT_STAGE_BYTES = 384 * 2**20
_plans = BoundedLRU(MAX_CACHED_PLANS)


@dataclass(frozen=True)
class WindowBatch:
    """``groups`` runs of ``q_rows`` consecutive query rows starting at ``q_start``; group g attends to
    key rows ``[k_start + g * k_step, + k_rows)`` (no window keys when ``k_rows == 0``)."""

    q_start: int
    q_rows: int
    k_start: int
    k_rows: int
    k_step: int
    groups: int


@dataclass(frozen=True)
class DecomposedPlan:
    dense_runs: tuple[tuple[int, int], ...]  # query rows that attend to every key
    extra_runs: tuple[tuple[int, int], ...]  # keys every window query also attends to
    batches: tuple[WindowBatch, ...]

    @property
    def window_rows(self) -> int:
        return sum(b.q_rows * b.groups for b in self.batches)


def _merge_runs(runs):
    merged: list[list[int]] = []
    for a, b in sorted(r for r in runs if r[1] > r[0]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return tuple((a, b) for a, b in merged)


def _frame_span_rows(layout: SequenceLayout, first: int, last: int) -> tuple[int, int]:
    return layout.frame_rows(first)[0], layout.frame_rows(last)[1]


def plan_decomposed(layout: SequenceLayout, window: WindowSpec) -> DecomposedPlan:
    """Split the window rule into dense rectangles (pure Python; cached by ``cached_plan``)."""
    F = layout.num_frames
    bounds = window_bounds(F, window.radius, window.chunk)
    if F == 0 or is_full_cover(bounds, F):
        return DecomposedPlan(((0, layout.seq_len),), (), ())
    anchors = anchor_frames(F)
    dense_frames = anchors if window.anchor_rows else ()
    dense_runs = list(layout.global_ranges()) + [layout.frame_rows(f) for f in dense_frames]
    extra_runs = list(layout.global_ranges())
    if window.anchor_columns:
        extra_runs += [layout.frame_rows(f) for f in anchors]

    # Runs of consecutive window frames sharing one effective key-frame range [a, b] (empty when a > b).
    runs: list[list[int]] = []  # [first_frame, last_frame, a, b]
    for frame in range(F):
        if frame in dense_frames:
            continue
        a, b = clamped_window(bounds[frame], F)
        if window.anchor_columns:
            a, b = max(a, 1), min(b, F - 2)
        if b < a:
            a, b = 0, -1
        if runs and runs[-1][1] == frame - 1 and runs[-1][2:] == [a, b]:
            runs[-1][1] = frame
        else:
            runs.append([frame, frame, a, b])

    S = layout.tokens_per_frame
    batches: list[WindowBatch] = []
    for first, last, a, b in runs:
        q_start = _frame_span_rows(layout, first, last)[0]
        q_rows, k_rows = (last - first + 1) * S, max(0, b - a + 1) * S
        k_start = layout.frame_rows(a)[0] if k_rows else 0
        prev = batches[-1] if batches else None
        if (
            prev is not None
            and prev.q_rows == q_rows
            and prev.k_rows == k_rows
            and prev.q_start + prev.groups * q_rows == q_start
            and (prev.groups == 1 or k_start - (prev.k_start + (prev.groups - 1) * prev.k_step) == prev.k_step)
        ):
            step = k_start - prev.k_start if prev.groups == 1 else prev.k_step
            batches[-1] = WindowBatch(prev.q_start, q_rows, prev.k_start, k_rows, step, prev.groups + 1)
        else:
            batches.append(WindowBatch(q_start, q_rows, k_start, k_rows, 0, 1))
    plan = DecomposedPlan(_merge_runs(dense_runs), _merge_runs(extra_runs), tuple(batches))
    covered = sum(b - a for a, b in plan.dense_runs) + plan.window_rows
    assert covered == layout.seq_len, f"decomposed plan covers {covered} of {layout.seq_len} rows"
    return plan


def cached_plan(layout: SequenceLayout, window: WindowSpec) -> DecomposedPlan:
    return _plans.get_or_build((layout, window), lambda: plan_decomposed(layout, window))


def plan_cache_info() -> dict:
    return _plans.info()


def _rows(x: torch.Tensor, runs) -> torch.Tensor:
    """The rows of ``runs``: a view when there is one run, else one gathered copy."""
    if len(runs) == 1:
        return x[runs[0][0] : runs[0][1]]
    return torch.cat([x[a:b] for a, b in runs])


def _put_rows(out: torch.Tensor, values: torch.Tensor, runs) -> None:
    """``values`` (the rows of ``runs`` one after the other, as ``_rows`` gathers them) written back into ``out``."""
    offset = 0
    for a, b in runs:
        out[a:b] = values[offset : offset + b - a]
        offset += b - a


def _dense_leg(q, k, v, out, plan, scale):
    if not plan.dense_runs:
        return
    _put_rows(out, dense_attention(_rows(q, plan.dense_runs), k, v, scale=scale).out, plan.dense_runs)


def _value_scale(v):
    """A device-side power of two that brings v under 2**14 (so into fp16 range) without a host sync:
    v is staged divided by it and the output multiplied back. 1 for ordinary activations. A float32
    tensor of shape [1]."""
    amax = torch.stack(torch.aminmax(v)).abs().amax().float().reshape(1)
    # ceil(log2(amax)) - 14, at least 0: the exponent to shed.
    shed = (torch.ceil(torch.log2(amax.clamp(min=1.0))) - 14).clamp(min=0)
    return torch.exp2(shed)


def _stage_slots(batch, g):
    """Window segments to (re)load before group g: (source row, staging offset, rows) triples.

    A window of ``k_rows`` that advances by ``k_step`` per group is held as ``k_rows // k_step`` slots
    used round-robin, so each group after the first loads only the one segment that entered it.
    Attention does not care about key order, so the rotated slots need no reordering."""
    step = batch.k_step
    if batch.groups > 1 and step > 0 and batch.k_rows % step == 0:
        slots = batch.k_rows // step
        segments = range(slots) if g == 0 else (g + slots - 1,)
        return [(batch.k_start + j * step, (j % slots) * step, step) for j in segments]
    return [(batch.k_start + g * step, 0, batch.k_rows)]


def stage_walk(plan, heads: int, per_pass: int):
    """The staged windows' order of work, shared by the exact and the fp8 window legs, as steps:

    * ``("pass", hs)``: a pass over the heads ``hs`` (``per_pass`` at a time) begins: stage buffers for them;
    * ``("load", dst, src, n)``: ``n`` key (and value) rows from row ``src`` into stage row ``dst``;
    * ``("batch", batch)``: a batch of window groups begins;
    * ``("call", rows, used)``: the query ``rows`` attend to the stage rows ``used``.

    Each pass loads the extra keys first, then before each window group the slots that enter its window."""
    extra_rows = sum(b - a for a, b in plan.extra_runs)
    for h0 in range(0, heads, per_pass):
        yield "pass", slice(h0, min(heads, h0 + per_pass))
        offset = 0
        for a, b in plan.extra_runs:
            yield "load", offset, a, b - a
            offset += b - a
        for batch in plan.batches:
            yield "batch", batch
            used = slice(0, extra_rows + batch.k_rows)
            for g in range(batch.groups):
                for src, dst, n in _stage_slots(batch, g) if batch.k_rows else ():
                    yield "load", extra_rows + dst, src, n
                yield "call", slice(batch.q_start + g * batch.q_rows, batch.q_start + (g + 1) * batch.q_rows), used


def _heads_per_pass(heads: int, max_heads: int, q_rows: int, device: torch.device) -> int:
    """Heads per staging pass: at most ``max_heads`` (memory), choosing the split whose kernel grids
    (128-row query tiles × heads over the multiprocessors) leave the least of a last wave idle."""
    if max_heads >= heads:
        return heads
    if device.type != "cuda":
        return -(-heads // -(-heads // max_heads))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = -(-q_rows // 128)

    def waves(h):
        sizes = [h] * (heads // h) + ([heads % h] if heads % h else [])
        return sum(-(-tiles * n // sms) for n in sizes)

    return min(range(max_heads, 0, -1), key=waves)


def _window_leg_staged(q, k, v, out, plan, scale, stage_dtype, stage_bytes, gate=None):
    """One call per window group over a staging buffer [extra keys | window slots], in ``stage_dtype``.

    Every window query then sees all its keys in one kernel call: one rounding of the output, as in a
    fused masked kernel, and with fp16 staging a finer rounding of the probabilities than bf16 allows.
    Only the segment that enters the window is copied per group (see ``_stage_slots``).

    fp16 staging: v is divided by a power of two chosen on the device (``_value_scale``) and the output
    multiplied back, so large activations stay exact; q and k (normalised in the model) are saturated
    at the fp16 limit rather than overflowing. ``gate`` ``[T, H]`` multiplies the output as it is converted
    back; returns whether it did (only where the window calls ran in another dtype)."""
    T, H, D = q.shape
    convert = stage_dtype != q.dtype
    v_scale = _value_scale(v) if convert else None
    v_inv = 1.0 / v_scale if convert else None
    extra_rows = sum(b - a for a, b in plan.extra_runs)
    stage_rows = extra_rows + max(b.k_rows for b in plan.batches)
    widest = max(plan.batches, key=lambda b: b.q_rows * b.groups)
    elt = torch.empty((), dtype=stage_dtype).element_size()
    # Staged K and V, plus converted queries and the kernel's own output for one group.
    per_head = (2 * stage_rows + (2 if convert else 1) * widest.q_rows) * D * elt
    heads = _heads_per_pass(H, max(1, stage_bytes // per_head), widest.q_rows, q.device)

    def load(dst, src, scale_by=None):
        if convert:
            scale_convert(src, dst, scale_by, saturate=True)
        else:
            dst.copy_(src)

    for step in stage_walk(plan, H, heads):
        if step[0] == "pass":
            hs = step[1]
            stage_k = torch.empty(stage_rows, hs.stop - hs.start, D, dtype=stage_dtype, device=q.device)
            stage_v = torch.empty_like(stage_k)
        elif step[0] == "load":
            _, dst, src, n = step
            load(stage_k[dst : dst + n], k[src : src + n, hs])
            load(stage_v[dst : dst + n], v[src : src + n, hs], v_inv)
        elif step[0] == "batch" and convert:
            q_stage = torch.empty(step[1].q_rows, hs.stop - hs.start, D, dtype=stage_dtype, device=q.device)
            # The kernel may write its fp16 output straight into the bytes of the bf16 destination.
            in_place = elt == q.element_size()
        elif step[0] == "call":
            _, rows, keys = step
            target = out[rows, hs]
            if convert:
                load(q_stage, q[rows, hs])
                res = dense_attention(
                    q_stage,
                    stage_k[keys],
                    stage_v[keys],
                    scale=scale,
                    out=target.view(stage_dtype) if in_place else None,
                ).out
                scale_convert(res, target, v_scale, gate=None if gate is None else gate[rows, hs])
            else:
                res = dense_attention(q[rows, hs], stage_k[keys], stage_v[keys], scale=scale, out=target).out
                if res is not target:
                    target.copy_(res)
    return convert


def stage_dtype_for(q: torch.Tensor) -> torch.dtype:
    """fp16 window staging for bf16 inputs on CUDA (finer probabilities, same speed); else q's dtype."""
    if q.is_cuda and q.dtype == torch.bfloat16:
        return torch.float16
    return q.dtype


def window_softmax_decomposed(
    q,
    k,
    v,
    layout: SequenceLayout,
    window: WindowSpec,
    scale: float,
    *,
    stage_dtype: torch.dtype | None = None,
    stage_bytes: int = DEFAULT_STAGE_BYTES,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decomposed window softmax (see the module docstring).

    Args:
        stage_dtype: dtype of the staged keys and of the window calls. Default: ``stage_dtype_for(q)``.
        stage_bytes: bound on the staging buffers; heads are processed in passes to stay under it.
        gate: ``[T, H]`` or None: the output multiplied per row and head, on the staged windows as their
            output is converted back to q's dtype, on the other rows after.
    """
    plan = cached_plan(layout, window)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _dense_leg(q, k, v, out, plan, scale)
    windows_gated = False
    if plan.batches:
        stage_dtype = stage_dtype or stage_dtype_for(q)
        windows_gated = _window_leg_staged(q, k, v, out, plan, scale, stage_dtype, stage_bytes, gate)
    if gate is not None:
        for a, b in plan.dense_runs if windows_gated else ((0, q.shape[0]),):
            out[a:b].mul_(gate[a:b, :, None])
    return out
