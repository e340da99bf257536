"""How much device memory one rank needs for its share of a DiT evaluation across several GPUs
(``parallel.SequenceShards``), before running it.

Every rank holds the whole model (``predict.weight_bytes``). Its activations are written, as ``predict``'s, in
buffers of a width times a number of rows, read off the Ulysses forward (``models.hybrid.hybrid_attention_ulysses``
and ``_branch_split``): ``D`` = the rank's rows × hidden, ``Ir`` = its rows × inner (every head), ``Is`` / ``Ib`` =
every row of the sequence × the heads whose window softmax / linear branch it runs, ``Cb`` = the branch's rows ×
those branch heads, each times the element size. The phase where each peaks:

* Plain Ulysses, the window softmax: the modulated input (1 D), q, k, v projected on the rows (3 Ir, one stacked
  tensor) and q, k normed (2 Ir); on the heads v, q and k (3 Is), the softmax's output (1 Is) and its own work
  (``SOFTMAX_WORK`` Is).
* Plain Ulysses, the linear branch: the modulated input and the softmax side's output on the rows (2 D); v,
  raw q and k and the readout on the heads (4 Ib) and the branch's own buffers (``FUSED_BRANCH_BUFFERS`` or
  ``BRANCH_BUFFERS`` Cb, as one process's).
* The branch split, the exchange: the modulated input (1 D), q, k, v on the rows (3 Ir) and every rank's block of
  them (each softmax rank's normed q, k, v and each branch rank's raw ones with β and the gate's bottleneck: 6 Ir),
  with, during the all-to-all, their concatenation (6 Ir) and what the rank receives (R: 3 Is, or 3 Ib with β and
  every row's bottleneck), then, while that is concatenated, R twice.
* The branch split, the work: the input and q, k, v on the rows (1 D + 3 Ir), what was received (as above, once)
  and a softmax rank's contiguous q, k, v, output and work (4 Is + ``SOFTMAX_WORK`` Is), or a branch rank's
  readout (1 Ib) and own buffers.
* The FFN on the rank's rows, as one process's (``predict.block_peaks``).

Beside the block, the hidden state of the rank's rows lives through the evaluation (1 D). ``SOFTMAX_WORK`` is the
one measured constant: plain Ulysses on 2, 4 and 8 ranks at the release length (``bench/results/rank_shares.md``,
fused blocks, fp8 linears, one head group), where the rest is read off the code; the branch split was measured at
6 + 2 on 8 ranks only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel.sharding import balanced_splits, row_shards
from .predict import (
    BRANCH_BUFFERS,
    FP8_SOFTMAX_TEMPS,
    FUSED_BRANCH_BUFFERS,
    FUSED_ROTATE_TEMPS,
    BlockShape,
    weight_bytes,
)

__all__ = ["RankShare", "rank_shares", "rank_peaks", "SOFTMAX_WORK"]

SOFTMAX_WORK = 0.3  # the window softmax's own buffers on a rank, in Is (measured; module docstring)
GATE_BOTTLENECK = 128  # the output gate's bottleneck width, sent to every branch rank with each row


@dataclass(frozen=True)
class RankShare:
    """One rank's share: its ``rows`` of the sequence and the heads whose window softmax (``softmax_heads``) and
    linear branch (``branch_heads``) it runs; ``split``: VDN-H3's branch split (the uneven exchange)."""

    rank: int
    rows: int
    softmax_heads: int
    branch_heads: int
    split: bool


def rank_shares(cfg, rows: int, ranks: int, softmax_ranks: int = 0) -> list[RankShare]:
    """Every rank's share of a sequence of ``rows`` rows for a model of ``cfg`` (``parallel.SequenceShards.of``'s
    split: rows in equal runs, heads balanced; ``softmax_ranks`` n > 0 the branch split)."""
    spans = row_shards(rows, ranks)
    if not softmax_ranks:
        heads = balanced_splits(cfg.heads, ranks)
        branch = heads if cfg.hybrid else [0] * ranks
        return [RankShare(r, b - a, h, hb, False) for r, ((a, b), h, hb) in enumerate(zip(spans, heads, branch))]
    softmax = balanced_splits(cfg.heads, softmax_ranks)
    branch = balanced_splits(cfg.heads, ranks - softmax_ranks)
    return [
        RankShare(
            r,
            b - a,
            softmax[r] if r < softmax_ranks else 0,
            0 if r < softmax_ranks else branch[r - softmax_ranks],
            True,
        )
        for r, (a, b) in enumerate(spans)
    ]


def rank_peaks(
    cfg,
    shape: BlockShape,
    share: RankShare,
    *,
    fused: bool = True,
    ffn_chunk_rows: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    linears: str = "dtype",
    attention_precision: str = "bf16",
) -> dict[str, float]:
    """Predicted peak device bytes of ``share``'s part of one evaluation of a sequence of ``shape`` (one head group):
    ``weights`` (the whole model), ``activations`` (the rank's hidden rows and its largest block phase) and
    ``total``; the phases ``softmax``, ``branch`` (plain Ulysses) or ``exchange``, ``work`` (the branch split) and
    ``ffn``. ``attention_precision="fp8"``: the window softmax's e4m3 buffers on the rank's heads, as one process's
    beyond its fused rotation (``FP8_SOFTMAX_TEMPS`` − ``FUSED_ROTATE_TEMPS``) Is; not measured on ranks."""
    e, T, d = shape.element, shape.rows, cfg.head_dim
    D = share.rows * cfg.hidden * e
    Ir = share.rows * cfg.inner * e
    Is = T * share.softmax_heads * d * e
    Ib = T * share.branch_heads * d * e
    Cb = shape.branch_rows * share.branch_heads * d * e
    own = (FUSED_BRANCH_BUFFERS if fused else BRANCH_BUFFERS)[1]
    work = SOFTMAX_WORK + (FP8_SOFTMAX_TEMPS - FUSED_ROTATE_TEMPS if attention_precision == "fp8" else 0.0)
    chunk = share.rows if ffn_chunk_rows is None else min(share.rows, ffn_chunk_rows)
    phases = dict(ffn=2 * D + 2 * chunk * cfg.ffn * e + (chunk * cfg.hidden * e + D if chunk < share.rows else D))
    if not share.split:
        phases["softmax"] = D + 5 * Ir + (4 + work) * Is
        if share.branch_heads and shape.branch_rows:
            phases["branch"] = 2 * D + 4 * Ib + own * Cb
    else:
        extra = T * (share.branch_heads + GATE_BOTTLENECK) * e if share.branch_heads else 0
        received = 3 * Is + 3 * Ib + extra
        # during the all-to-all (the blocks and their concatenation sent), then while what came is concatenated
        phases["exchange"] = D + max(15 * Ir + received, 9 * Ir + 2 * received)
        if share.softmax_heads:
            phases["work"] = D + 3 * Ir + received + (4 + work) * Is
        else:
            phases["work"] = D + 3 * Ir + received + Ib + own * Cb
    activations = D + max(phases.values())
    weights = weight_bytes(cfg, dtype, linears=linears).total
    return dict(
        {name: float(v) for name, v in phases.items()},
        weights=float(weights),
        activations=float(activations),
        total=float(weights + activations),
    )
