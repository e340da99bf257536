"""Prompt encoding with Qwen3-VL, as H3 was trained: the hidden states after decoder layer 50 (no final
norm), no chat template and no special tokens around the prompt, every prompt row tagged as text.

The encoder loads from a local Hugging Face folder holding the config and weights (``text_encoder/``) and
the tokenizer (``tokenizer/``, or the same folder). Only the first 50 layers run: a hook on layer 50 takes
its output and stops the forward, which is exactly ``hidden_states[50]`` of a full run without computing
the layers after it. Keyframe and reference images (vision blocks inside the text) are not handled here.

Qwen3-VL-32B is 64 GB in bf16. When the device cannot hold it (``offload="auto"`` asks the device how much is
free), the weights stay in host memory and each decoder layer visits the device only for its own forward:
one layer's weights on the card at a time, the same numbers as the resident model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import H3InputError
from .prompt import PromptEmbedding

__all__ = ["TextEncoder", "load_text_encoder", "CONDITIONING_LAYER", "OFFLOAD_MODES"]

CONDITIONING_LAYER = 50
OFFLOAD_MODES = ("auto", "none", "layers")
_HEADROOM = 1.15  # activations and the allocator's slack on top of the weights


class _Stop(Exception):
    def __init__(self, hidden):
        self.hidden = hidden


class TextEncoder:
    def __init__(self, model, tokenizer, layer: int = CONDITIONING_LAYER, device: torch.device | str | None = None,
                 stream: bool = False):
        """``device``: where the forward runs; ``stream``: the decoder layers stay where they are (host memory)
        and each visits ``device`` for its own forward only."""
        self.model, self.tokenizer, self.layer = model, tokenizer, layer
        layers = self.language_model.layers
        if not 1 <= layer <= len(layers):
            raise H3InputError(f"conditioning layer {layer} is outside the text model's {len(layers)} layers")
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.streamed = stream
        self.layer_visits = 0
        if self.streamed:
            self._stream_layers()

    def _stream_layers(self):
        lm, home = self.language_model, next(self.language_model.layers.parameters()).device
        for name, child in lm.named_children():
            if name != "layers":
                child.to(self.device)  # embeddings, rotary tables, final norm: small, kept on the device

        def arrive(module, args, kwargs):
            self.layer_visits += 1
            module.to(self.device)

        def leave(module, args, kwargs, output):
            module.to(home)

        for block in lm.layers[: self.layer]:
            block.register_forward_pre_hook(arrive, with_kwargs=True)
            block.register_forward_hook(leave, with_kwargs=True, always_call=True)

    @property
    def language_model(self):
        return self.model.model.language_model

    @torch.no_grad()
    def encode(self, prompt: str) -> PromptEmbedding:
        """``prompt`` → its layer-50 states ``[L, hidden]`` (the model's dtype) with all rows tagged text."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise H3InputError("the prompt is empty; describe the clip to generate")
        ids = self.tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        device = self.device

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


def fits_on(device: torch.device, nbytes: int) -> bool:
    """Whether ``nbytes`` of weights (plus headroom) fit in the device's free memory now."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes * _HEADROOM <= free


def load_text_encoder(folder: str | Path, *, device="cpu", dtype: torch.dtype = torch.bfloat16,
                      layer: int = CONDITIONING_LAYER, offload: str = "auto",
                      fits=fits_on) -> TextEncoder:
    """Load Qwen3-VL from a local folder: ``folder`` itself or its ``text_encoder/`` and ``tokenizer/``.

    ``offload``: "none" puts the whole model on ``device``; "layers" keeps it in host memory and streams one
    decoder layer at a time; "auto" streams only when ``fits(device, weight_bytes)`` says it does not fit."""
    if offload not in OFFLOAD_MODES:
        raise H3InputError(f"offload must be one of {list(OFFLOAD_MODES)}, got {offload!r}")
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    folder = Path(folder)
    model_dir = folder / "text_encoder" if (folder / "text_encoder").is_dir() else folder
    token_dir = folder / "tokenizer" if (folder / "tokenizer").is_dir() else model_dir
    if not (model_dir / "config.json").is_file():
        raise H3InputError(f"{model_dir}: no config.json; point at a Qwen3-VL folder (config, weights, tokenizer)")
    tokenizer = AutoTokenizer.from_pretrained(token_dir, local_files_only=True)
    model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype, local_files_only=True).eval()
    device = torch.device(device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.model.language_model.parameters())
    stream = offload == "layers" or (offload == "auto" and not fits(device, weight_bytes))
    if not stream:
        model.to(device)
    return TextEncoder(model, tokenizer, layer, device=device, stream=stream)
