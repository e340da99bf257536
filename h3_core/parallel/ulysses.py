"""Ulysses sequence parallelism for a dense attention: rows where they are for the per-row work, whole sequences of a
rank's heads for the attention itself."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..attention import dense_attention
from ..errors import H3InputError
from .exchange import gather_kind, heads_to_rows, rows_to_heads
from .sharding import balanced_splits, head_ranges, row_shards

__all__ = ["SequenceShards", "RankGroup", "ulysses_attention"]


@dataclass(frozen=True)
class SequenceShards:
    """Where a sequence's rows and an attention's heads live among the ranks of ``group``: ``rows`` each rank's
    ``[start, stop)``, ``heads`` each rank's heads. Given as a block's attention context, the attention runs on
    this rank's rows (``ulysses_attention``); given to a DiT's evaluation, its blocks do (``local_rows``) and the
    velocities are gathered (``velocities``)."""

    rows: tuple[tuple[int, int], ...]
    heads: tuple[slice, ...]
    group: object = None
    inner: object = None  # the attention context one rank would have had (a VDN-H3 model's ``HybridContext``)
    # VDN-H3's branch split: the first ``softmax_ranks`` ranks run the window softmax of ``softmax_heads`` (one range
    # each), the others the linear branch of ``branch_heads``; 0 is plain Ulysses (``heads`` for both)
    softmax_ranks: int = 0
    softmax_heads: tuple[slice, ...] = ()
    branch_heads: tuple[slice, ...] = ()

    @classmethod
    def of(cls, rows: int, heads: int, group=None, inner=None, softmax_ranks: int = 0) -> "SequenceShards":
        """``rows`` rows and ``heads`` heads shared among the ranks of ``group`` (``sharding``); with
        ``softmax_ranks`` = n (1 to ranks − 1), the branch split: the heads' softmax shared by the first n ranks,
        their linear branch by the others (6 + 2 on 8 ranks: 10, 10, 9, 9, 9, 9 | 28, 28)."""
        ranks = dist.get_world_size(group)
        split = {}
        if softmax_ranks:
            if not 0 < softmax_ranks < ranks:
                raise H3InputError(
                    f"softmax_ranks: got {softmax_ranks} of {ranks} ranks; allowed: 0 (plain Ulysses) or 1 to "
                    f"{ranks - 1} (the other ranks run the linear branch)"
                )
            split = dict(
                softmax_ranks=softmax_ranks,
                softmax_heads=tuple(head_ranges(balanced_splits(heads, softmax_ranks))),
                branch_heads=tuple(head_ranges(balanced_splits(heads, ranks - softmax_ranks))),
            )
        return cls(
            tuple(row_shards(rows, ranks)), tuple(head_ranges(balanced_splits(heads, ranks))), group, inner, **split
        )

    def attend(self, attn, x: torch.Tensor, rope, run=None) -> torch.Tensor:
        """``attn`` on this rank's rows ``x``: Ulysses dense attention (``ulysses_attention``), or with an ``inner``
        context that context's attention across the ranks (its ``attend_sharded``)."""
        if self.inner is None:
            return ulysses_attention(attn, x, rope, list(self.rows), list(self.heads), self.group, run)
        return self.inner.attend_sharded(attn, x, rope, self, run)

    @property
    def mine(self) -> slice:
        """This rank's rows."""
        start, stop = self.rows[dist.get_rank(self.group)]
        return slice(start, stop)

    def local_rows(self, rows: int, kinds) -> tuple[slice, list[tuple[torch.Tensor, torch.Tensor]]]:
        """This rank's rows of a sequence of ``rows`` rows, and for each kind of row (``kinds``: each kind's places in
        the sequence) those among them: their places among the rank's rows and which of the kind's rows they are
        (``models.whole_sequence`` the same for one process)."""
        if self.rows[-1][1] != rows:
            raise H3InputError(f"the sequence shards cover {self.rows[-1][1]} rows; the sequence has {rows}")
        mine = self.mine
        return mine, [_rows_within(index, mine) for index in kinds]

    def velocities(self, heads, timestep_index, kinds, picks) -> tuple[torch.Tensor, ...]:
        """The output heads on this rank's video and audio rows (``heads(timestep_index, video_places,
        audio_places)``, ``picks`` from ``local_rows``), then the velocities (not the hidden rows) gathered: every rank
        returns the whole of each kind (``kinds``: their places in the sequence)."""
        local = heads(timestep_index[self.mine], *(places for places, _ in picks))
        return tuple(gather_kind(part, index, list(self.rows), self.group) for part, index in zip(local, kinds))


def _rows_within(index: torch.Tensor, mine: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Of one kind's rows (``index``: their places in the sequence), those in ``mine``: their places among the
    rank's rows and which of the kind's rows they are."""
    which = ((index >= mine.start) & (index < mine.stop)).nonzero().flatten()
    return index[which] - mine.start, which


@dataclass(frozen=True)
class RankGroup:
    """The ranks one clip's evaluations run on: the ``torch.distributed`` ``group`` (None: the default group) and
    VDN-H3's branch split (``softmax_ranks``, 0 for plain Ulysses). Every rank runs the same sampler loop with
    the same inputs; each evaluation's blocks run on the rank's rows (``SequenceShards``)."""

    group: object = None
    softmax_ranks: int = 0

    def shards(self, rows: int, heads: int, inner=None) -> SequenceShards:
        """The shards of a sequence of ``rows`` rows for a model of ``heads`` heads; ``inner`` the one-rank context
        (a VDN-H3 model's ``HybridContext``, or None for dense attention, which ignores the branch split)."""
        split = self.softmax_ranks if inner is not None else 0
        return SequenceShards.of(rows, heads, self.group, inner, split)


def ulysses_attention(attn, x: torch.Tensor, rope, rows, heads, group=None, run=None) -> torch.Tensor:
    """An H3 ``Attention``'s forward with the sequence's rows split across the ranks of ``group``: this rank's rows
    ``x`` ``[t_r, hidden]`` and their RoPE ``rope`` (cos, sin ``[t_r, n]``, or None) → its rows of the output.
    q, k and v are projected and q and k normed and rotated where the rows are, exchanged to every row of this rank's
    heads (``rows``: ``sharding.row_shards``, ``heads``: ``sharding.head_ranges``), attended, exchanged back, and
    ``out_proj`` runs on the rows: per row and per head the single process's arithmetic. ``run``: the evaluation's
    ``RunOptions`` (its ``block_ops`` for the q/k norm and RoPE), None for the plain ops."""
    q, k, v = attn.project(x)
    q, k = attn.normed_rotated(q, k, rope) if run is None else attn.normed_rotated(q, k, rope, run.block_ops)
    q, k, v = (rows_to_heads(t, rows, heads, group) for t in (q, k, v))
    attended = heads_to_rows(dense_attention(q, k, v).out, rows, heads, group)
    return attn.out_proj(attended.reshape(attended.shape[0], -1))
