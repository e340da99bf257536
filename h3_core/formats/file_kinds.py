"""What a checkpoint file is, from its header alone: the check a loader runs before it reads any weight.

Each kind the pack loads has a describer that reads only the safetensors header (key names, shapes, dtypes,
metadata) — or a folder's config — and either returns a one-line summary or raises ``H3InputError`` with the
reason: a truncated file, a header whose length field lies, a pickle renamed ``.safetensors``, keys of another
layout. ``check_file`` runs the describer of the kind an input expects; when that fails, it tries the other
kinds, so a VAE picked as the DiT is refused as "a video VAE", with the loader to pick it in.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import H3InputError

__all__ = ["FileKind", "KINDS", "check_file", "describe_as"]


@dataclass(frozen=True)
class FileKind:
    name: str  # what the user is told the file is
    loader: str  # the node that loads it
    describe: Callable[[Path], str]  # a one-line summary, or H3InputError


def _dit(path: Path) -> str:
    from .checkpoints import describe_dit_checkpoint

    info = describe_dit_checkpoint(path)
    if info.is_branch:
        raise H3InputError(f"{path.name}: holds VDN-H3's linear branch, not the DiT's weights")
    return info.summary()


def _branch(path: Path) -> str:
    from .checkpoints import describe_dit_checkpoint

    info = describe_dit_checkpoint(path)
    if not info.is_branch:
        raise H3InputError(f"{path.name}: holds the DiT's own weights, not VDN-H3's linear branch")
    return info.summary()


def _video_vae(path: Path) -> str:
    from ..models.video_vae import VideoVAE, VideoVAEConfig
    from .vae import describe_model
    from .video_vae import layouts

    return "layout " + describe_model(VideoVAE, VideoVAEConfig, None, path, layouts, what="MiniMax H3 video VAE")


def _audio_vae(path: Path) -> str:
    from ..models.audio_vae import AudioVAE, AudioVAEConfig
    from .audio_vae import layouts
    from .vae import describe_model

    return "layout " + describe_model(
        AudioVAE, AudioVAEConfig, None, path, lambda cfg: layouts(), what="MiniMax H3 audio VAE"
    )


def _text_encoder(path: Path) -> str:
    if path.is_file():
        from .qwen3vl_checkpoint import describe_text_encoder_file

        found = describe_text_encoder_file(path)
        return f"Qwen3-VL file, {found.layout.name} layout, {found.layers} layers"
    folder = path / "text_encoder" if (path / "text_encoder").is_dir() else path
    config = folder / "config.json"
    if not path.is_dir() or not config.is_file():
        raise H3InputError(f"{path.name}: not a Qwen3-VL folder (no config.json in it or its text_encoder/)")
    try:
        kind = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except ValueError as exc:
        raise H3InputError(f"{config}: not valid JSON ({exc})") from None
    if kind != "qwen3_vl":
        raise H3InputError(f"{path.name}: its config.json describes a {kind!r} model, not Qwen3-VL ('qwen3_vl')")
    return "Qwen3-VL folder"


def _lora(path: Path) -> str:
    from .lora import describe_lora_file

    return describe_lora_file(path)


def _prompt_embedding(path: Path) -> str:
    from .files import CheckpointFiles

    if path.suffix == ".pt":
        return "prompt cache (.pt, read with weights_only)"
    keys = CheckpointFiles(path).keys
    if not {"prompt_embeds", "text_token_tags"} <= keys:
        raise H3InputError(
            f"{path.name}: a prompt embedding file needs tensors 'prompt_embeds' and 'text_token_tags', "
            f"found {sorted(keys)[:5]}"
        )
    return "prompt embedding"


KINDS = {
    "dit": FileKind("an H3 DiT checkpoint", "H3 DiT Loader (dit_name)", _dit),
    "linear_branch": FileKind("VDN-H3's linear branch", "H3 DiT Loader (linear_branch)", _branch),
    "video_vae": FileKind("the H3 video VAE", "H3 Video VAE Loader", _video_vae),
    "audio_vae": FileKind("the H3 audio VAE", "H3 Audio VAE Loader", _audio_vae),
    "text_encoder": FileKind("a Qwen3-VL text encoder", "H3 Text Encoder Loader", _text_encoder),
    "lora": FileKind("a LoRA", "H3 LoRA", _lora),
    "prompt_embedding": FileKind("a saved prompt embedding", "H3 Prompt Embedding Loader", _prompt_embedding),
}
# Kinds a file of one kind may be mistaken for, tried in this order when its own describer refuses it.
_OTHERS = ("dit", "linear_branch", "video_vae", "audio_vae", "text_encoder", "lora", "prompt_embedding")


def describe_as(path: str | Path, kind: str) -> str:
    """``kind``'s summary of ``path`` (its describer), or ``H3InputError``. Remembered per file version (path,
    size, modification time): a server validates the same files for every prompt queued."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as exc:
        raise H3InputError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    return _described(kind, path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _described(kind: str, path: Path, size: int, mtime_ns: int) -> str:
    return KINDS[kind].describe(path)


def check_file(path: str | Path, kind: str, input_name: str) -> str:
    """The summary of ``path`` read as ``kind``; otherwise an ``H3InputError`` that names ``input_name``, the file,
    why it was refused and, when the file is another kind the pack loads, which one and where it goes."""
    if kind not in KINDS:
        raise H3InputError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    path = Path(path)
    try:
        return describe_as(path, kind)
    except H3InputError as refused:
        reason = str(refused)
    for other in _OTHERS:
        if other == kind:
            continue
        try:
            describe_as(path, other)
        except (H3InputError, OSError):
            continue
        found = KINDS[other]
        raise H3InputError(
            f"{input_name}: '{path.name}' is {found.name}, not {KINDS[kind].name}; pick it in "
            f"{found.loader}, and pick {KINDS[kind].name} here"
        ) from None
    raise H3InputError(f"{input_name}: '{path.name}' cannot be loaded as {KINDS[kind].name}: {reason}") from None
