"""The state-dict shapes a model class has at a configuration, from an instance built on the meta device, and
the dtypes a load gives a model built there.

A server checks the same files for every prompt queued and its loaders check them again, each check matching the
file's keys against the model's shapes; the shapes are built once per (class, configuration) in a process.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

__all__ = ["cast_as_loaded", "meta_shapes"]


def meta_shapes(build: Callable, cfg) -> dict[str, tuple[int, ...]]:
    """The state-dict shapes of ``build(cfg)`` (no memory, no weights): a new dict each call, built once per
    (``build``, ``cfg``) where ``cfg`` is hashable."""
    try:
        hash(cfg)
    except TypeError:  # a configuration holding lists (a file's latent statistics): built every time
        return dict(_built(build, cfg))
    return dict(_remembered(build, cfg))


def _built(build: Callable, cfg) -> tuple[tuple[str, tuple[int, ...]], ...]:
    with torch.device("meta"):
        module = build(cfg)
    return tuple((key, tuple(value.shape)) for key, value in module.state_dict().items())


@functools.lru_cache(maxsize=32)
def _remembered(build: Callable, cfg) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return _built(build, cfg)


def cast_as_loaded(model: torch.nn.Module, dtype: torch.dtype | None, keep_fp32: Callable[[str], bool]) -> None:
    """The floating-point tensors of ``model`` (built on the meta device) in the dtypes a load gives them: ``dtype``
    (None: as built) except the keys ``keep_fp32`` selects."""
    if dtype is None:
        return
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and not keep_fp32(name):
            tensor.data = tensor.data.to(dtype)
