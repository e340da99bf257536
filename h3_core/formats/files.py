"""The safetensors files of one checkpoint: their headers (read without touching the tensors), their
metadata and their tensors, memory-mapped, or read straight onto a GPU through a ``StagedReader``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import H3InputError
from .staged_read import StagedReader

__all__ = ["CheckpointFiles", "read_header", "spans_of", "TORCH_DTYPES"]

# safetensors' dtype names (its format specification) -> torch's
TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointFiles:
    """The safetensors files of one checkpoint (a file, or a folder of shards), opened lazily. With a
    ``reader``, ``get`` reads each tensor onto the reader's device; without, it returns the memory-mapped
    tensor."""

    def __init__(self, path: str | Path, reader: StagedReader | None = None):
        self.path = Path(path)
        self.reader = reader
        if self.path.is_dir():
            # The official video VAE folder keeps its weights in source/ beside a config.json.
            files = sorted(self.path.glob("*.safetensors")) or sorted(self.path.glob("source/*.safetensors"))
        elif self.path.suffix == ".safetensors" and self.path.is_file():
            files = [self.path]
        elif self.path.suffix == ".gguf":
            raise H3InputError(f"{self.path}: GGUF checkpoints are not supported yet; use the .safetensors file")
        else:
            raise H3InputError(f"{self.path}: not a .safetensors file or a folder holding them")
        if not files:
            raise H3InputError(f"{self.path}: the folder holds no .safetensors files")
        self.files = files
        self._where: dict[str, Path] = {}
        self.dtypes: dict[str, str] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._spans: dict[str, tuple[int, int]] = {}  # key -> (first byte in its file, byte count)
        self.metadata: dict[str, str] = {}
        for f in files:
            header, size = _read_header(f)
            self.metadata.update(header.pop("__metadata__", None) or {})
            data_start = 8 + size
            for key, info in header.items():
                self._where[key] = f
                self.dtypes[key] = info["dtype"]
                self._shapes[key] = tuple(info["shape"])
                begin, end = info["data_offsets"]
                self._spans[key] = (data_start + begin, end - begin)
        self._handles: dict[Path, object] = {}

    @property
    def keys(self) -> set[str]:
        return set(self._where)

    @property
    def parameters(self) -> int:
        """How many values the files hold, every tensor counted (from the headers)."""
        return sum(math.prod(shape) for shape in self._shapes.values())

    def shape(self, key: str) -> tuple[int, ...]:
        """A tensor's shape, from the header (nothing is read)."""
        return self._shapes[key]

    def config(self) -> dict:
        """``config.json`` beside the weights (a diffusers folder), or {}."""
        folder = self.path if self.path.is_dir() else self.path.parent
        cfg = folder / "config.json"
        return json.loads(cfg.read_text(encoding="utf-8")) if self.path.is_dir() and cfg.is_file() else {}

    def latent_stats(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """Per-channel latent mean and std, from tensors in the file or a folder's ``config.json``."""
        if {"latents_mean", "latents_std"} <= self.keys:
            return tuple(tuple(self.get(k).double().tolist()) for k in ("latents_mean", "latents_std"))
        cfg = self.config()
        if cfg.get("latents_mean") and cfg.get("latents_std"):
            return tuple(cfg["latents_mean"]), tuple(cfg["latents_std"])
        return None

    def span(self, key: str) -> tuple[Path, int, int] | None:
        """Where ``get(key)`` reads from through the reader: (file, first byte, byte count); None when it would not
        go through the reader."""
        if self.reader is None or self.dtypes[key] not in TORCH_DTYPES:
            return None
        return (self._where[key], *self._spans[key])

    def read_keys(self, key: str) -> tuple[str, ...]:
        """The stored keys ``get(key)`` reads, in order."""
        return (key,)

    def get(self, key: str) -> torch.Tensor:
        f = self._where[key]
        if self.reader is not None and self.dtypes[key] in TORCH_DTYPES:
            offset, nbytes = self._spans[key]
            return self.reader.read(f, offset, nbytes, TORCH_DTYPES[self.dtypes[key]], self._shapes[key])
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt", device="cpu")
        return self._handles[f].get_tensor(key)


def spans_of(reads) -> list[tuple[Path, int, int]]:
    """The file ranges a reader is asked for when each ``(files, key)`` of ``reads`` is read in turn (for
    ``StagedReader.expect``): every stored key it reads, where it goes through the reader."""
    spans = []
    for files, key in reads:
        for stored in files.read_keys(key) or ():
            span = files.span(stored)
            if span is not None:
                spans.append(span)
    return spans


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file, read without touching the tensors."""
    return _read_header(path)[0]


def _read_header(path: Path) -> tuple[dict, int]:
    """``read_header`` and the header's length in bytes (the tensors start 8 bytes after it)."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise H3InputError(f"{path}: too short to be a safetensors file")
        if head[:4] == b"GGUF":
            raise H3InputError(
                f"{path}: a GGUF file (named .safetensors); GGUF checkpoints are not supported yet, "
                f"use the .safetensors file"
            )
        size = int.from_bytes(head, "little")
        if size <= 0 or size > 100 * 2**20:
            raise H3InputError(f"{path}: not a safetensors file (header size {size})")
        try:
            header = json.loads(fh.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise H3InputError(f"{path}: not a safetensors file ({exc.__class__.__name__} in its header)") from None
    if not isinstance(header, dict):
        raise H3InputError(f"{path}: not a safetensors file (its header is not a table of tensors)")
    needed = 8 + size + max((info["data_offsets"][1] for k, info in header.items() if k != "__metadata__"), default=0)
    actual = path.stat().st_size
    if actual < needed:
        raise H3InputError(
            f"{path}: truncated: the header describes {needed} bytes but the file has {actual}; download it again"
        )
    return header, size
