"""Prompt encoding with Qwen3-VL, as H3 was trained: the hidden states after decoder layer 50 (no final
norm), no chat template and no special tokens around the prompt, every prompt row tagged as text.

The encoder loads from a local Hugging Face folder holding the config and weights (``text_encoder/``) and
the tokenizer (``tokenizer/``, or the same folder). Only the first 50 layers run: a hook on layer 50 takes
its output and stops the forward, which is exactly ``hidden_states[50]`` of a full run without computing
the layers after it. Keyframe and reference images (vision blocks inside the text) are not handled here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import H3InputError
from .prompt import PromptEmbedding

__all__ = ["TextEncoder", "load_text_encoder", "CONDITIONING_LAYER"]

CONDITIONING_LAYER = 50


class _Stop(Exception):
    def __init__(self, hidden):
        self.hidden = hidden


class TextEncoder:
    def __init__(self, model, tokenizer, layer: int = CONDITIONING_LAYER):
        self.model, self.tokenizer, self.layer = model, tokenizer, layer
        layers = self.language_model.layers
        if not 1 <= layer <= len(layers):
            raise H3InputError(f"conditioning layer {layer} is outside the text model's {len(layers)} layers")

    @property
    def language_model(self):
        return self.model.model.language_model

    @torch.no_grad()
    def encode(self, prompt: str) -> PromptEmbedding:
        """``prompt`` → its layer-50 states ``[L, hidden]`` (the model's dtype) with all rows tagged text."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise H3InputError("the prompt is empty; describe the clip to generate")
        ids = self.tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        device = next(self.model.parameters()).device

        def stop(module, args, output):
            raise _Stop(output[0] if isinstance(output, tuple) else output)

        handle = self.language_model.layers[self.layer - 1].register_forward_hook(stop)
        try:
            self.language_model(input_ids=ids.to(device))
            raise RuntimeError("the text model returned before its conditioning layer ran")
        except _Stop as done:
            hidden = done.hidden[0]
        finally:
            handle.remove()
        return PromptEmbedding(hidden.cpu(), torch.ones(hidden.shape[0], dtype=torch.long), prompt,
                               features=hidden.shape[-1])


def load_text_encoder(folder: str | Path, *, device="cpu", dtype: torch.dtype = torch.bfloat16,
                      layer: int = CONDITIONING_LAYER) -> TextEncoder:
    """Load Qwen3-VL from a local folder: ``folder`` itself or its ``text_encoder/`` and ``tokenizer/``."""
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    folder = Path(folder)
    model_dir = folder / "text_encoder" if (folder / "text_encoder").is_dir() else folder
    token_dir = folder / "tokenizer" if (folder / "tokenizer").is_dir() else model_dir
    if not (model_dir / "config.json").is_file():
        raise H3InputError(f"{model_dir}: no config.json; point at a Qwen3-VL folder (config, weights, tokenizer)")
    tokenizer = AutoTokenizer.from_pretrained(token_dir, local_files_only=True)
    model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    return TextEncoder(model.to(device).eval(), tokenizer, layer)
