"""CONDITIONING as the pack passes it: the host's ``[[tensor [1, L, width], {...}]]`` with the full
``PromptEmbedding`` (row tags, keyframe canvas) under ``"h3_prompt"``; a plain CONDITIONING from another
node is read as text rows."""

from __future__ import annotations

from ..h3_core.errors import H3InputError
from ..h3_core.pipeline.prompt import PromptEmbedding, from_conditioning

KEY = "h3_prompt"
REFERENCES_KEY = "h3_references"  # (kinds in order, the length they were cut to) of a Ref2VA prompt


def to_conditioning(embedding: PromptEmbedding, references: tuple = ()) -> list:
    return [[embedding.embeds[None], {KEY: embedding, REFERENCES_KEY: references}]]


def references_of(conditioning) -> tuple:
    """The Ref2VA references the prompt was encoded with: ``(kinds, length)`` or ``()``."""
    extra = conditioning[0][1] if isinstance(conditioning, list) and conditioning and len(conditioning[0]) == 2 else {}
    return extra.get(REFERENCES_KEY, ()) if isinstance(extra, dict) else ()


def prompt_of(conditioning, name: str = "conditioning") -> PromptEmbedding:
    if not isinstance(conditioning, list) or len(conditioning) != 1 or len(conditioning[0]) != 2:
        count = len(conditioning) if isinstance(conditioning, list) else type(conditioning).__name__
        raise H3InputError(
            f"{name}: H3 takes one prompt (one CONDITIONING entry), got {count}; connect an H3 Text "
            "Encode or a prompt-embedding loader"
        )
    tensor, extra = conditioning[0]
    embedding = extra.get(KEY) if isinstance(extra, dict) else None
    return embedding if isinstance(embedding, PromptEmbedding) else from_conditioning(tensor)
