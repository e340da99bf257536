"""CONDITIONING as the pack passes it: the host's ``[[tensor [1, L, width], {...}]]`` with the full
``PromptEmbedding`` (row tags, keyframe canvas) under ``"h3_prompt"``. One from ComfyUI's own H3 text encoder
brings its row tags (``minimax_token_tags``) and, from its H3 conditioning nodes, its keyframes
(``minimax_keyframes``) or references (``minimax_refs``); any other CONDITIONING is read as text rows."""

from __future__ import annotations

import torch

from ..h3_core.errors import H3InputError
from ..h3_core.pipeline.native_latent import keyframe_from_native, reference_from_native
from ..h3_core.pipeline.prompt import PromptEmbedding, from_conditioning

KEY = "h3_prompt"
REFERENCES_KEY = "h3_references"  # (kinds in order, the length they were cut to) of a Ref2VA prompt
# the keys of ComfyUI's own H3 conditioning (Comfy-Org/ComfyUI model_base and nodes_minimax_h3)
NATIVE_TAGS, NATIVE_KEYFRAMES, NATIVE_REFERENCES = "minimax_token_tags", "minimax_keyframes", "minimax_refs"


def to_conditioning(embedding: PromptEmbedding, references: tuple = ()) -> list:
    return [[embedding.embeds[None], {KEY: embedding, REFERENCES_KEY: references}]]


def _extra(conditioning) -> dict:
    """The values beside the first CONDITIONING entry's tensor (empty where there are none)."""
    extra = conditioning[0][1] if isinstance(conditioning, list) and conditioning and len(conditioning[0]) == 2 else {}
    return extra if isinstance(extra, dict) else {}


def references_of(conditioning) -> tuple:
    """The Ref2VA references the prompt was encoded with: ``(kinds, length)`` or ``()``."""
    return _extra(conditioning).get(REFERENCES_KEY, ())


def prompt_of(conditioning, name: str = "conditioning") -> PromptEmbedding:
    if not isinstance(conditioning, list) or len(conditioning) != 1 or len(conditioning[0]) != 2:
        count = len(conditioning) if isinstance(conditioning, list) else type(conditioning).__name__
        raise H3InputError(
            f"{name}: H3 takes one prompt (one CONDITIONING entry), got {count}; connect an H3 Text "
            "Encode or a prompt-embedding loader"
        )
    tensor, extra = conditioning[0]
    extra = extra if isinstance(extra, dict) else {}
    embedding = extra.get(KEY)
    if isinstance(embedding, PromptEmbedding):
        return embedding
    tags = extra.get(NATIVE_TAGS)
    if tags is None:
        return from_conditioning(tensor)
    # ComfyUI's own H3 text encoder: its width is the encoder's (the sampler checks it against the DiT)
    tags = tags.reshape(-1).to("cpu", dtype=torch.long)
    return from_conditioning(tensor, tags, features=int(getattr(tensor, "shape", (0,))[-1]))


def _native(conditioning, key) -> list:
    return list(_extra(conditioning).get(key) or [])


def native_keyframes_of(conditioning) -> list:
    """The ``Keyframe``s a native H3 CONDITIONING carries, in its order (none for the pack's own)."""
    return [keyframe_from_native(entry, i) for i, entry in enumerate(_native(conditioning, NATIVE_KEYFRAMES), 1)]


def native_references_of(conditioning) -> list:
    """The ``ReferenceLatents`` a native H3 CONDITIONING carries, in its order (none for the pack's own)."""
    return [reference_from_native(block, i) for i, block in enumerate(_native(conditioning, NATIVE_REFERENCES), 1)]
