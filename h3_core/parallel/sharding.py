"""How rows and heads are divided among ranks, as the published VDN-H3 divides them (its inference/utils/ulysses.py,
read in ``shared/reference/vdn_h3.md`` §6): the residual stream in contiguous row shards of ``ceil(T / P)`` rows, the
remainder on the last rank; heads as evenly as they go, the larger shares first (56 heads over 6 ranks: 10, 10, 9, 9,
9, 9)."""

from __future__ import annotations

from ..errors import H3InputError

__all__ = ["row_shards", "balanced_splits", "head_ranges"]


def row_shards(rows: int, ranks: int) -> list[tuple[int, int]]:
    """Each rank's rows ``[start, stop)``: ``ceil(rows / ranks)`` each, the last rank the remainder (possibly none)."""
    if ranks < 1 or rows < 0:
        raise H3InputError(f"row_shards: need rows >= 0 and ranks >= 1, got {rows} rows over {ranks} ranks")
    per = -(-rows // ranks)
    return [(min(rows, r * per), min(rows, (r + 1) * per)) for r in range(ranks)]


def balanced_splits(heads: int, parts: int) -> list[int]:
    """``heads`` over ``parts`` ranks as evenly as possible, the larger shares first; every rank gets a head."""
    if parts < 1 or heads < parts:
        raise H3InputError(f"{heads} heads cannot be shared by {parts} ranks: each rank needs at least one head")
    base, extra = divmod(heads, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def head_ranges(splits: list[int]) -> list[slice]:
    """The heads each rank holds, from ``balanced_splits``."""
    ranges, start = [], 0
    for count in splits:
        ranges.append(slice(start, start + count))
        start += count
    return ranges
