"""Text conditioning that arrives already encoded: prompt-embedding files and ComfyUI CONDITIONING.

H3 is conditioned on Qwen3-VL's layer-50 hidden states ``[L, 5120]`` with one tag per row (1 text, 0 for
the rows of a vision block inside the text). Three sources give them:

* a VDN prompt cache (``.pt``), a dict with ``prompt``, ``prompt_embeds`` ``[L, 5120]``, ``text_token_tags``
  ``[L]`` and, for keyframe or reference requests, ``keyframe_anchors``, ``keyframe_files``,
  ``condition_latents`` (``[1, 24, 1, h, w]`` each), ``height``, ``width`` — read with
  ``torch.load(weights_only=True)``, so no code in the file ever runs;
* the same content as safetensors: tensors ``prompt_embeds``, ``text_token_tags`` and
  ``condition_latents.{i}``; the strings and numbers in the metadata as JSON under the key ``h3_prompt``
  (``{"prompt": ..., "keyframe_anchors": [...], "keyframe_files": [...], "height": ..., "width": ...}``);
* a ComfyUI CONDITIONING tensor ``[1, L, 5120]``, every row tagged text unless tags come with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import H3InputError

__all__ = ["PromptEmbedding", "load_prompt_embedding", "save_prompt_embedding", "from_conditioning", "TEXT_WIDTH"]

TEXT_WIDTH = 5120
_META_KEY = "h3_prompt"


@dataclass
class PromptEmbedding:
    embeds: torch.Tensor  # [L, 5120]
    tags: torch.Tensor  # [L] int64: 1 text, 0 vision rows
    prompt: str = ""
    keyframe_anchors: tuple[str, ...] = ()
    keyframe_files: tuple[str, ...] = ()
    condition_latents: list[torch.Tensor] = field(default_factory=list)  # [1, 24, 1, h, w] each
    height: int | None = None
    width: int | None = None
    features: int = TEXT_WIDTH  # the text model's width (5120 for H3's Qwen3-VL-32B)

    def __post_init__(self):
        _check(self.embeds, self.tags, "prompt embedding", self.features)


def _check(embeds, tags, source, features=TEXT_WIDTH):
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 2 or embeds.shape[1] != features:
        shape = tuple(embeds.shape) if isinstance(embeds, torch.Tensor) else type(embeds).__name__
        raise H3InputError(f"{source}: the embeddings must be [tokens, {features}] (Qwen3-VL layer 50), got {shape}")
    if not embeds.is_floating_point():
        raise H3InputError(f"{source}: the embeddings must be floating point, got {embeds.dtype}")
    if not isinstance(tags, torch.Tensor) or tags.shape != (embeds.shape[0],):
        shape = tuple(tags.shape) if isinstance(tags, torch.Tensor) else type(tags).__name__
        raise H3InputError(f"{source}: needs one tag per token ({embeds.shape[0]}), got {shape}")
    bad = sorted(set(tags.tolist()) - {0, 1})
    if bad:
        raise H3InputError(f"{source}: token tags must be 1 (text) or 0 (vision rows), found {bad}")


def from_conditioning(
    cond: torch.Tensor, tags: torch.Tensor | None = None, features: int = TEXT_WIDTH
) -> PromptEmbedding:
    """A ComfyUI CONDITIONING tensor ``[1, L, features]`` (5120: H3's Qwen3-VL); rows are text unless ``tags`` say
    otherwise."""
    if not isinstance(cond, torch.Tensor) or cond.dim() != 3 or cond.shape[0] != 1:
        shape = tuple(cond.shape) if isinstance(cond, torch.Tensor) else type(cond).__name__
        raise H3InputError(
            f"conditioning must be one [1, tokens, {features}] tensor, got {shape}; connect the "
            "output of an H3 text encoder"
        )
    embeds = cond[0]
    tags = torch.ones(embeds.shape[0], dtype=torch.long) if tags is None else tags.reshape(-1).to(torch.long)
    return PromptEmbedding(embeds, tags, features=features)


def load_prompt_embedding(path: str | Path) -> PromptEmbedding:
    """Read a ``.pt`` prompt cache or its ``.safetensors`` equivalent (module docstring)."""
    path = Path(path)
    if path.suffix == ".pt":
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # pickle payloads outside the allowed types end here, unexecuted
            raise H3InputError(
                f"{path}: not a prompt cache this pack reads ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
            ) from None
        if not isinstance(data, dict) or "prompt_embeds" not in data or "text_token_tags" not in data:
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise H3InputError(f"{path}: a prompt cache needs 'prompt_embeds' and 'text_token_tags', found {keys}")
        meta = data
        embeds, tags = data["prompt_embeds"], data["text_token_tags"]
        latents = list(data.get("condition_latents") or [])
    elif path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            if not {"prompt_embeds", "text_token_tags"} <= keys:
                raise H3InputError(
                    f"{path}: a prompt embedding file needs tensors 'prompt_embeds' and "
                    f"'text_token_tags', found {sorted(keys)[:8]}"
                )
            meta = json.loads((f.metadata() or {}).get(_META_KEY, "{}"))
            embeds, tags = f.get_tensor("prompt_embeds"), f.get_tensor("text_token_tags")
            latents = [
                f.get_tensor(f"condition_latents.{i}") for i in range(len(keys)) if f"condition_latents.{i}" in keys
            ]
    else:
        raise H3InputError(f"{path}: prompt embeddings come as .pt (prompt cache) or .safetensors, not '{path.suffix}'")
    features = meta.get("features", TEXT_WIDTH) if path.suffix == ".safetensors" else TEXT_WIDTH
    _check(embeds, tags, str(path), features)
    anchors = tuple(meta.get("keyframe_anchors") or ())
    if len(anchors) != len(latents):
        raise H3InputError(f"{path}: {len(anchors)} keyframe anchors but {len(latents)} condition latents")
    return PromptEmbedding(
        embeds,
        tags.to(torch.long),
        str(meta.get("prompt", "")),
        anchors,
        tuple(meta.get("keyframe_files") or ()),
        latents,
        meta.get("height"),
        meta.get("width"),
        features,
    )


def save_prompt_embedding(path: str | Path, embedding: PromptEmbedding) -> None:
    """Write the safetensors form, to a temporary name renamed when complete."""
    path = Path(path)
    tensors = {"prompt_embeds": embedding.embeds.contiguous(), "text_token_tags": embedding.tags.to(torch.long)}
    tensors.update({f"condition_latents.{i}": z.contiguous() for i, z in enumerate(embedding.condition_latents)})
    meta = {
        "prompt": embedding.prompt,
        "keyframe_anchors": list(embedding.keyframe_anchors),
        "keyframe_files": list(embedding.keyframe_files),
        "height": embedding.height,
        "width": embedding.width,
        "features": embedding.features,
    }
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata={_META_KEY: json.dumps(meta)})
    partial.replace(path)
