"""The Ulysses all-to-all between row shards and head shards, uneven rows and uneven heads included, through
``torch.distributed.all_to_all_single`` (NCCL on GPUs, gloo on the CPU): one exchange each way, every rank sending
each other rank the block it needs, nothing gathered whole."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["rows_to_heads", "heads_to_rows", "gather_rows", "gather_kind", "exchange_blocks", "first_rank"]


def first_rank(group=None) -> int:
    """The global rank of ``group``'s rank 0 (the one that leads, gathers and broadcasts)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def exchange_blocks(send_blocks: list[torch.Tensor], receive_shapes: list[tuple], group=None) -> list[torch.Tensor]:
    """Each rank sends ``send_blocks[r]`` to rank r and receives a block of ``receive_shapes[r]`` from it, in one
    ``all_to_all_single`` (blocks of any shape, empty ones included; all of one dtype)."""
    send = torch.cat([b.reshape(-1) for b in send_blocks])
    sizes_out = [b.numel() for b in send_blocks]
    sizes_in = [int(torch.Size(s).numel()) for s in receive_shapes]
    receive = send.new_empty(sum(sizes_in))
    dist.all_to_all_single(receive, send, sizes_in, sizes_out, group=group)
    return [part.view(shape) for part, shape in zip(receive.split(sizes_in), receive_shapes)]


def rows_to_heads(local: torch.Tensor, rows: list[tuple[int, int]], heads: list[slice], group=None) -> torch.Tensor:
    """This rank's rows of every head ``[t_r, H, d]`` → every row of this rank's heads ``[T, h_r, d]``."""
    rank = dist.get_rank(group)
    mine = heads[rank]
    blocks = [local[:, h].contiguous() for h in heads]
    shapes = [(stop - start, mine.stop - mine.start, local.shape[2]) for start, stop in rows]
    return torch.cat(exchange_blocks(blocks, shapes, group))


def heads_to_rows(local: torch.Tensor, rows: list[tuple[int, int]], heads: list[slice], group=None) -> torch.Tensor:
    """Every row of this rank's heads ``[T, h_r, d]`` → this rank's rows of every head ``[t_r, H, d]``."""
    rank = dist.get_rank(group)
    start, stop = rows[rank]
    blocks = [local[a:b].contiguous() for a, b in rows]
    shapes = [(stop - start, h.stop - h.start, local.shape[2]) for h in heads]
    return torch.cat(exchange_blocks(blocks, shapes, group), dim=1)


def gather_rows(local: torch.Tensor, rows: list[tuple[int, int]], group=None) -> torch.Tensor:
    """Every rank's rows ``[t_r, ...]`` → the whole ``[T, ...]`` on every rank. Shards are contiguous and all but the
    last non-empty one full (``sharding.row_shards``), so each is padded to the full size, gathered, and the
    first ``T`` rows of the concatenation are the sequence."""
    per = max(stop - start for start, stop in rows)
    padded = local.new_zeros(per, *local.shape[1:])
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in rows]
    dist.all_gather(parts, padded, group=group)
    return torch.cat(parts)[: rows[-1][1]]


def gather_kind(local: torch.Tensor, index: torch.Tensor, rows: list[tuple[int, int]], group=None) -> torch.Tensor:
    """Per-row results of one kind of row, every rank's ``[n_r, ...]`` for its rows of that kind (``index``: the
    kind's places in the sequence, in the kind's order; ``rows``: each rank's ``[start, stop)``) → all of them
    ``[len(index), ...]`` in the kind's order, on every rank. Each rank's part is padded to the largest and
    gathered; every rank works out which rows each part holds from ``index`` itself."""
    which = [((index >= start) & (index < stop)).nonzero().flatten() for start, stop in rows]
    per = max(int(w.numel()) for w in which)
    padded = local.new_zeros(per, *local.shape[1:])
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in rows]
    dist.all_gather(parts, padded, group=group)
    out = local.new_empty(index.shape[0], *local.shape[1:])
    for part, places in zip(parts, which):
        out[places] = part[: places.numel()]
    return out
