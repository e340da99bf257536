"""AdaLN tables computed ahead, so the blocks' AdaLN projections can stay in host memory.

Each block turns the step's time embedding ``[K, 2688]`` into its modulation table ``[K, 18 · hidden]``
through a linear of 260 M parameters: 24 GiB of bf16 over the released 50 blocks, a third of the model,
used for a product that is tiny next to the rest of the evaluation. The timesteps of a whole denoising
run are known before it starts, so the tables can be made once — each block's projection visiting the
device once — and looked up by timesteps during sampling (the same numbers as computing them each
step). ``keep_adaln_on_host`` does that bookkeeping: weights to host, tables prepared per run by
``prepare_adaln_tables`` (the sampler calls it), dropped by ``clear_adaln_tables``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from ..errors import H3InputError
from .host_arena import HostArena, aligned

__all__ = ["keep_adaln_on_host", "prepare_adaln_tables", "clear_adaln_tables", "adaln_tables_for"]


def _key(timesteps: torch.Tensor) -> tuple[float, ...]:
    return tuple(float(t) for t in timesteps.detach().flatten().tolist())


def _time_embedding(model, timesteps: torch.Tensor) -> torch.Tensor:

    if model.cfg.adaln_curve_grid > 0:
        return curve_embedding(model.adaln_t_table, timesteps)
    return model.time_embedder(timesteps)


def keep_adaln_on_host(model) -> int:
    """Move every block's AdaLN projection to host memory — one arena, page-locked when the model is on CUDA —
    and from now on evaluate only timesteps whose tables were prepared. Returns the bytes moved off the device."""
    params = [p for block in model.blocks for p in block.adaln_proj.linear.parameters() if p.device.type != "cpu"]
    for block in model.blocks:
        block.adaln_proj.stays_on_host = True  # block offload neither streams nor moves it
    model.adaln_on_host = True
    model.adaln_tables = {}
    if not params:
        return 0
    cuda = next((p.device for p in params if p.device.type == "cuda"), None)
    nbytes = [p.numel() * p.element_size() for p in params]
    arena = HostArena(sum(aligned(n) for n in nbytes), "the AdaLN projections")
    offset = 0
    with torch.no_grad():
        for param, n in zip(params, nbytes):
            host = arena.bytes[offset : offset + n].view(param.dtype).view(param.shape)
            host.copy_(param.data)
            param.data = host  # the device copy is released here, one projection at a time
            offset += aligned(n)
    if cuda is not None:
        arena.pin(cuda)
    model._adaln_arena = arena  # lives as long as the weights in it
    return sum(nbytes)


def prepare_adaln_tables(model, timestep_sets: Iterable[torch.Tensor], device) -> int:
    """Compute every block's table for each set of timesteps (``[K]``, as the model will be called with) on
    ``device``, each block's weights visiting it once. Returns the bytes the tables take."""
    sets = {}
    for timesteps in timestep_sets:
        sets.setdefault(_key(timesteps), timesteps.to(device))
    if not sets:
        return 0
    keys = list(sets)
    with torch.no_grad():
        embeddings = [_time_embedding(model, sets[k]) for k in keys]
        tables: dict[tuple[float, ...], list[torch.Tensor]] = {k: [] for k in keys}
        for block in model.blocks:
            projection = block.adaln_proj
            # The host storage itself (not the Parameter, whose .data is repointed below) is put back after.
            weight, bias = projection.linear.weight.data, projection.linear.bias.data
            visiting = weight.device != torch.device(device)
            if visiting:
                projection.linear.weight.data = weight.to(device, non_blocking=True)
                projection.linear.bias.data = bias.to(device, non_blocking=True)
            try:
                for k, temb in zip(keys, embeddings):
                    tables[k].append(projection.table(temb))
            finally:
                if visiting:
                    projection.linear.weight.data, projection.linear.bias.data = weight, bias
    model.adaln_tables = {**getattr(model, "adaln_tables", {}), **tables}
    return sum(t.numel() * t.element_size() for ts in tables.values() for t in ts)


def clear_adaln_tables(model) -> None:
    model.adaln_tables = {}


def adaln_tables_for(model, timesteps: torch.Tensor):
    """The prepared tables (``PrecomputedTable`` per block) for ``timesteps``, or None to compute them in the
    blocks. A model whose projections are in host memory refuses timesteps it was not prepared for."""

    prepared = getattr(model, "adaln_tables", None)
    if not prepared and not getattr(model, "adaln_on_host", False):
        return None
    key = _key(timesteps)
    tables = (prepared or {}).get(key)
    if tables is None:
        if getattr(model, "adaln_on_host", False):
            raise H3InputError(
                f"the AdaLN projections are in host memory and no tables were prepared for timesteps "
                f"{list(key)}; call prepare_adaln_tables with the run's timesteps first"
            )
        return None
    return [PrecomputedTable(t) for t in tables]


@dataclass(frozen=True)
class PrecomputedTable:
    """One block's AdaLN table for the current timesteps, computed ahead (``models.adaln_tables``)."""

    table: torch.Tensor


def curve_embedding(table: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The curve form's time embedding: rows of ``table`` [G, r] interpolated linearly at t·(G−1), t clamped
    to [0, 1] (the last interval is closed at t = 1)."""
    position = t.to(table.dtype).clamp(0.0, 1.0) * (table.shape[0] - 1)
    lower = position.floor().long().clamp(max=table.shape[0] - 2)
    return torch.lerp(table[lower], table[lower + 1], (position - lower)[:, None])
