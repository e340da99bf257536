"""Model sizes written into a checkpoint's safetensors metadata, for checkpoints that are not the released size.

The released files carry no sizes (the loaders default to the released model). A checkpoint of another
size — the pack's tiny random demo checkpoints, say — names its config dataclass under ``KIND_KEY`` and
its fields as JSON under ``SIZES_KEY``, and the loaders build that model when no config is given (sizes
of another kind of model are not taken: the loader then refuses the file as what it is). ``NOTE_KEY``
holds a line for the user about what the file is.
"""

from __future__ import annotations

import dataclasses
import json

from ..errors import H3InputError

__all__ = ["SIZES_KEY", "KIND_KEY", "NOTE_KEY", "sizes_metadata", "sizes_from_metadata"]

SIZES_KEY = "h3_hybrid.sizes"
KIND_KEY = "h3_hybrid.kind"
NOTE_KEY = "h3_hybrid.note"


def sizes_metadata(cfg, note: str | None = None) -> dict[str, str]:
    """safetensors metadata naming ``cfg``'s sizes (and ``note``, when given)."""
    meta = {KIND_KEY: type(cfg).__name__, SIZES_KEY: json.dumps(dataclasses.asdict(cfg))}
    if note:
        meta[NOTE_KEY] = note
    return meta


def sizes_from_metadata(metadata: dict[str, str], config_cls, where):
    """``config_cls`` built from the sizes in ``metadata``, or None when it names none (or names the sizes
    of another kind of model)."""
    text = metadata.get(SIZES_KEY)
    if text is None or metadata.get(KIND_KEY, config_cls.__name__) != config_cls.__name__:
        return None
    names = {f.name for f in dataclasses.fields(config_cls)}
    try:
        fields = json.loads(text)
        unknown = sorted(set(fields) - names)
        if unknown:
            raise ValueError(f"unknown fields {unknown}")
        return config_cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    except (ValueError, TypeError) as exc:
        raise H3InputError(
            f"{where}: the sizes in its metadata ({SIZES_KEY}) do not describe a {config_cls.__name__}: {exc}"
        ) from None
