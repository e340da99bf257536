"""Prompt encoding with Qwen3-VL, as H3 was trained: the hidden states after decoder layer 50 (no final
norm), no chat template and no special tokens around the prompt, every prompt row tagged as text.

The encoder loads from a local Hugging Face folder holding the config and weights (``text_encoder/``) and
the tokenizer (``tokenizer/``, or the same folder). Only the first 50 layers run: a hook on layer 50 takes
its output and stops the forward, which is exactly ``hidden_states[50]`` of a full run without computing
the layers after it.

Keyframes (FL2VA) and references (Ref2VA) appear inside the text as labels and vision blocks
(``presentation``); their pixels go through Qwen3-VL's own image and video processors, read from the
``processor/`` folder (or the tokenizer's or model's folder) when such a request first comes, and the
model places them with its multimodal RoPE from the per-token modality ids.

Qwen3-VL-32B is 64 GB in bf16. When the device cannot hold it (``offload="auto"`` asks the device how much is
free), the weights stay in host memory and each decoder layer visits the device only for its own forward:
one layer's weights on the card at a time, the same numbers as the resident model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import H3InputError
from .media import quantize_pixels
from .presentation import PresentedReference, VisionIds, presentation_tokens, video_blocks
from .prompt import PromptEmbedding

__all__ = ["TextEncoder", "load_text_encoder", "CONDITIONING_LAYER", "OFFLOAD_MODES", "SETTINGS_FILE"]

CONDITIONING_LAYER = 50
OFFLOAD_MODES = ("auto", "none", "layers")
_HEADROOM = 1.15  # activations and the allocator's slack on top of the weights


class _Stop(Exception):
    def __init__(self, hidden):
        self.hidden = hidden


class TextEncoder:
    def __init__(self, model, tokenizer, layer: int = CONDITIONING_LAYER, device: torch.device | str | None = None,
                 stream: bool = False, processor_dirs: tuple[Path, ...] = ()):
        """``device``: where the forward runs; ``stream``: the decoder layers stay where they are (host memory)
        and each visits ``device`` for its own forward only; ``processor_dirs``: where to look for the image
        and video processor configs, in order."""
        self.model, self.tokenizer, self.layer = model, tokenizer, layer
        self.processor_dirs = tuple(Path(d) for d in processor_dirs)
        self._processors = None
        layers = self.language_model.layers
        if not 1 <= layer <= len(layers):
            raise H3InputError(f"conditioning layer {layer} is outside the text model's {len(layers)} layers")
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.streamed = stream
        self.layer_visits = 0
        if self.streamed:
            self._stream_layers()

    def to_device(self) -> "TextEncoder":
        """Put back on ``device`` what runs there (after the weights were moved to host memory to free the
        device): the whole model, or with streamed layers everything but the decoder layers."""
        if not self.streamed:
            self.model.to(self.device)
            return self
        for name, child in self.language_model.named_children():
            if name != "layers":
                child.to(self.device)  # embeddings, rotary tables, final norm: small, kept on the device
        self.model.model.visual.to(self.device)  # the vision tower: about 1 % of the weights
        return self

    def _stream_layers(self):
        lm, home = self.language_model, next(self.language_model.layers.parameters()).device
        self.to_device()

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
    def encode(self, prompt: str, *, keyframes=(), references: tuple[PresentedReference, ...] = ()) -> PromptEmbedding:
        """The prompt's presentation → its layer-50 states ``[L, hidden]`` (the model's dtype) and row tags.

        ``keyframes``: FL2VA keyframe images ``[H, W, 3]`` as put on the canvas, in packed order;
        ``references``: Ref2VA references in packed order. Pixels are floats in [0, 1] or uint8."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise H3InputError("the prompt is empty; describe the clip to generate")
        if len(keyframes) and len(references):
            raise H3InputError("a request has keyframes (FL2VA) or references (Ref2VA), not both")
        references = tuple(references) or tuple(PresentedReference("image", image) for image in keyframes)
        for index, reference in enumerate(references):
            reference.check(index)
        tokenize = lambda text: self.tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
        vision, image_tokens, video_tokens, video_times = self._vision_inputs(references)
        items = [(r.kind, r.has_audio) for r in references]
        ids, tags = presentation_tokens(tokenize, VisionIds.of(self.tokenizer) if vision else None, prompt, items,
                                        image_tokens, video_tokens, video_times)
        hidden = self._layer_states(torch.tensor([ids]), vision)
        return PromptEmbedding(hidden.cpu(), torch.tensor(tags, dtype=torch.long), prompt, features=hidden.shape[-1])

    def _layer_states(self, ids: torch.Tensor, vision: dict) -> torch.Tensor:
        config = self.model.config
        modality = torch.zeros_like(ids)  # Qwen's own ids for its RoPE layout: 1 image, 2 video
        modality[ids == config.image_token_id] = 1
        modality[ids == config.video_token_id] = 2
        device, dtype = self.device, self.model.dtype
        inputs = {k: v.to(device, dtype) if k.startswith("pixel_") else v.to(device) for k, v in vision.items()}

        def stop(module, args, output):
            raise _Stop(output[0] if isinstance(output, tuple) else output)

        handle = self.language_model.layers[self.layer - 1].register_forward_hook(stop)
        try:
            self.model.model(input_ids=ids.to(device), attention_mask=torch.ones_like(ids, device=device),
                             mm_token_type_ids=modality.to(device), use_cache=False, **inputs)
            raise RuntimeError("the text model returned before its conditioning layer ran")
        except _Stop as done:
            return done.hidden[0]
        finally:
            handle.remove()

    def _vision_inputs(self, references):
        """Pixels through Qwen's processors, batched per modality (Qwen fills the n-th vision block of a
        modality with the n-th item of its batch). Returns the model inputs, tokens per image, tokens per
        block of each video and block timestamps of each video."""
        images = [quantize_pixels(r.media, f"reference {i}").numpy() for i, r in enumerate(references)
                  if r.kind == "image"]
        videos = [(i, r) for i, r in enumerate(references) if r.kind == "video"]
        inputs, image_tokens, video_tokens, video_times = {}, [], [], []
        if not images and not videos:
            return inputs, image_tokens, video_tokens, video_times
        image_processor, video_processor = self._load_processors()
        merge = image_processor.merge_size**2
        if images:
            features = image_processor(images=images, return_tensors="pt")
            inputs.update(pixel_values=features["pixel_values"], image_grid_thw=features["image_grid_thw"])
            image_tokens = [int(grid.prod()) // merge for grid in features["image_grid_thw"]]
        if videos:
            clips = []
            for index, video in videos:
                frames, stamps = video_blocks(video.media.shape[0], video.fps, video_processor.temporal_patch_size)
                clips.append(quantize_pixels(video.media, f"reference {index}", frames=True,
                                             select=torch.tensor(frames)).numpy())
                video_times.append(stamps)
            features = video_processor(videos=clips, do_sample_frames=False, return_tensors="pt")
            inputs.update(pixel_values_videos=features["pixel_values_videos"], video_grid_thw=features["video_grid_thw"])
            video_tokens = [int(grid[1]) * int(grid[2]) // merge for grid in features["video_grid_thw"]]
            for stamps, grid in zip(video_times, features["video_grid_thw"]):
                if int(grid[0]) != len(stamps):
                    raise RuntimeError(f"Qwen's video processor made {int(grid[0])} blocks where {len(stamps)} "
                                       "were labelled; its temporal patch does not match the config read")
        return inputs, image_tokens, video_tokens, video_times

    def _load_processors(self):
        if self._processors is None:
            from transformers import AutoImageProcessor, AutoVideoProcessor

            found = next((d for d in self.processor_dirs if (d / "preprocessor_config.json").is_file()), None)
            if found is None:
                raise H3InputError("keyframes and references need Qwen3-VL's image/video processor, but no "
                                   f"preprocessor_config.json is in {[str(d) for d in self.processor_dirs]}")
            self._processors = (AutoImageProcessor.from_pretrained(found, local_files_only=True),
                                AutoVideoProcessor.from_pretrained(found, local_files_only=True))
        return self._processors


def fits_on(device: torch.device, nbytes: int) -> bool:
    """Whether ``nbytes`` of weights (plus headroom) fit in the device's free memory now."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes * _HEADROOM <= free


SETTINGS_FILE = "h3_hybrid.json"


def _folder_settings(folder: Path) -> dict:
    path = folder / SETTINGS_FILE
    if not path.is_file():
        return {}
    try:
        settings = json.loads(path.read_text())
    except ValueError as exc:
        raise H3InputError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(settings, dict):
        raise H3InputError(f"{path}: expected a JSON object, got {type(settings).__name__}")
    return settings


def load_text_encoder(folder: str | Path, *, device="cpu", dtype: torch.dtype = torch.bfloat16,
                      layer: int | None = None, offload: str = "auto",
                      fits=fits_on) -> TextEncoder:
    """Load Qwen3-VL from a local folder: ``folder`` itself or its ``text_encoder/`` and ``tokenizer/``.

    ``layer``: the hidden states handed to the DiT; default the folder's ``h3_hybrid.json``
    ``conditioning_layer`` (a checkpoint of another size names its own), else the released 50.
    ``offload``: "none" puts the whole model on ``device``; "layers" keeps it in host memory and streams one
    decoder layer at a time; "auto" streams only when ``fits(device, weight_bytes)`` says it does not fit."""
    if offload not in OFFLOAD_MODES:
        raise H3InputError(f"offload must be one of {list(OFFLOAD_MODES)}, got {offload!r}")
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    folder = Path(folder)
    if layer is None:
        layer = _folder_settings(folder).get("conditioning_layer", CONDITIONING_LAYER)
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
    processor_dirs = tuple(dict.fromkeys((folder / "processor", token_dir, model_dir, folder)))
    return TextEncoder(model, tokenizer, layer, device=device, stream=stream, processor_dirs=processor_dirs)
