"""The VDN-H3 hybrid attention: window softmax plus the linear branch for what lies outside the window.

For the block's modulated input x (every projection reads it):
  out = out_proj(σ(softmax_gate.up x) ⊙ WindowSoftmax(q, k, v)) + 1_video · to_out_linear(LinearBranch(...))
with q, k normed and rotated for the softmax side and raw for the branch. When every window covers every
frame the rule keeps all pairs: attention is dense and the branch is off. With anchors "both" the branch
runs on frames 1..F−2 (bounds rebased) and adds nothing to frames 0 and F−1, which see everything anyway.
The text state that seeds the branch's scans is built from the text rows only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ..attention.layout import SequenceLayout, WindowSpec, is_full_cover, window_bounds
from ..attention.window import WindowRun, window_softmax
from ..parallel.exchange import exchange_blocks, gather_rows, heads_to_rows, rows_to_heads
from . import branch_fused
from .linear_branch import GivenRowInputs, LinearBranch
from .low_memory import add_linear_cols, head_slices
from .options import PLAIN, RunOptions
from .whole_sequence import WholeSequence

__all__ = [
    "HybridContext",
    "SoftmaxGate",
    "add_hybrid_parts",
    "hybrid_attention_forward",
    "hybrid_attention_ulysses",
]

# The released window: chunk 5 latents, one chunk either side, anchor frames both ways.
RELEASE_WINDOW = WindowSpec(radius=1, chunk=5, anchors="both")


@dataclass(frozen=True)
class HybridContext(WholeSequence):
    """What the hybrid attention needs to know about the packed sequence; its rows are all run in this process
    (``WholeSequence``)."""

    layout: SequenceLayout
    window: WindowSpec = RELEASE_WINDOW
    backend: str = "auto"
    text: tuple[int, int] = (0, 0)  # rows [start, stop) of the prompt
    on_window_run: Callable[[WindowRun], None] | None = None  # told what each window softmax ran
    precision: str = "bf16"  # the window softmax's (attention.window.PRECISIONS)

    def attend(self, attn, x, rope, run: RunOptions = PLAIN) -> torch.Tensor:
        """``attn``'s hybrid attention over the whole sequence ``x`` (``hybrid_attention_forward``)."""
        return hybrid_attention_forward(attn, x, rope, self, run)

    def attend_sharded(self, attn, x, rope, shards, run: RunOptions = PLAIN) -> torch.Tensor:
        """The same on this rank's rows of a sequence split among the ranks of ``shards``
        (``hybrid_attention_ulysses``)."""
        return hybrid_attention_ulysses(attn, x, rope, self, shards, run)


class SoftmaxGate(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.up = nn.Linear(hidden, heads)

    def forward(self, x):
        return torch.sigmoid(self.up(x))


def add_hybrid_parts(module: nn.Module, cfg) -> None:
    """Give ``module`` the parameters VDN-H3 adds to an attention, under their released names: ``softmax_gate``,
    ``to_out_linear`` and ``linear_attention``. ``cfg`` has ``hidden``, ``heads``, ``head_dim`` and ``inner``."""
    module.softmax_gate = SoftmaxGate(cfg.hidden, cfg.heads)
    module.to_out_linear = nn.Linear(cfg.inner, cfg.hidden, bias=False)
    module.linear_attention = LinearBranch(cfg.hidden, cfg.heads, cfg.head_dim)


def _branch_rows(ctx: HybridContext, bounds):
    """Video rows the branch reads and the bounds in its own frame coordinates."""
    layout = ctx.layout
    S, F = layout.tokens_per_frame, layout.num_frames
    if ctx.window.anchors == "both":
        return (layout.video_start + S, layout.video_stop - S), [(lo - 1, hi - 1) for lo, hi in bounds[1 : F - 1]]
    return (layout.video_start, layout.video_stop), list(bounds)


def hybrid_attention_forward(attn, x, rope, ctx: HybridContext, run: RunOptions = PLAIN) -> torch.Tensor:
    """The hybrid forward for an attention module holding ``project`` (raw q, k, v of a head range),
    ``normed_rotated`` (q, k normed and rotated), ``out_proj``, ``softmax_gate``, ``to_out_linear`` and
    ``linear_attention``. Heads run ``run.head_groups`` groups at a time (``low_memory``), the per-element work by
    ``run.block_ops`` and the branch in ``run.branches_fused`` mode.
    """
    d = attn.head_dim
    layout, window = ctx.layout, ctx.window
    bounds = window_bounds(layout.num_frames, window.radius, window.chunk)
    (r0, r1), inner = _branch_rows(ctx, bounds)
    branch_on = not is_full_cover(bounds, layout.num_frames) and bool(inner)
    branch: LinearBranch = attn.linear_attention
    t0, t1 = ctx.text
    grid = (layout.frame_h, layout.frame_w)
    gate = attn.softmax_gate(x)  # [T, H]
    out = None
    source = attn.projection_input(x)
    ops = run.block_ops
    quantized = ops.gates_while_quantizing(attn.out_proj, x.device)
    for heads in head_slices(attn.heads, run.head_groups):
        q_raw, k_raw, v = attn.project(x, heads, source)
        if heads.stop == attn.heads:
            source = None  # the fp8 rows' last reader: freed before the attention
        q, k = attn.normed_rotated(q_raw, k_raw, rope, ops)
        # the softmax gate is applied by the window softmax as it writes its output, or (an fp8 out_proj in the
        # fused form) as out_proj's input rows are quantised
        soft = window_softmax(
            q,
            k,
            v,
            layout,
            window,
            backend=ctx.backend,
            on_run=ctx.on_window_run,
            precision=ctx.precision,
            gate=None if quantized else gate[:, heads],
        )
        del q, k
        if quantized:
            attended = ops.gate_heads_input(soft, gate[:, heads], quantized)
        else:
            attended = soft.reshape(soft.shape[0], -1)
        del soft
        out = add_linear_cols(out, attn.out_proj, attended, heads.start * d, heads.stop * d)
        del attended
        if branch_on:
            seed = branch.text_state(x[t0:t1], k_raw[t0:t1], v[t0:t1], heads, run=run) if t1 > t0 else None
            readout = branch(x[r0:r1], q_raw[r0:r1], k_raw[r0:r1], v[r0:r1], grid, inner, seed, heads, run)
            del q_raw, k_raw, v
            # accumulated into the output's rows by to_out_linear's GEMM (one rounding, no [rows, hidden] buffer)
            add_linear_cols(out[r0:r1], attn.to_out_linear, readout.to(x.dtype), heads.start * d, heads.stop * d)
    return out


def hybrid_attention_ulysses(attn, x, rope, ctx: HybridContext, shards, run: RunOptions = PLAIN) -> torch.Tensor:
    """``hybrid_attention_forward`` with the sequence's rows split among the ranks of ``shards``
    (``parallel.SequenceShards``): ``x`` and ``rope`` this rank's rows, the result its rows of the output.

    Where the rows are: the projections, q/k norm and RoPE, the softmax gate, β's pre-activations and the output
    gate's bottleneck for every head, and each frame's partial sum of the rows. Exchanged: q, k, v (normed and raw)
    and β to every row of the rank's heads (``rows_to_heads``), the bottleneck rows gathered, the frame sums added
    up. Per head, on whole sequences: the window softmax and the linear branch with its text state. Back to the rows
    (``heads_to_rows``): the softmax output, gated and through ``out_proj`` there, and the branch's readout, through
    ``to_out_linear`` there. All heads at once (``run.head_groups`` is one rank's low-memory form)."""
    rows, heads, group = list(shards.rows), list(shards.heads), shards.group
    mine = heads[dist.get_rank(group)]
    start, stop = rows[dist.get_rank(group)]
    layout, window = ctx.layout, ctx.window
    bounds = window_bounds(layout.num_frames, window.radius, window.chunk)
    (r0, r1), inner = _branch_rows(ctx, bounds)
    branch_on = not is_full_cover(bounds, layout.num_frames) and bool(inner)
    branch: LinearBranch = attn.linear_attention
    if shards.softmax_ranks and branch_on:
        return _branch_split(attn, x, rope, ctx, shards, (r0, r1), inner, run)

    def to_heads(t):
        return rows_to_heads(t, rows, heads, group)

    gate = attn.softmax_gate(x)  # [t_r, H]
    q_raw, k_raw, v = attn.project(x)
    q, k = attn.normed_rotated(q_raw, k_raw, rope, run.block_ops)
    v = to_heads(v)
    soft = window_softmax(
        to_heads(q),
        to_heads(k),
        v,
        layout,
        window,
        backend=ctx.backend,
        on_run=ctx.on_window_run,
        precision=ctx.precision,
    )
    del q, k
    out = _softmax_output(attn, heads_to_rows(soft, rows, heads, group), gate, run)
    del soft
    if not branch_on:
        return out
    q_raw, k_raw = to_heads(q_raw), to_heads(k_raw)
    beta = to_heads(torch.nn.functional.linear(x, branch.beta_proj.weight)[..., None])[..., 0]  # [T, h_r]
    down = gather_rows(branch.output_gate.down(x), rows, group)
    sums = _frame_sums(x, (start, stop), (r0, r1), layout.tokens_per_frame, len(inner), group)
    placed = _readout_on_heads(branch, ctx, mine, (q_raw, k_raw, v), beta, sums, down, (r0, r1), inner, x.dtype, run)
    del q_raw, k_raw, v
    return _add_branch_output(attn, out, heads_to_rows(placed, rows, heads, group), (start, stop), (r0, r1))


def _readout_on_heads(branch, ctx: HybridContext, heads, qkv_raw, beta, sums, down, branch_rows, inner, dtype, run):
    """The linear branch on whole sequences of ``heads``: raw q, k, v ``[T, h, d]`` and β's pre-activations
    ``[T, h]`` of those heads, the frame sums (``_frame_sums``) and every row's output-gate bottleneck ``[T, b]``;
    its readout placed in ``[T, h, d]`` rows of ``dtype`` (zero outside the branch's rows), ready to go back to the
    rows' owners."""
    q_raw, k_raw, v = qkv_raw
    (r0, r1), (t0, t1), layout = branch_rows, ctx.text, ctx.layout
    seed = branch.text_state(None, k_raw[t0:t1], v[t0:t1], heads, beta[t0:t1], run) if t1 > t0 else None
    given = GivenRowInputs(branch, beta[r0:r1], sums / layout.tokens_per_frame, down[r0:r1])
    grid = (layout.frame_h, layout.frame_w)
    readout = branch(given, q_raw[r0:r1], k_raw[r0:r1], v[r0:r1], grid, inner, seed, heads, run)
    placed = readout.new_zeros(q_raw.shape[0], heads.stop - heads.start, q_raw.shape[-1], dtype=dtype)
    placed[r0:r1] = readout.view(r1 - r0, -1, q_raw.shape[-1])
    return placed


def _softmax_output(attn, soft, gate, run: RunOptions) -> torch.Tensor:
    """This rank's rows of the softmax side's output: ``soft`` ``[t_r, H, d]`` back on the rows, gated by ``gate``
    ``[t_r, H]`` and through ``out_proj``, all heads at once."""
    ops = run.block_ops
    attended = ops.gate_heads_input(soft, gate, ops.gates_while_quantizing(attn.out_proj, soft.device))
    return add_linear_cols(None, attn.out_proj, attended, 0, attn.heads * attn.head_dim)


def _add_branch_output(attn, out, readout, mine, branch_rows) -> torch.Tensor:
    """``out`` (this rank's rows ``mine``) plus the branch's ``readout`` ``[t_r, H, d]`` back on the rows, through
    ``to_out_linear``, on the rows the branch reads, as one rank adds it."""
    (start, stop), (r0, r1) = mine, branch_rows
    a, b = max(start, r0), min(stop, r1)
    if b > a:
        out[a - start : b - start].add_(attn.to_out_linear(readout[a - start : b - start].reshape(b - a, -1)))
    return out


def _frame_sums(x, mine, branch_rows, S, frames, group) -> torch.Tensor:
    """Each branch frame's sum of the rows ``x`` (this rank's ``mine`` = ``[start, stop)``), added up over the
    ranks: ``[frames, hidden]`` in the accumulation dtype, every rank the same."""
    (start, stop), (r0, r1) = mine, branch_rows
    sums = torch.zeros(frames, x.shape[-1], dtype=branch_fused.accumulation(x.dtype), device=x.device)
    a, b = max(start, r0), min(stop, r1)
    if b > a:
        frame_of = torch.arange(a, b, device=x.device) - r0
        sums.index_add_(0, frame_of // S, x[a - start : b - start].to(sums.dtype))
    dist.all_reduce(sums, group=group)
    return sums


def _branch_split(attn, x, rope, ctx: HybridContext, shards, branch_rows, inner, run: RunOptions) -> torch.Tensor:
    """The hybrid attention under VDN-H3's branch split: the first ``shards.softmax_ranks`` ranks run the window
    softmax of their ``softmax_heads``, the others the linear branch of their ``branch_heads``. Every rank owns rows:
    it projects them once and sends, in one uneven all-to-all, q, k (normed, rotated) and v of each softmax rank's
    heads to it, and raw q, k, v, β's pre-activations and the output gate's bottleneck of each branch rank's heads to
    that one; the frame sums are added up over all ranks; a reverse all-to-all returns both branches' heads to the
    row owners, which gate and project the softmax's and project the branch's."""
    rows, group = list(shards.rows), shards.group
    rank, n, d = dist.get_rank(group), shards.softmax_ranks, attn.head_dim
    start, stop = rows[rank]
    t_me = stop - start
    (r0, r1), layout, branch = branch_rows, ctx.layout, attn.linear_attention
    heads_of = list(shards.softmax_heads) + list(shards.branch_heads)  # rank r's heads, by its role
    width = branch.output_gate.down.out_features

    gate = attn.softmax_gate(x)
    q_raw, k_raw, v = attn.project(x)
    q, k = attn.normed_rotated(q_raw, k_raw, rope, run.block_ops)
    beta = torch.nn.functional.linear(x, branch.beta_proj.weight)
    down = branch.output_gate.down(x)
    sums = _frame_sums(x, (start, stop), (r0, r1), layout.tokens_per_frame, len(inner), group)
    sends = []
    for r, h in enumerate(heads_of):
        if r < n:
            sends.append(torch.stack([q[:, h], k[:, h], v[:, h]], 1))
        else:
            raw = [t[:, h].reshape(t_me, -1) for t in (q_raw, k_raw, v)]
            sends.append(torch.cat([*raw, beta[:, h], down], 1))
    del q, k, q_raw, k_raw
    h = heads_of[rank]
    count = h.stop - h.start
    shape = (3, count, d) if rank < n else (3 * count * d + count + width,)
    got = torch.cat(exchange_blocks(sends, [(b - a, *shape) for a, b in rows], group))
    del sends
    T = rows[-1][1]
    if rank < n:
        mine = window_softmax(
            *(got[:, i].contiguous() for i in range(3)),
            layout,
            ctx.window,
            backend=ctx.backend,
            on_run=ctx.on_window_run,
            precision=ctx.precision,
        )
    else:
        qkv = tuple(got[:, i * count * d : (i + 1) * count * d].reshape(T, count, d) for i in range(3))
        beta_h, down_all = got[:, 3 * count * d : 3 * count * d + count], got[:, 3 * count * d + count :]
        mine = _readout_on_heads(branch, ctx, h, qkv, beta_h, sums, down_all, (r0, r1), inner, x.dtype, run)
    del got
    back = exchange_blocks(
        [mine[a:b].contiguous() for a, b in rows], [(t_me, s.stop - s.start, d) for s in heads_of], group
    )
    out = _softmax_output(attn, torch.cat(back[:n], 1), gate, run)
    return _add_branch_output(attn, out, torch.cat(back[n:], 1), (start, stop), (r0, r1))
