"""The state-dict shapes a model class has at a configuration, from an instance built on the meta device.

A server checks the same files for every prompt queued and its loaders check them again, each check matching the
file's keys against the model's shapes; building the DiT on the meta device takes a tenth of a second or more, so
the shapes are kept per (class, configuration).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

__all__ = ["meta_shapes"]


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
