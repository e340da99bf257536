"""Prompt encoding with Qwen3-VL, as H3 was trained: the hidden states after decoder layer 50 (no final
norm), no chat template and no special tokens around the prompt, every prompt row tagged as text.

The encoder loads from either source, and holds only what H3 reads: the embeddings, the decoder layers up to
the conditioning layer, the vision tower and the rotary tables; the later layers, the final norm and the
output head are never read (``h3_core.formats.qwen3vl_checkpoint``), and the forward stops after the
conditioning layer (a hook takes its output), which is exactly ``hidden_states[50]`` of the full model.

* a local Hugging Face folder: config.json and weights (``text_encoder/``), the tokenizer (``tokenizer/``, or
  the same folder), the image/video processor configs (``processor/``, or the tokenizer's or model's folder);
* ComfyUI's single file (``qwen3vl_32b_minimax_h3_bf16.safetensors``, or the quantised ``_int8_convrot`` and
  ``_nvfp4_awq`` ones), whose configuration comes from its header; it ships no tokenizer or processor files: the
  tokenizer is built from the Qwen BPE folder passed in (``h3_core.pipeline.qwen3vl_tokens``), the processors from
  a folder passed in or Qwen3-VL's published settings. A quantised file's layers are kept as comfy-kitchen layers
  where it has kernels for the run device, else dequantised on load (``h3_core.formats.qwen3vl_weights``); the
  model then runs as the bf16 file's does.

Keyframes (FL2VA) and references (Ref2VA) appear inside the text as labels and vision blocks
(``presentation``); their pixels go through Qwen3-VL's own image and video processors, and the model places
them with its multimodal RoPE from the per-token modality ids.

Placement: loading puts the weights in host memory (memory-mapped where the file's dtype is the one asked
for). Each encode runs on ``device`` with the model either resident there or with its decoder layers
streamed: they stay in host memory (page-locked on a GPU) and each visits the device for its own forward
only, as copies its tensors point to until it leaves (nothing is copied back), the same numbers as the
resident model. ``resident_bytes`` and ``streamed_bytes`` say what either needs on the device;
``place`` and ``to_host`` let a caller decide per run; otherwise the first encode decides by ``offload``. A kept
comfy-kitchen layer counts at its stored size (codes and scales).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..errors import H3InputError
from ..formats.files import CheckpointFiles
from ..formats.keymap import load_into
from ..formats.kitchen import stored_bytes
from ..formats.quant_layers import HELD
from ..formats.qwen3vl_checkpoint import LAYOUTS, describe_text_encoder_file, layout_keymap
from ..formats.qwen3vl_weights import read_text_encoder_file
from .conditioning import quantize_pixels
from .presentation import PresentedReference, VisionIds, presentation_tokens, video_blocks
from .prompt import PromptEmbedding
from .qwen3vl_tokens import folder_processors, published_processors, qwen3vl_tokenizer

__all__ = ["TextEncoder", "load_text_encoder", "CONDITIONING_LAYER", "OFFLOAD_MODES", "SETTINGS_FILE", "fits_on"]

CONDITIONING_LAYER = 50
OFFLOAD_MODES = ("auto", "none", "layers")
_HEADROOM = 1.15  # activations and the allocator's slack on top of the weights
_HOST = torch.device("cpu")


class _Stop(Exception):
    def __init__(self, hidden):
        self.hidden = hidden


class _NotHeld(nn.Module):
    """Stands where the full model has a part H3 never runs (the final norm, the output head)."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            f"the text encoder does not hold {self.what}: it keeps only what H3 reads, the layers "
            "up to the conditioning layer"
        )


def move_module(module: nn.Module, device) -> nn.Module:
    """``module.to(device)`` outside inference mode, so its weights stay ordinary tensors (comfy-kitchen's
    weights, tensor subclasses, cannot be swapped into a module as inference tensors); the forward between moves
    runs in it. A parameter already an inference tensor (moved by the host while it ran a node, which it does in
    inference mode) is replaced by an ordinary one: setting ``.data`` across the two kinds, as ``Module.to``
    does, leaves a tensor without a version counter that the next forward fails on."""
    with torch.inference_mode(False):
        for sub in module.modules():
            for name, param in sub._parameters.items():
                if param is not None and param.is_inference():
                    value = param.to(device)
                    value = value.clone() if value.is_inference() else value
                    sub._parameters[name] = nn.Parameter(value, requires_grad=param.requires_grad)
        return module.to(device)


def _own_tensors(module: nn.Module):
    """(owner, store, name) of every parameter and buffer of ``module`` and its children."""
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for name, tensor in store.items():
                if tensor is not None:
                    yield sub, store, name


def _plain(module: nn.Module) -> bool:
    return all(type(store[name].data) is torch.Tensor for _, store, name in _own_tensors(module))


def pin_module(module: nn.Module) -> bool:
    """Put ``module``'s host tensors in page-locked memory, so a layer's visit to the GPU copies without the
    driver's bounce buffers; a module holding tensor subclasses (comfy-kitchen weights) is left as it is, and so
    is one the host cannot pin (too little memory to lock). Returns whether it was pinned."""
    if not _plain(module):
        return False
    try:
        with torch.inference_mode(False), torch.no_grad():
            for _, store, name in _own_tensors(module):
                tensor = store[name]
                if tensor.device.type == "cpu" and not tensor.is_pinned():
                    tensor.data = tensor.data.pin_memory()
    except RuntimeError:  # cudaHostAlloc refused: the copies stay pageable
        return False
    return True


def visit(module: nn.Module, device) -> list | None:
    """Point ``module``'s tensors at copies on ``device`` for one forward, keeping their host tensors: the list
    ``go_home`` points them back with (no copy back: the forward does not change them). A module holding tensor
    subclasses is moved whole instead (``move_module``) and None returned."""
    if not _plain(module):
        move_module(module, device)
        return None
    home = []
    with torch.inference_mode(False), torch.no_grad():
        for _, store, name in _own_tensors(module):
            tensor = store[name]
            home.append((store, name, tensor.data))
            tensor.data = tensor.data.to(device, non_blocking=tensor.data.is_pinned())
    return home


def go_home(home: list) -> None:
    """Point a visiting module's tensors back at their host tensors (``visit``'s list)."""
    with torch.inference_mode(False), torch.no_grad():
        for store, name, data in home:
            store[name].data = data


def _nbytes(tensors) -> int:
    return sum(stored_bytes(t) for t in tensors)


def _module_bytes(module: nn.Module) -> int:
    return _nbytes([*module.parameters(), *module.buffers()])


class TextEncoder:
    def __init__(
        self,
        model,
        tokenizer,
        layer: int = CONDITIONING_LAYER,
        device: torch.device | str = "cpu",
        offload: str = "auto",
        fits=None,
        processors=None,
    ):
        """``model``: a (truncated) ``Qwen3VLForConditionalGeneration`` in host memory; ``device``: where each
        encode runs; ``offload``: how the first encode places the model when nobody placed it ("none"
        resident, "layers" streamed, "auto" streamed only when ``fits(device, resident_bytes)`` says no);
        ``processors``: a function returning the image and video processors, called when a request first
        needs them."""
        if offload not in OFFLOAD_MODES:
            raise H3InputError(f"offload must be one of {list(OFFLOAD_MODES)}, got {offload!r}")
        self.model, self.tokenizer, self.layer = model, tokenizer, layer
        layers = self.language_model.layers
        if not 1 <= layer <= len(layers):
            raise H3InputError(f"conditioning layer {layer} is outside the text model's {len(layers)} layers")
        self.device, self.offload, self.fits = torch.device(device), offload, fits or fits_on
        self._processor_source, self._processors = processors, None
        self.streamed: bool | None = None  # how the model was last placed; None until then
        self.layer_visits = 0
        self._homes: dict = {}  # a visiting layer's host tensors (``visit``), until it leaves
        # a quantised file's weights (file keys) kept as comfy-kitchen layers or dequantised, and the line logged
        self.kept_layers: tuple[str, ...] = ()
        self.dequantised_layers: tuple[str, ...] = ()
        self.load_report = ""
        for block in layers[:layer]:
            block.register_forward_pre_hook(self._arrive, with_kwargs=True)
            block.register_forward_hook(self._leave, with_kwargs=True, always_call=True)

    @property
    def language_model(self):
        return self.model.model.language_model

    def _layer_modules(self):
        return list(self.language_model.layers)

    @property
    def layer_bytes(self) -> int:
        """The largest decoder layer's weights (and AWQ scales): what one streamed layer brings to the device."""
        return max(_module_bytes(block) for block in self._layer_modules())

    @property
    def resident_bytes(self) -> int:
        """Every weight and table held: what must be on the device to run resident."""
        return _nbytes(self.model.parameters()) + _nbytes(self.model.buffers())

    @property
    def kept_bytes(self) -> int:
        """What stays on the device while the decoder layers stream (embeddings, vision tower, rotary tables)."""
        return self.resident_bytes - sum(_module_bytes(block) for block in self._layer_modules())

    @property
    def streamed_bytes(self) -> int:
        """What must be on the device to run with streamed layers: what stays plus one layer."""
        return self.kept_bytes + self.layer_bytes

    def place(self, device: torch.device | str | None = None, *, stream: bool = False) -> "TextEncoder":
        """Put the model on ``device`` (default: the encoder's) for the next encodes: whole, or with the decoder
        layers left in host memory to visit the device one at a time (``stream``)."""
        if device is not None:
            self.device = torch.device(device)
        if stream:
            move_module(self.language_model.layers, _HOST)
            if self.device.type == "cuda":
                pin_module(self.language_model.layers)
            for name, child in self.language_model.named_children():
                if name != "layers":
                    move_module(child, self.device)
            move_module(self.model.model.visual, self.device)
        else:
            move_module(self.model, self.device)
        self.streamed = stream
        return self

    def to_host(self) -> "TextEncoder":
        """Move every weight back to host memory (the next encode, or ``place``, puts it on the device again)."""
        move_module(self.model, _HOST)
        return self

    def to_device(self) -> "TextEncoder":
        """Put the model back on its device the way it was last placed (deciding by ``offload`` if it never
        was), e.g. after the host moved its weights to host memory to free the device."""
        return self.place(stream=self._decide() if self.streamed is None else self.streamed)

    def _decide(self) -> bool:
        if self.offload == "auto":
            return not self.fits(self.device, self.resident_bytes)
        return self.offload == "layers"

    def _placed(self) -> bool:
        return self.streamed is not None and self.language_model.embed_tokens.weight.device == self.device

    def _arrive(self, module, args, kwargs):
        if self.streamed:
            self.layer_visits += 1
            self._homes[module] = visit(module, self.device)

    def _leave(self, module, args, kwargs, output):
        if self.streamed:
            home = self._homes.pop(module, None)
            if home is None:
                move_module(module, _HOST)
            else:
                go_home(home)

    @torch.inference_mode()
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
        ids, tags = presentation_tokens(
            tokenize,
            VisionIds.of(self.tokenizer) if vision else None,
            prompt,
            items,
            image_tokens,
            video_tokens,
            video_times,
        )
        if not self._placed():
            self.to_device()
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
            self.model.model(
                input_ids=ids.to(device),
                attention_mask=torch.ones_like(ids, device=device),
                mm_token_type_ids=modality.to(device),
                use_cache=False,
                **inputs,
            )
            raise RuntimeError("the text model returned before its conditioning layer ran")
        except _Stop as done:
            return done.hidden[0]
        finally:
            handle.remove()

    def _vision_inputs(self, references):
        """Pixels through Qwen's processors, batched per modality (Qwen fills the n-th vision block of a
        modality with the n-th item of its batch). Returns the model inputs, tokens per image, tokens per
        block of each video and block timestamps of each video."""
        images = [
            quantize_pixels(r.media, f"reference {i}").numpy() for i, r in enumerate(references) if r.kind == "image"
        ]
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
                clips.append(
                    quantize_pixels(video.media, f"reference {index}", frames=True, select=torch.tensor(frames)).numpy()
                )
                video_times.append(stamps)
            features = video_processor(videos=clips, do_sample_frames=False, return_tensors="pt")
            inputs.update(
                pixel_values_videos=features["pixel_values_videos"], video_grid_thw=features["video_grid_thw"]
            )
            video_tokens = [int(grid[1]) * int(grid[2]) // merge for grid in features["video_grid_thw"]]
            for stamps, grid in zip(video_times, features["video_grid_thw"]):
                if int(grid[0]) != len(stamps):
                    raise RuntimeError(
                        f"Qwen's video processor made {int(grid[0])} blocks where {len(stamps)} "
                        "were labelled; its temporal patch does not match the config read"
                    )
        return inputs, image_tokens, video_tokens, video_times

    def _load_processors(self):
        if self._processors is None:
            found = self._processor_source() if self._processor_source is not None else None
            if found is None:
                raise H3InputError(
                    "keyframes and references need Qwen3-VL's image/video processor, but no "
                    "preprocessor_config.json was found beside the text encoder"
                )
            self._processors = found
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
        settings = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise H3InputError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(settings, dict):
        raise H3InputError(f"{path}: expected a JSON object, got {type(settings).__name__}")
    return settings


def _truncated_model(config, layer: int, present: int, where):
    """``Qwen3VLForConditionalGeneration`` of ``config`` cut to ``layer`` decoder layers, built on the meta
    device, with its rotary tables computed in host memory and no final norm or output head."""
    import copy

    from transformers import Qwen3VLForConditionalGeneration
    from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3_vl

    if not 1 <= layer <= present:
        raise H3InputError(f"conditioning layer {layer} is outside the text model's {present} layers ({where})")
    config = copy.deepcopy(config)
    config.text_config.num_hidden_layers = layer
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    model.lm_head = _NotHeld("the output head")
    model.model.language_model.norm = _NotHeld("the final norm")
    model.model.language_model.rotary_emb = qwen3_vl.Qwen3VLTextRotaryEmbedding(config.text_config)
    model.model.visual.rotary_pos_emb = _vision_rotary(qwen3_vl.Qwen3VLVisionRotaryEmbedding, config.vision_config)
    return model


def _vision_rotary(rotary_cls, vision):
    """The vision tower's rotary table as the installed transformers builds it: from the config (5.x), or from
    half a head's width (4.57: ``Qwen3VLVisionModel`` passes ``hidden_size // num_heads // 2``)."""
    import inspect

    if "config" in inspect.signature(rotary_cls).parameters:
        return rotary_cls(vision)
    return rotary_cls(vision.hidden_size // vision.num_heads // 2)


def _read_weights(model, files: CheckpointFiles, keymap, dtype: torch.dtype):
    load_into(model, files, [keymap], what="Qwen3-VL text encoder", dtype=dtype)
    return _checked_filled(model)


def _checked_filled(model):
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"the text model has tensors nothing filled: {left[:5]}")
    return model.eval()


def _check_vision_ids(tokenizer, config, where) -> None:
    try:
        ids = VisionIds.of(tokenizer)
    except H3InputError:
        return  # a text-only tokenizer: a request with pixels is refused when it comes
    want = (config.vision_start_token_id, config.vision_end_token_id, config.image_token_id, config.video_token_id)
    if (ids.start, ids.end, ids.image_pad, ids.video_pad) != want:
        raise H3InputError(
            f"{where}: the tokenizer's vision tokens have ids {ids} but the model's config says "
            f"{want}; the tokenizer is not this model's"
        )


def load_text_encoder(
    path: str | Path,
    *,
    tokenizer: str | Path | None = None,
    processor: str | Path | None = None,
    device="cpu",
    dtype: torch.dtype = torch.bfloat16,
    layer: int | None = None,
    offload: str = "auto",
    fits=fits_on,
    held: str = "auto",
    run_device=None,
) -> TextEncoder:
    """Load Qwen3-VL for H3 into host memory, from a folder or ComfyUI's single ``.safetensors`` file.

    Args:
        path: a folder (``path`` itself or its ``text_encoder/``, ``tokenizer/``, ``processor/``), or a file
            in ComfyUI's layout (or transformers' names in one file).
        tokenizer: a folder holding Qwen's ``vocab.json`` and ``merges.txt`` (ComfyUI's
            ``comfy/text_encoders/qwen25_tokenizer``), read as H3's tokenizer; required for a single file,
            and used instead of a folder's own tokenizer when given.
        processor: a folder with Qwen3-VL's preprocessor_config.json; default the folder's own (a single
            file: Qwen3-VL's published settings).
        device: where each encode runs; nothing goes there at load.
        dtype: the weights' dtype.
        layer: the hidden states handed to the DiT; default a folder's ``h3_hybrid.json``
            ``conditioning_layer`` (a checkpoint of another size names its own), else the released 50.
        offload: "none" runs the whole model on ``device``; "layers" keeps it in host memory and streams one
            decoder layer at a time; "auto" decides at the first encode: streams only when
            ``fits(device, resident_bytes)`` says it does not fit.
        held: how a quantised file's linear layers are held (``quantized_files.HELD``): "auto" keeps them as
            comfy-kitchen layers where it has kernels for ``run_device``, else dequantises them into ``dtype``;
            "dequantize" always dequantises; "kitchen" keeps them or raises ``H3BackendUnavailable`` naming why.
        run_device: the device the encodes will run on, which decides ``held="auto"`` (default ``device``).
    """
    if offload not in OFFLOAD_MODES:
        raise H3InputError(f"offload must be one of {list(OFFLOAD_MODES)}, got {offload!r}")
    if held not in HELD:
        raise H3InputError(f"held: got {held!r}; allowed: {', '.join(map(repr, HELD))}")
    path = Path(path)
    loaded = None
    if path.is_file():
        run_device = device if run_device is None else run_device
        model, token_source, processor_dirs, layer, where, loaded = _single_file(
            path, tokenizer, processor, layer, dtype, held, run_device
        )
    elif path.is_dir():
        model, token_source, processor_dirs, layer, where = _folder(path, tokenizer, processor, layer, dtype)
    else:
        raise H3InputError(
            f"{path}: no such file or folder; point at a Qwen3-VL folder or ComfyUI's "
            "qwen3vl_32b_minimax_h3_bf16.safetensors"
        )
    _check_vision_ids(token_source, model.config, where)
    fallback = published_processors if path.is_file() and processor is None else (lambda: None)
    encoder = TextEncoder(
        model,
        token_source,
        layer,
        device=device,
        offload=offload,
        fits=fits,
        processors=lambda: folder_processors(processor_dirs) or fallback(),
    )
    if loaded is not None:
        encoder.kept_layers, encoder.dequantised_layers, encoder.load_report = (
            loaded.kept,
            loaded.dequantised,
            loaded.report,
        )
    return encoder


def _single_file(path: Path, tokenizer, processor, layer, dtype, held, run_device):
    if tokenizer is None:
        raise H3InputError(
            f"{path}: a single-file text encoder holds no tokenizer; pass tokenizer= a folder with "
            "Qwen's vocab.json and merges.txt (ComfyUI's comfy/text_encoders/qwen25_tokenizer)"
        )
    described = describe_text_encoder_file(path)
    layer = CONDITIONING_LAYER if layer is None else layer
    model = _truncated_model(described.config, layer, described.layers, path)
    tokens = qwen3vl_tokenizer(tokenizer)
    loaded = read_text_encoder_file(model, described, dtype=dtype, held=held, run_device=run_device)
    processor_dirs = (Path(processor),) if processor is not None else ()
    return _checked_filled(model), tokens, processor_dirs, layer, path, loaded


def _folder(folder: Path, tokenizer, processor, layer, dtype):
    from transformers import AutoTokenizer, Qwen3VLConfig

    if layer is None:
        layer = _folder_settings(folder).get("conditioning_layer", CONDITIONING_LAYER)
    model_dir = folder / "text_encoder" if (folder / "text_encoder").is_dir() else folder
    token_dir = folder / "tokenizer" if (folder / "tokenizer").is_dir() else model_dir
    if not (model_dir / "config.json").is_file():
        raise H3InputError(f"{model_dir}: no config.json; point at a Qwen3-VL folder (config, weights, tokenizer)")
    config = Qwen3VLConfig.from_pretrained(model_dir, local_files_only=True)
    present = config.text_config.num_hidden_layers
    model = _truncated_model(config, layer, present, model_dir)
    model = _read_weights(model, CheckpointFiles(model_dir), layout_keymap(LAYOUTS[1], present, layer), dtype)
    tokens = (
        qwen3vl_tokenizer(tokenizer)
        if tokenizer is not None
        else AutoTokenizer.from_pretrained(token_dir, local_files_only=True)
    )
    found = (Path(processor),) if processor is not None else (folder / "processor", token_dir, model_dir, folder)
    return model, tokens, tuple(dict.fromkeys(found)), layer, folder
