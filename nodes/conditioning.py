"""CONDITIONING as the pack passes it: the host's ``[[tensor [1, L, width], {...}]]`` with the full
``PromptEmbedding`` (row tags, keyframe canvas) under ``"h3_prompt"``; a plain CONDITIONING from another
node is read as text rows."""

from __future__ import annotations

from h3_core.errors import H3InputError
from h3_core.pipeline.prompt import PromptEmbedding, from_conditioning

KEY = "h3_prompt"


def to_conditioning(embedding: PromptEmbedding) -> list:
    return [[embedding.embeds[None], {KEY: embedding}]]


def prompt_of(conditioning, name: str = "conditioning") -> PromptEmbedding:
    if not isinstance(conditioning, list) or len(conditioning) != 1 or len(conditioning[0]) != 2:
        count = len(conditioning) if isinstance(conditioning, list) else type(conditioning).__name__
        raise H3InputError(f"{name}: H3 takes one prompt (one CONDITIONING entry), got {count}; connect an H3 Text "
                           "Encode or a prompt-embedding loader")
    tensor, extra = conditioning[0]
    embedding = extra.get(KEY) if isinstance(extra, dict) else None
    return embedding if isinstance(embedding, PromptEmbedding) else from_conditioning(tensor)
