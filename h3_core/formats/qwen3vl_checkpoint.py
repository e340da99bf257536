"""Qwen3-VL text-encoder checkpoints from their headers: which layout, which configuration, what H3 holds.

Two layouts of the same weights (transformers' ``Qwen3VLForConditionalGeneration`` names on the left):

    transformers (a Hugging Face folder)      ComfyUI (one file, ``models/text_encoders/``)
    model.language_model.embed_tokens.weight  model.embed_tokens.weight
    model.language_model.layers.{i}.<...>     model.layers.{i}.<...>        (self_attn.{q,k,v,o}_proj, q_norm,
                                                                             k_norm, mlp.{gate,up,down}_proj,
                                                                             input/post_attention_layernorm)
    model.language_model.norm.weight          model.norm.weight              (absent from H3's file)
    model.visual.<...>                        visual.<...>                   (patch_embed, pos_embed, blocks,
                                                                             merger, deepstack_merger_list)
    lm_head.weight                            (none)

ComfyUI's layout is its ``Qwen3VL`` module's own state dict: ``self.model = Llama2_(...)`` (``embed_tokens``,
``layers``, ``norm`` only when ``final_norm``) and ``self.visual = Qwen3VLVisionModel(...)`` whose tower names
(``qkv``, ``proj``, ``linear_fc1``...) are transformers'; ``Qwen3VL_32BConfig`` (the H3 encoder) has 50 layers,
``final_norm=False`` and no ``lm_head``, so ``qwen3vl_32b_minimax_h3_bf16.safetensors`` holds 902 tensors:
the embeddings, 50 layers of 11 and the tower's 351 (ComfyUI ``comfy/text_encoders/qwen3vl.py``, ``llama.py``
at 21f3a1cad132c07d79f5a7853bd606dd6fbd49fd, ``qwen35.py`` at 4328fa894d96811bde5bcdce56b6a4106f62feed,
``minimax.py`` at 0e74ae10c7fa683df0b28980e0b0f04f380b3dae).

A single file has no config.json: the sizes come from the tensor shapes (vocabulary and width from the
embeddings, the layers present, ``head_dim`` from ``q_norm``, heads and KV heads from ``q_proj`` / ``k_proj``,
the MLP width, the tower's width, depth, MLP width, patch, temporal patch, input channels, merge, position
grid and output width) and what no shape tells is Qwen3-VL-32B's published configuration (``PUBLISHED``).
Everything here reads headers only; a file that is not a Qwen3-VL text encoder of that family is refused
naming what it looks like, before any weight is read.

ComfyUI's quantised single files (``qwen3vl_32b_minimax_h3_int8_convrot`` / ``_nvfp4_awq``) store some 2-D weights
per layer in ComfyUI's ``comfy_quant`` form (``h3_core.formats.quantized_files``, which checks each layer's sidecars
against
its stored codes): ``int8_tensorwise`` (int8 codes ``[N, K]``, a scale per row or per tensor; ConvRot in the
int8_convrot file's linears, plain in an embedding table) and ``nvfp4`` (two e2m1 codes a byte ``[N, K/2]``, block
scales, a per-tensor scale and, for AWQ, the input scales ``pre_quant_scale [K]``). Reading a file's header also
reads those few-byte ``comfy_quant`` sidecars (never a weight); each quantised weight then stands for the ``[N,
K]`` tensor it holds, and the shapes are checked against the unquantised layout like a bf16 file's. Other formats
(fp8, or any a ``comfy_quant`` names that comfy-kitchen layers do not hold) are refused naming the format, the file
and the layer.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import H3InputError
from .files import TORCH_DTYPES, CheckpointFiles
from .keymap import QUANTIZED_DTYPES, KeyMap, Rule
from .quant_layers import LayerQuant, count_kinds, layer_quants
from .quantized_files import QuantizedView

__all__ = [
    "Layout",
    "LAYOUTS",
    "PUBLISHED",
    "TextEncoderCheckpoint",
    "HeldBytes",
    "describe_text_encoder_file",
    "describe_text_encoder_header",
    "held_bytes",
    "qwen3vl_header",
    "layout_keymap",
    "meta_shapes",
    "TEXT_ENCODER_FORMATS",
]

_SHOW = 5
_SIDECARS = (".comfy_quant", ".weight_scale", ".weight_scale_2", ".pre_quant_scale", ".input_scale", ".scale_weight")
# The comfy_quant formats ComfyUI's Qwen3-VL text encoders are stored in (int8_convrot: int8_tensorwise layers;
# nvfp4_awq: nvfp4 layers and an int8_tensorwise embedding table), the ones comfy-kitchen layers hold.
TEXT_ENCODER_FORMATS = ("int8_tensorwise", "nvfp4")
_DTYPE_BYTES = {name: dtype.itemsize for name, dtype in TORCH_DTYPES.items()}

# What no tensor shape shows, as Qwen3-VL-32B-Instruct's config.json (the H3 release's text_encoder/) gives
# it; ComfyUI builds the same model: llama.py Qwen3VL_8BConfig / Qwen3VL_32BConfig (rope_theta 5e6,
# rope_dims [24, 20, 20], interleaved_mrope, rms_norm_eps 1e-6, max_position_embeddings 262144) and
# qwen3vl.py QWEN3VL_VISION["qwen3vl_32b"] + QWEN3VL_VISION_COMMON (num_heads 16, deepstack [8, 16, 24]) at
# 21f3a1ca; the token ids are transformers' Qwen3VLConfig defaults and minimax.py's VISION_START/VISION_END.
# The RoPE settings are given as ``rope_theta`` + ``rope_scaling``, which transformers 4.57 reads and 5.x
# turns into its ``rope_parameters`` (the same inverse frequencies in both).
PUBLISHED = {
    "text": dict(
        rope_theta=5_000_000.0,
        rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        hidden_act="silu",
        attention_bias=False,
    ),
    "vision": dict(num_heads=16, deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh"),
    "ids": dict(
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        tie_word_embeddings=False,
    ),
}


@dataclass(frozen=True)
class Layout:
    """Where a layout keeps the language model (``text``), the vision tower (``vision``) and the output head."""

    name: str
    text: str
    vision: str
    head: str | None

    def file_key(self, model_key: str) -> str:
        """The file's name for a key of transformers' ``Qwen3VLForConditionalGeneration``."""
        for ours, theirs in (("model.language_model.", self.text), ("model.visual.", self.vision)):
            if model_key.startswith(ours):
                return theirs + model_key[len(ours) :]
        if model_key == "lm_head.weight" and self.head:
            return self.head
        raise KeyError(model_key)

    def model_key(self, file_key: str) -> str:
        """The key of transformers' ``Qwen3VLForConditionalGeneration`` for a file's name (``file_key``'s
        inverse for the language model and the vision tower)."""
        parts = sorted(((self.text, "model.language_model."), (self.vision, "model.visual.")), key=lambda p: -len(p[0]))
        for theirs, ours in parts:
            if file_key.startswith(theirs):
                return ours + file_key[len(theirs) :]
        raise KeyError(file_key)


LAYOUTS = (
    Layout("ComfyUI", "model.", "visual.", None),
    Layout("transformers", "model.language_model.", "model.visual.", "lm_head.weight"),
)
EXPECTED = (
    "ComfyUI's Qwen3-VL-32B text encoder (qwen3vl_32b_minimax_h3_bf16.safetensors: model.embed_tokens, "
    "model.layers.N.*, visual.*) or a transformers Qwen3-VL checkpoint (model.language_model.*, "
    "model.visual.*)"
)


@dataclass(frozen=True)
class HeldBytes:
    """What loading holds of a checkpoint for a conditioning layer: ``held`` bytes in ``held_tensors`` tensors,
    of the file's ``file`` bytes (header included) in ``tensors`` tensors."""

    held: int
    file: int
    held_tensors: int
    tensors: int

    @property
    def saved(self) -> int:
        return self.file - self.held


@dataclass(frozen=True)
class TextEncoderCheckpoint:
    """A Qwen3-VL text-encoder file as its header describes it. ``config``: transformers' ``Qwen3VLConfig`` of
    the layers the file holds (``layers``); ``dtypes``: the tensors' dtypes as stored; ``quantization``:
    ``(format, layers)`` for each format its quantised layers are in (``LayerQuant.kind``: "int8_convrot",
    "int8_tensorwise", "nvfp4", "nvfp4_awq"), () for a plain file; ``prescaled``: the file's names of the layers
    whose input an AWQ ``pre_quant_scale`` multiplies."""

    path: Path
    layout: Layout
    config: object
    layers: int
    dtypes: tuple[str, ...]
    file_bytes: int
    quantization: tuple[tuple[str, int], ...] = ()
    prescaled: tuple[str, ...] = ()

    def held(self, layer: int) -> HeldBytes:
        return held_bytes(_read_header(self.path), layer, file_bytes=self.file_bytes)


def _read_header(path: Path) -> dict:
    return _header_of(CheckpointFiles(path))  # refuses what is not a whole safetensors file


def _header_of(files) -> dict:
    """``{key: {"dtype", "shape"}}`` of a ``CheckpointFiles`` or a ``QuantizedView`` (quantised weights as the
    ``[N, K]`` tensors they stand for, sidecars hidden)."""
    return {k: {"dtype": files.dtypes[k], "shape": list(files.shape(k))} for k in sorted(files.keys)}


def _layer_index(layout: Layout, key: str) -> int | None:
    m = re.match(re.escape(layout.text) + r"layers\.(\d+)\.", key)
    return int(m.group(1)) if m else None


def _text_part(layout: Layout, key: str) -> str | None:
    return key[len(layout.text) :] if key.startswith(layout.text) else None


def _is_held(layout: Layout, key: str, layer: int) -> bool:
    """Whether loading for ``layer`` reads ``key``: the embeddings, layers below ``layer``, the vision tower;
    not the later layers, the final norm or the output head."""
    if key.startswith(layout.vision):
        return True
    index = _layer_index(layout, key)
    if index is not None:
        return index < layer
    return (_text_part(layout, key) or "").startswith("embed_tokens.")  # the table and a quantised one's scales


def held_bytes(header: dict, layer: int, *, file_bytes: int | None = None) -> HeldBytes:
    """The bytes loading for conditioning layer ``layer`` holds of a checkpoint, from its header (the parsed
    JSON dict of a safetensors header, or the merged headers of a folder's shards) alone.

    ``file_bytes``: the file's size; default the size safetensors writes for this header (8 bytes of length,
    the compact JSON padded to 8 bytes, the tensors). Held tensors are counted at their stored size."""
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    layout = _detect_layout(tensors)
    if layout is None:
        raise H3InputError(f"the header is not a Qwen3-VL text encoder's: it looks like {_looks_like(tensors)}")
    size = {k: math.prod(v["shape"]) * _DTYPE_BYTES[v["dtype"]] for k, v in tensors.items()}
    held = [k for k in tensors if _is_held(layout, k, layer)]
    if file_bytes is None:
        text = json.dumps(header, separators=(",", ":"))
        file_bytes = 8 + -(-len(text.encode()) // 8) * 8 + sum(size.values())
    return HeldBytes(sum(size[k] for k in held), file_bytes, len(held), len(tensors))


def _detect_layout(tensors: dict) -> Layout | None:
    for layout in LAYOUTS:
        if layout.text + "embed_tokens.weight" in tensors and any(k.startswith(layout.vision) for k in tensors):
            return layout
    return None


def _looks_like(tensors: dict) -> str:
    keys = sorted(tensors)
    sample = f" (keys such as {keys[:3]})" if keys else ""
    has = lambda *parts: any(all(p in k for p in parts) for k in keys)  # noqa: E731
    if not keys:
        return "an empty safetensors file"
    if has("lora_"):
        kind = "a LoRA"
    elif has("adaln") or has("diffusion_model.") or has("transformer_blocks.", "attn"):
        kind = "a diffusion model (DiT)"
    elif has("decoder.") and has("encoder."):
        kind = "a VAE"
    elif has("layers.", "self_attn") and not has("visual."):
        kind = "a language model without Qwen3-VL's vision tower (no visual.* keys)"
    elif has("visual."):
        kind = "a Qwen vision tower without its language model's embeddings"
    else:
        kind = "another kind of model"
    return f"{kind}: {len(keys)} tensors{sample}"


def _shape(tensors: dict, key: str, where: str, dims: int) -> list[int]:
    entry = tensors.get(key)
    if entry is None or len(entry["shape"]) != dims:
        got = "no such tensor" if entry is None else f"shape {entry['shape']}"
        raise H3InputError(f"{where}: not a Qwen3-VL text encoder ({key}: {got}); expected {EXPECTED}")
    return entry["shape"]


def describe_text_encoder_header(header: dict, where: str = "the checkpoint"):
    """``(layout, config, layers)`` of a Qwen3-VL text encoder from its header (module docstring); raises
    ``H3InputError`` naming ``where`` for anything that is not one, or not complete, or not of the family."""
    from transformers import Qwen3VLConfig

    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    layout = _detect_layout(tensors)
    if layout is None:
        raise H3InputError(
            f"{where}: not a Qwen3-VL text encoder: it looks like {_looks_like(tensors)}; expected {EXPECTED}"
        )
    quantized = sorted({v["dtype"] for v in tensors.values()} & QUANTIZED_DTYPES)
    stray = sorted(k for k, v in tensors.items() if v["dtype"] in QUANTIZED_DTYPES or k.endswith(_SIDECARS))
    if stray:
        how = (
            "whose layers' formats describe_text_encoder_file reads from their comfy_quant sidecars"
            if any(k.endswith(".comfy_quant") for k in stray)
            else f"whose quantized layers each carry a comfy_quant sidecar (none describes {stray[:_SHOW]})"
        )
        raise H3InputError(
            f"{where}: a quantized Qwen3-VL text encoder ({', '.join(quantized) or 'scaled'} "
            f"weights) is not supported; use the bf16 file or ComfyUI's int8_convrot or nvfp4_awq "
            f"file, {how}"
        )
    t, v = layout.text, layout.vision
    vocab, hidden = _shape(tensors, t + "embed_tokens.weight", where, 2)
    present = sorted({i for i in map(lambda k: _layer_index(layout, k), tensors) if i is not None})
    if not present:
        raise H3InputError(f"{where}: a Qwen3-VL checkpoint without decoder layers ({t}layers.N.*)")
    if present != list(range(len(present))):
        gaps = sorted(set(range(present[-1] + 1)) - set(present))
        raise H3InputError(
            f"{where}: decoder layers {gaps[:_SHOW]} are missing (it holds {len(present)} of "
            f"layers 0-{present[-1]}); the file is incomplete"
        )
    layer0 = f"{t}layers.0."
    (head_dim,) = _shape(tensors, layer0 + "self_attn.q_norm.weight", where, 1)
    q_rows = _shape(tensors, layer0 + "self_attn.q_proj.weight", where, 2)[0]
    kv_rows = _shape(tensors, layer0 + "self_attn.k_proj.weight", where, 2)[0]
    inner = _shape(tensors, layer0 + "mlp.gate_proj.weight", where, 2)[0]
    width, channels, temporal, patch, _ = _shape(tensors, v + "patch_embed.proj.weight", where, 5)
    depth = len({k.split(".")[len(v.split("."))] for k in tensors if k.startswith(v + "blocks.")})
    vision_inner = _shape(tensors, v + "blocks.0.mlp.linear_fc1.weight", where, 2)[0]
    positions = _shape(tensors, v + "pos_embed.weight", where, 2)[0]
    merged = _shape(tensors, v + "merger.linear_fc1.weight", where, 2)[1]
    out_width = _shape(tensors, v + "merger.linear_fc2.weight", where, 2)[0]
    stacks = len({k.split(".")[len(v.split("."))] for k in tensors if k.startswith(v + "deepstack_merger_list.")})
    merge = math.isqrt(merged // width) if merged % width == 0 else 0
    mrope = PUBLISHED["text"]["rope_scaling"]["mrope_section"]
    indexes = PUBLISHED["vision"]["deepstack_visual_indexes"]
    problems = []
    if q_rows % head_dim or kv_rows % head_dim:
        problems.append(f"q_proj/k_proj rows {q_rows}/{kv_rows} are not whole heads of q_norm's {head_dim}")
    if head_dim != 2 * sum(mrope):
        problems.append(f"head_dim {head_dim} (q_norm) is not the {2 * sum(mrope)} its mrope_section {mrope} needs")
    if merge * merge * width != merged:
        problems.append(f"the merger's input {merged} is not the tower width {width} times a square")
    if out_width != hidden:
        problems.append(f"the vision tower's output width {out_width} is not the language model's {hidden}")
    if width % PUBLISHED["vision"]["num_heads"]:
        problems.append(f"the tower width {width} does not split into {PUBLISHED['vision']['num_heads']} heads")
    if stacks != len(indexes) or depth <= indexes[-1]:
        problems.append(
            f"{stacks} deepstack mergers over {depth} vision blocks; Qwen3-VL-32B has {len(indexes)} "
            f"at blocks {indexes}"
        )
    if problems:
        raise H3InputError(f"{where}: a Qwen3-VL checkpoint, but not of Qwen3-VL-32B's family: " + "; ".join(problems))
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inner,
            num_hidden_layers=len(present),
            num_attention_heads=q_rows // head_dim,
            num_key_value_heads=kv_rows // head_dim,
            head_dim=head_dim,
            **PUBLISHED["text"],
        ),
        vision_config=dict(
            depth=depth,
            hidden_size=width,
            intermediate_size=vision_inner,
            in_channels=channels,
            patch_size=patch,
            temporal_patch_size=temporal,
            spatial_merge_size=merge,
            out_hidden_size=out_width,
            num_position_embeddings=positions,
            **PUBLISHED["vision"],
        ),
        **PUBLISHED["ids"],
    )
    _check_shapes(tensors, layout, config, where)
    return layout, config, len(present)


def meta_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor of transformers' ``Qwen3VLForConditionalGeneration`` for ``config``, with its shape, from
    the model built on the meta device (nothing allocated)."""
    from transformers import Qwen3VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    return {k: tuple(p.shape) for k, p in model.state_dict().items()}


def _check_shapes(tensors: dict, layout: Layout, config, where: str) -> None:
    optional = {layout.text + "norm.weight"} | ({layout.head} if layout.head else set())
    expected = {}
    for key, shape in meta_shapes(config).items():
        try:
            expected[layout.file_key(key)] = shape
        except KeyError:
            continue  # lm_head in ComfyUI's layout, which has none
    missing = sorted(k for k in expected if k not in tensors and k not in optional)
    wrong = sorted(
        f"{k} {tensors[k]['shape']} (expected {list(expected[k])})"
        for k in expected
        if k in tensors and tuple(tensors[k]["shape"]) != expected[k]
    )
    unexpected = sorted(k for k in tensors if k not in expected)
    parts = [
        f"missing {len(missing)} tensors, first {missing[:_SHOW]}" if missing else "",
        f"{len(wrong)} of the wrong shape, first {wrong[:_SHOW]}" if wrong else "",
        f"{len(unexpected)} unexpected, first {unexpected[:_SHOW]}" if unexpected else "",
    ]
    if any(parts):
        raise H3InputError(
            f"{where}: not a complete Qwen3-VL text encoder in {layout.name}'s layout: "
            + "; ".join(p for p in parts if p)
        )


def describe_text_encoder_file(path: str | Path) -> TextEncoderCheckpoint:
    """What the safetensors file at ``path`` is, from its header alone: a ``TextEncoderCheckpoint``, or an
    ``H3InputError`` naming the file, what it looks like and what is expected. Reads no weight (the node
    layer runs it when validating its inputs)."""
    path = Path(path)
    if path.is_dir():
        raise H3InputError(f"{path}: a folder; describe_text_encoder_file reads one .safetensors file")
    files = CheckpointFiles(path)
    header = _header_of(files)
    quants = _text_encoder_quants(files, header)
    view = QuantizedView(files, quants) if quants else files
    layout, config, layers = describe_text_encoder_header(_header_of(view), str(path))
    prescaled = _check_prescaled(files, view, layout, quants)
    return TextEncoderCheckpoint(
        path,
        layout,
        config,
        layers,
        tuple(sorted({v["dtype"] for v in header.values()})),
        path.stat().st_size,
        tuple(count_kinds(quants.values()).items()),
        prescaled,
    )


def _text_encoder_quants(files: CheckpointFiles, header: dict) -> dict[str, LayerQuant]:
    """The quantised layers of a file that looks like a Qwen3-VL text encoder (``layer_quants``: their formats
    from the ``comfy_quant`` sidecars, each checked against its stored codes), by weight key; {} for a plain
    file or one that is no text encoder (which ``describe_text_encoder_header`` then refuses)."""
    if _detect_layout(header) is None or not any(k.endswith(".comfy_quant") or k == "scaled_fp8" for k in header):
        return {}
    quants = layer_quants(files)  # refuses a format this pack does not read, naming it, the file and the layer
    for quant in quants.values():
        if quant.format not in TEXT_ENCODER_FORMATS:
            raise H3InputError(
                f"{files.path}: layer '{quant.layer}' is quantized as '{quant.kind}', which the text "
                f"encoder does not read; it reads ComfyUI's int8_convrot and nvfp4_awq text encoders "
                f"({', '.join(TEXT_ENCODER_FORMATS)} layers, through comfy-kitchen)"
            )
    return quants


def _check_prescaled(files: CheckpointFiles, view, layout: Layout, quants: dict[str, LayerQuant]) -> tuple[str, ...]:
    """The layers whose input an AWQ ``pre_quant_scale`` multiplies, each checked: one scale per input column
    of the weight it stands for, and a layer that has an input (a linear, not an embedding table)."""
    tables = {layout.text + "embed_tokens", layout.vision + "pos_embed"}
    prescaled = []
    for quant in quants.values():
        if quant.pre_quant_scale is None:
            continue
        columns = view.shape(quant.weight)[1]
        shape = list(files.shape(quant.pre_quant_scale))
        if quant.layer in tables:
            raise H3InputError(
                f"{files.path}: layer '{quant.layer}' is an embedding table, which has no input for its "
                f"'{quant.pre_quant_scale}' (AWQ input scales) to scale"
            )
        if shape != [columns]:
            raise H3InputError(
                f"{files.path}: layer '{quant.layer}' (nvfp4_awq): '{quant.pre_quant_scale}' is "
                f"{shape}, expected one AWQ input scale per input column, [{columns}]"
            )
        prescaled.append(quant.layer)
    return tuple(prescaled)


def layout_keymap(layout: Layout, present: int, layer: int) -> KeyMap:
    """The key map reading a truncated model (``layer`` decoder layers, no final norm, no output head) from a
    checkpoint in ``layout`` holding ``present`` layers: the later layers, the norm and the head are left
    unread."""
    rules = (
        Rule(r"model\.language_model\.(?P<rest>.+)", (layout.text + "{rest}",)),
        Rule(r"model\.visual\.(?P<rest>.+)", (layout.vision + "{rest}",)),
    )
    ignore = [re.escape(layout.text + "norm.weight")]
    if layout.head:
        ignore.append(re.escape(layout.head))
    if present > layer:
        ignore.append(re.escape(layout.text + "layers.") + "(?:" + "|".join(map(str, range(layer, present))) + r")\..+")
    return KeyMap(layout.name, rules, ignore=tuple(ignore))


def qwen3vl_header(
    config, layout: Layout, *, dtype: str = "BF16", final_norm: bool | None = None, head: bool | None = None
) -> dict:
    """A safetensors header (no ``data_offsets`` needed for sizes, but given, in key order) for a checkpoint of
    ``config`` in ``layout``; ``final_norm`` / ``head`` default to what the layout carries (ComfyUI's H3 file
    neither, a transformers folder both)."""
    final_norm = layout.head is not None if final_norm is None else final_norm
    head = layout.head is not None if head is None else head
    header, offset = {}, 0
    for key, shape in meta_shapes(config).items():
        if key == "lm_head.weight" and not head:
            continue
        if key == "model.language_model.norm.weight" and not final_norm:
            continue
        name = layout.file_key(key) if key != "lm_head.weight" else (layout.head or "lm_head.weight")
        end = offset + math.prod(shape) * _DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    return header
