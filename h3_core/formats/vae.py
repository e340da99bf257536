"""Loading a VAE from a checkpoint, the part both VAEs share: sizes from the file's metadata, its latent
statistics, and its layout found from the header."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from ..errors import H3InputError
from .files import CheckpointFiles
from .keymap import KeyMap, load_into, match_layout
from .meta_shapes import cast_as_loaded, meta_shapes
from .quant_layers import describe_formats
from .quantized_files import QuantizedView, quantized_view
from .sizes import sizes_from_metadata

__all__ = ["describe_model", "load_model", "read_weights"]


def _sized(config_cls, cfg, files: CheckpointFiles):
    """``cfg``, or the sizes in the file's metadata, or the released ``config_cls()``; with the file's latent
    statistics when it carries them."""
    if cfg is None:
        cfg = sizes_from_metadata(files.metadata, config_cls, files.path) or config_cls()
    stats = files.latent_stats()
    if stats is not None:
        if len(stats[0]) != cfg.latent_channels:
            raise H3InputError(
                f"{files.path}: its latent statistics have {len(stats[0])} channels, a "
                f"{config_cls.__name__} has {cfg.latent_channels}"
            )
        cfg = replace(cfg, latents_mean=stats[0], latents_std=stats[1])
    return cfg


def describe_model(
    model_cls, config_cls, cfg, path, layouts: Callable[[object], Sequence[KeyMap]], *, what: str
) -> str:
    """The layout ``load_model`` would load ``path`` with, found from the file's header alone (no weight is
    read; a quantised file's sidecars describe its layers): its keys and shapes against ``model_cls`` built on the
    meta device, and the quantised formats it holds. Raises ``H3InputError`` for what ``load_model`` would
    refuse."""
    files = quantized_view(CheckpointFiles(path))
    cfg = _sized(config_cls, cfg, files)
    expected = meta_shapes(model_cls, cfg)
    keymap, plan = match_layout(files, list(expected), layouts(cfg), what)
    for key, (sources, combine) in plan.items():
        if combine is None and tuple(files.shape(sources[0])) != expected[key]:
            raise H3InputError(
                f"{files.path}: {what} key {sources[0]!r} has shape {files.shape(sources[0])}, the "
                f"{keymap.name} layout needs {expected[key]} for {key!r}"
            )
    if isinstance(files, QuantizedView):
        return f"{keymap.name}, {describe_formats(files.formats())}"
    return keymap.name


def load_model(
    model_cls,
    config_cls,
    cfg,
    path,
    layouts: Callable[[object], Sequence[KeyMap]],
    *,
    what: str,
    device,
    dtype: torch.dtype | None,
    keep_fp32: Callable[[str], bool] = lambda key: False,
    run_device=None,
):
    """Build ``model_cls(cfg)`` on the meta device and fill it from ``path``; the file's latent statistics
    (tensors, or a folder's ``config.json``) replace the config's. Without ``cfg``, the sizes come from the
    file's metadata (``h3_core.formats.sizes``) or are the released ``config_cls()``. ``model.layout`` names the
    layout found. ``run_device`` is where the model will run, when it is read elsewhere (``keymap.load_into``).

    ``device="meta"`` reads nothing: the model stays on the meta device, its tensors already in the dtypes the read
    will give them (so its size is the loaded one), until ``read_weights`` reads it where it is wanted."""
    files = CheckpointFiles(path)
    cfg = _sized(config_cls, cfg, files)
    with torch.device("meta"):
        model = model_cls(cfg)
    model.unread = _Unread(path, tuple(layouts(cfg)), what, dtype, keep_fp32, run_device)
    model.layout = None
    if torch.device(device).type == "meta":
        cast_as_loaded(model, dtype, keep_fp32)
    else:
        read_weights(model, device)
    return model.eval()


@dataclass(frozen=True)
class _Unread:
    """What ``load_model`` needs to read a model it left on the meta device."""

    path: object
    layouts: tuple[KeyMap, ...]
    what: str
    dtype: torch.dtype | None
    keep_fp32: Callable[[str], bool]
    run_device: object


def read_weights(model, device) -> bool:
    """Read the weights of a model ``load_model`` left on the meta device into ``device`` (a GPU straight through
    the staged reader); False when they were read already."""
    unread = getattr(model, "unread", None)
    if unread is None:
        return False
    model.layout = load_into(
        model,
        CheckpointFiles(unread.path),
        unread.layouts,
        what=unread.what,
        device=device,
        dtype=unread.dtype,
        keep_fp32=unread.keep_fp32,
        run_device=unread.run_device,
    )
    model.unread = None
    return True
