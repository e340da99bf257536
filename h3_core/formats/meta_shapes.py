"""The state-dict shapes a model class has at a configuration, from an instance built on the meta device, and
the dtypes a load gives a model built there.

A server checks the same files for every prompt queued and its loaders check them again, each check matching the
file's keys against the model's shapes; building the DiT on the meta device takes a tenth of a second or more, so
the shapes are kept per (class, configuration). A new process's first check would build every model again (about
half a second for the DiT, its branch and both VAEs): where ``keep_on_disk`` named a folder, the shapes are also
kept there, one file per (class, configuration, torch version, the sources of ``h3_core``), so a restarted server
reads them instead.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import torch

__all__ = ["cast_as_loaded", "meta_shapes", "keep_on_disk"]

_PACKAGE = Path(__file__).resolve().parents[1]  # h3_core: its sources decide what a class builds
_disk: list[Path | None] = [None]


def keep_on_disk(folder: str | Path | None) -> None:
    """Keep the shapes built from now on in ``folder`` as well (created when first written), and read them from
    there; None keeps them in memory only."""
    _disk[0] = None if folder is None else Path(folder)


def meta_shapes(build: Callable, cfg) -> dict[str, tuple[int, ...]]:
    """The state-dict shapes of ``build(cfg)`` (no memory, no weights): a new dict each call, built once per
    (``build``, ``cfg``) where ``cfg`` is hashable."""
    try:
        hash(cfg)
    except TypeError:  # a configuration holding lists (a file's latent statistics): built every time
        return dict(_built(build, cfg))
    return dict(_remembered(build, cfg))


def _built(build: Callable, cfg) -> tuple[tuple[str, tuple[int, ...]], ...]:
    folder = _disk[0]
    path = None if folder is None else folder / f"{_disk_key(build, cfg)}.json"
    if path is not None:
        try:
            return tuple((key, tuple(shape)) for key, shape in json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):  # not kept yet, or unreadable: built and written again
            pass
    with torch.device("meta"):
        module = build(cfg)
    shapes = tuple((key, tuple(value.shape)) for key, value in module.state_dict().items())
    if path is not None:
        _write(path, shapes)
    return shapes


@functools.lru_cache(maxsize=32)
def _remembered(build: Callable, cfg) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return _built(build, cfg)


@functools.lru_cache(maxsize=1)
def _sources_digest() -> str:
    digest = hashlib.sha256()
    for source in sorted(_PACKAGE.rglob("*.py")):
        digest.update(source.relative_to(_PACKAGE).as_posix().encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()


def _disk_key(build: Callable, cfg) -> str:
    """What a kept file is named for: the builder, the configuration (its repr: dataclasses print every field),
    torch's version and the digest of h3_core's sources."""
    what = f"{build.__module__}.{build.__qualname__}|{cfg!r}|{torch.__version__}|{_sources_digest()}"
    return f"{build.__qualname__}-{hashlib.sha256(what.encode()).hexdigest()[:32]}"


def _write(path: Path, shapes) -> None:
    """Written under a temporary name and renamed, so a reader never sees half a file; a folder that cannot be
    written to leaves the shapes in memory only."""
    partial = path.with_name(f".{path.stem}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps([[key, list(shape)] for key, shape in shapes]), encoding="utf-8")
        os.replace(partial, path)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)


def cast_as_loaded(model: torch.nn.Module, dtype: torch.dtype | None, keep_fp32: Callable[[str], bool]) -> None:
    """The floating-point tensors of ``model`` (built on the meta device) in the dtypes a load gives them: ``dtype``
    (None: as built) except the keys ``keep_fp32`` selects."""
    if dtype is None:
        return
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and not keep_fp32(name):
            tensor.data = tensor.data.to(dtype)
