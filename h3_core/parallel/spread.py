"""Independent pieces of work shared among ranks and their results brought to rank 0 in order (the video decoder's
tile batches: each decoded whole on one rank, as the tiles' attention is tile-local)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .exchange import first_rank

__all__ = ["spread_in_order"]

_MAX_DIMS = 8  # a result's shape travels as this many int64s, -1 beyond its last dimension


def spread_in_order(
    items: Sequence, work: Callable[[object], torch.Tensor], device, group=None, dtype=torch.float32
) -> list[torch.Tensor] | None:
    """``work(item)`` on the rank that owns it (item i on rank ``i mod P`` of ``group``); rank 0 receives the others'
    results (``dtype``, onto ``device``) and returns every result in the items' order, the other ranks return None.
    Each rank first runs all its own items, then the results travel point to point in item order."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    mine = {i: work(item) for i, item in enumerate(items) if i % ranks == rank}
    first = first_rank(group)
    if rank != 0:
        for i in sorted(mine):
            result = mine[i].to(dtype).contiguous()
            shape = torch.full((_MAX_DIMS,), -1, dtype=torch.int64, device=result.device)
            shape[: result.dim()] = torch.tensor(result.shape, dtype=torch.int64)
            dist.send(shape, first, group=group)
            dist.send(result, first, group=group)
        return None
    results = []
    for i in range(len(items)):
        if i in mine:
            results.append(mine[i])
            continue
        source = i % ranks if group is None else dist.get_global_rank(group, i % ranks)
        shape = torch.empty(_MAX_DIMS, dtype=torch.int64, device=device)
        dist.recv(shape, source, group=group)
        result = torch.empty([d for d in shape.tolist() if d >= 0], dtype=dtype, device=device)
        dist.recv(result, source, group=group)
        results.append(result)
    return results
