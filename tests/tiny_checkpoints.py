"""Tiny random checkpoints of every model the pack loads, in the layouts users have, for trying the pack
without the real files (tests, the quick start).

They are NOT trained models: the weights are seeded random numbers, so what they generate is noise with the
right shapes, frame counts, rates and channels. Every file says so in its metadata (``h3_core.formats.sizes``
``NOTE_KEY``) and its name begins with ``TINY_PREFIX``. The files go where ComfyUI looks for each kind:

    diffusion_models/h3_tiny_random_dit.safetensors            the DiT, ComfyUI layout (also the T2VA/FL2VA base)
    diffusion_models/h3_tiny_random_linear_branch.safetensors  VDN-H3's linear branch for that DiT
    vae/h3_tiny_random_video_vae.safetensors                    ComfyUI layout, with its latent statistics
    vae/h3_tiny_random_audio_vae.safetensors
    text_encoders/h3_tiny_random_qwen3vl/                       tokenizer/, processor/, text_encoder/ folders

``write_tiny_text_encoder_file`` also writes the text encoder as ComfyUI ships it, one file in its key layout
(``text_encoders/h3_tiny_random_qwen3vl.safetensors``): a Qwen3-VL of Qwen3-VL-32B's family (its head size,
RoPE sections, vision heads and deepstack blocks, Qwen's vocabulary and token ids) at a tiny width, read with
Qwen's tokenizer (the host's ``qwen25_tokenizer``) and Qwen3-VL's published processors.
``write_tiny_quantized_text_encoder_file`` writes it as ComfyUI's quantised files store theirs
(``h3_tiny_random_qwen3vl_int8_convrot.safetensors``, ``..._nvfp4_awq.safetensors``), each layer quantised by
comfy-kitchen's own quantiser (``quantize_text_encoder_state``). ``write_tiny_quantized_checkpoints`` writes the
tiny DiT and video VAE as ComfyUI's ``int8_convrot`` files store theirs (``..._dit_int8_convrot.safetensors``,
``..._video_vae_int8_convrot.safetensors``: the DiT blocks' four linears and the VAE decoder blocks' linears in
int8 ConvRot, the rest in bf16 / fp16).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from h3_core.formats.sizes import NOTE_KEY, sizes_metadata
from h3_core.models.audio_vae import AudioVAE, AudioVAEConfig
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.models.video_vae import VideoVAE, VideoVAEConfig
from h3_core.pipeline.text_encoder import CONDITIONING_LAYER, SETTINGS_FILE

__all__ = [
    "TinyCheckpoints",
    "write_tiny_checkpoints",
    "TINY_PREFIX",
    "TINY_FILES",
    "TINY_DIT",
    "TINY_VIDEO_VAE",
    "TINY_AUDIO_VAE",
    "TINY_TEXT_WIDTH",
    "TINY_TEXT_ENCODER_FILE",
    "tiny_qwen3vl",
    "write_tiny_text_encoder_file",
    "TEXT_ENCODER_QUANTIZATIONS",
    "quantize_text_encoder_state",
    "write_tiny_quantized_text_encoder_file",
    "write_tiny_quantized_checkpoints",
    "INT8_CONVROT_FILES",
    "quantize_int8_convrot",
]

TINY_PREFIX = "h3_tiny_random_"
# Each file's (or folder's) name in its ComfyUI model folder, by ``TinyCheckpoints`` field.
TINY_FILES = {
    "dit": f"{TINY_PREFIX}dit.safetensors",
    "linear_branch": f"{TINY_PREFIX}linear_branch.safetensors",
    "video_vae": f"{TINY_PREFIX}video_vae.safetensors",
    "audio_vae": f"{TINY_PREFIX}audio_vae.safetensors",
    "text_encoder": f"{TINY_PREFIX}qwen3vl",
}
NOTE = "H3 Hybrid tiny RANDOM weights for tests and the quick start: not a trained model, it generates noise"
TINY_TEXT_WIDTH = 32
TINY_TEXT_ENCODER_FILE = f"{TINY_PREFIX}qwen3vl.safetensors"
TINY_DIT = DiTConfig(
    hidden=48,
    layers=2,
    heads=2,
    head_dim=32,
    ffn=64,
    text_dim=TINY_TEXT_WIDTH,
    freq_dim=16,
    time_hidden=24,
    time_embed=20,
    rope_freqs=4,
)
TINY_VIDEO_VAE = VideoVAEConfig(
    decoder_layers=1,
    decoder_heads=2,
    decoder_head_dim=16,
    block_out_channels=(4,) * 6,
    norm_groups=4,
    layers_per_block=1,  # the encoder's full-size levels dominate a reference's encode on the CPU
)
TINY_AUDIO_VAE = AudioVAEConfig(encoder_dim=4, latent_dim=64, latent_channels=32, decoder_dim=256, attention_heads=2)
_BRANCH_PARTS = (".attn.softmax_gate.", ".attn.to_out_linear.", ".attn.linear_attention.")
_TEXT_LAYERS = 3
_WORDS = (
    "a",
    "the",
    "fox",
    "runs",
    "through",
    "snow",
    "and",
    "sea",
    "waves",
    "music",
    "plays",
    "<d>",
    "</d>",
    "[English]",
    "<Picture",
    "<Audio",
    "<Video",
    "1>:",
    "2>:",
    "3>:",
    "seconds>",
)
_VISION = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


@dataclass(frozen=True)
class TinyCheckpoints:
    dit: Path
    linear_branch: Path
    video_vae: Path
    audio_vae: Path
    text_encoder: Path


def _save(state: dict, path: Path, cfg) -> Path:
    """``state`` written to ``path`` with the note and, for a config dataclass ``cfg``, its sizes."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    metadata = sizes_metadata(cfg, NOTE) if cfg is not None else {NOTE_KEY: NOTE}
    save_file({k: v.contiguous() for k, v in state.items()}, str(partial), metadata=metadata)
    partial.replace(path)
    return path


def _randomised(module: torch.nn.Module, std: float | None) -> torch.nn.Module:
    """``module`` with its own initialisation, or N(0, std²) everywhere when ``std`` is given."""
    if std is not None:
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0, std)
    return module.eval()


def _dit_files(models: Path) -> tuple[Path, Path]:
    torch.manual_seed(0)
    hybrid = _randomised(H3DiT(replace(TINY_DIT, hybrid=True)), 0.05)
    state = hybrid.state_dict()
    base = {k: v for k, v in state.items() if not any(part in k for part in _BRANCH_PARTS)}
    branch = {
        "transformer_blocks." + k.removeprefix("blocks."): v
        for k, v in state.items()
        if any(part in k for part in _BRANCH_PARTS)
    }
    folder = models / "diffusion_models"
    return (
        _save(base, folder / TINY_FILES["dit"], TINY_DIT),
        _save(branch, folder / TINY_FILES["linear_branch"], TINY_DIT),
    )


def _vae_files(models: Path) -> tuple[Path, Path]:
    torch.manual_seed(1)
    video = _randomised(VideoVAE(TINY_VIDEO_VAE), None)
    state = dict(video.state_dict())
    state["latents_mean"] = torch.tensor(TINY_VIDEO_VAE.latents_mean)
    state["latents_std"] = torch.tensor(TINY_VIDEO_VAE.latents_std)
    torch.manual_seed(2)
    audio = _randomised(AudioVAE(TINY_AUDIO_VAE), None)
    folder = models / "vae"
    return (
        _save(state, folder / TINY_FILES["video_vae"], TINY_VIDEO_VAE),
        _save(dict(audio.state_dict()), folder / TINY_FILES["audio_vae"], TINY_AUDIO_VAE),
    )


def _text_encoder_folder(models: Path) -> Path:
    import transformers
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as token_models

    root = models / "text_encoders" / TINY_FILES["text_encoder"]
    vocab = {w: i for i, w in enumerate(("<unk>", "<|endoftext|>", "<|im_start|>") + _WORDS + _VISION)}
    tokenizer = Tokenizer(token_models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<|im_start|>", eos_token="<|endoftext|>"
    )
    fast.save_pretrained(root / "tokenizer")
    processor = dict(
        patch_size=4, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 64, "longest_edge": 4096}
    )
    transformers.Qwen2VLImageProcessor(**processor).save_pretrained(root / "processor")
    transformers.Qwen3VLVideoProcessor(**processor).save_pretrained(root / "processor")
    cfg = transformers.Qwen3VLConfig(
        text_config=dict(
            hidden_size=TINY_TEXT_WIDTH,
            intermediate_size=64,
            num_hidden_layers=_TEXT_LAYERS + 1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=len(vocab),
            rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=TINY_TEXT_WIDTH,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            deepstack_visual_indexes=[0],
        ),
        image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
    )
    torch.manual_seed(3)
    transformers.Qwen3VLForConditionalGeneration(cfg).save_pretrained(root / "text_encoder")
    settings = json.dumps({"conditioning_layer": _TEXT_LAYERS, NOTE_KEY: NOTE}, indent=1) + "\n"
    (root / SETTINGS_FILE).write_text(settings, encoding="utf-8")
    return root


def tiny_qwen3vl(layers: int = CONDITIONING_LAYER, *, seed: int = 4):
    """A seeded random ``Qwen3VLForConditionalGeneration`` (bf16) of Qwen3-VL-32B's family at a tiny width: what
    the shapes of a file cannot tell is the published model's (``qwen3vl_checkpoint.PUBLISHED``), so its
    ComfyUI file describes itself from its header like the real one."""
    import transformers

    from h3_core.formats.qwen3vl_checkpoint import PUBLISHED

    cfg = transformers.Qwen3VLConfig(
        text_config=dict(
            hidden_size=TINY_TEXT_WIDTH,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=128,
            vocab_size=151936,
            **PUBLISHED["text"],
        ),
        vision_config=dict(
            depth=25,
            hidden_size=64,
            intermediate_size=64,
            out_hidden_size=TINY_TEXT_WIDTH,
            num_position_embeddings=64,
            patch_size=16,
            temporal_patch_size=2,
            spatial_merge_size=2,
            **PUBLISHED["vision"],
        ),
        **PUBLISHED["ids"],
    )
    torch.manual_seed(seed)
    return transformers.Qwen3VLForConditionalGeneration(cfg).to(torch.bfloat16).eval()


def write_tiny_text_encoder_file(models: str | Path, layers: int = CONDITIONING_LAYER) -> Path:
    """``text_encoders/h3_tiny_random_qwen3vl.safetensors`` under ``models``: ``tiny_qwen3vl(layers)`` in
    ComfyUI's layout, as its H3 file is cut (no final norm, no output head)."""
    return _save(_tiny_text_encoder_state(layers), Path(models) / "text_encoders" / TINY_TEXT_ENCODER_FILE, None)


def _tiny_text_encoder_state(layers: int) -> dict[str, torch.Tensor]:
    from h3_core.formats.qwen3vl_checkpoint import LAYOUTS

    return {
        LAYOUTS[0].file_key(k): v
        for k, v in tiny_qwen3vl(layers).state_dict().items()
        if k not in ("lm_head.weight", "model.language_model.norm.weight")
    }


TEXT_ENCODER_QUANTIZATIONS = ("int8_convrot", "nvfp4_awq")
_DECODER_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# AWQ scales on the two linears whose input no norm precedes (ModelOpt folds the others' into the norms)
_PRESCALED = ("self_attn.o_proj", "mlp.down_proj")
_TOWER_LINEARS = ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2", "linear_fc1", "linear_fc2")


# The linears ComfyUI's int8_convrot files quantise: the DiT blocks' four, the video VAE decoder blocks' four.
_DIT_INT8_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
_VIDEO_VAE_INT8_LINEARS = ("attn.to_qkv", "attn.to_out", "ff.w1", "ff.w2")
INT8_CONVROT_FILES = {
    "dit": TINY_FILES["dit"].replace(".safetensors", "_int8_convrot.safetensors"),
    "video_vae": TINY_FILES["video_vae"].replace(".safetensors", "_int8_convrot.safetensors"),
}


def _comfy_quant(spec: dict) -> torch.Tensor:
    """A ``comfy_quant`` sidecar: the JSON bytes ComfyUI's ``_quantized_weight_state_dict`` writes."""
    return torch.tensor(list(json.dumps(spec).encode("utf-8")), dtype=torch.uint8)


def _int8_convrot(weight: torch.Tensor, group: int):
    """``weight`` quantised by comfy-kitchen in int8 ConvRot (groups of ``group``, a scale per row), and the
    ``comfy_quant`` spec ComfyUI's files store beside it."""
    from comfy_kitchen.tensor import QuantizedTensor

    qt = QuantizedTensor.from_float(
        weight, "TensorWiseINT8Layout", per_channel=True, convrot=True, convrot_groupsize=group
    )
    return qt, {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group}


def quantize_text_encoder_state(
    state: dict, kind: str, *, group: int = 256, tower: bool = False, seed: int = 5
) -> tuple[dict, dict]:
    """A text encoder's ``state`` in ComfyUI's layout (``model.*``, ``visual.*``) as ComfyUI's ``kind`` file
    (``TEXT_ENCODER_QUANTIZATIONS``) stores it: every decoder layer's seven linears quantised by comfy-kitchen
    (int8 ConvRot in groups of ``group`` with a scale per row; nvfp4, full-precision matmuls), the embedding table
    in int8 with a scale per row, the rest as given. With ``tower`` the vision tower's linears are quantised
    too. nvfp4_awq gives ``o_proj`` and ``down_proj`` seeded AWQ input scales ``s`` in [0.5, 2] and stores their
    weights divided by them column-wise (the layer computes ``(x·s) (W/s)ᵀ``). Returns the file's tensors and each
    quantised weight's ``QuantizedTensor`` by weight key."""
    from comfy_kitchen.tensor import QuantizedTensor

    if kind not in TEXT_ENCODER_QUANTIZATIONS:
        raise ValueError(f"kind must be one of {TEXT_ENCODER_QUANTIZATIONS}, got {kind!r}")
    generator = torch.Generator().manual_seed(seed)
    tensors, quantized = {}, {}
    for key, value in state.items():
        layer = key.removesuffix(".weight")
        decoder = key.startswith("model.layers.") and layer.split(".", 3)[-1] in _DECODER_LINEARS
        in_tower = tower and key.startswith("visual.") and layer.endswith(_TOWER_LINEARS)
        if key == "model.embed_tokens.weight":
            qt = QuantizedTensor.from_float(value, "TensorWiseINT8Layout", per_channel=True)
            spec, extra = {"format": "int8_tensorwise"}, {}
        elif (decoder or in_tower) and kind == "int8_convrot":
            (qt, spec), extra = _int8_convrot(value, group), {}
        elif decoder or in_tower:
            extra, weight = {}, value
            if layer.endswith(_PRESCALED):
                scale = (0.5 + 1.5 * torch.rand(value.shape[1], generator=generator)).to(value.dtype)
                extra[f"{layer}.pre_quant_scale"] = scale
                weight = (value.float() / scale.float()).to(value.dtype)
            qt = QuantizedTensor.from_float(weight, "TensorCoreNVFP4Layout")
            spec = {"format": "nvfp4", "full_precision_matrix_mult": True}
        else:
            tensors[key] = value
            continue
        tensors.update(qt.state_dict(key))
        tensors[f"{layer}.comfy_quant"] = _comfy_quant(spec)
        tensors.update(extra)
        quantized[key] = qt
    return tensors, quantized


def write_tiny_quantized_text_encoder_file(
    models: str | Path,
    kind: str,
    layers: int = CONDITIONING_LAYER,
    *,
    group: int = 16,
    dequantised: torch.dtype | None = None,
) -> Path:
    """``text_encoders/h3_tiny_random_qwen3vl_<kind>.safetensors`` under ``models``: the file
    ``write_tiny_text_encoder_file`` writes, quantised as ComfyUI's ``kind`` file (``quantize_text_encoder_state``;
    ConvRot groups of ``group``, which the tiny width must hold). For int8_convrot, ``dequantised`` (a dtype) also
    writes ``..._dequantised.safetensors`` holding comfy-kitchen's dequantisation of its layers."""
    tensors, quantized = quantize_text_encoder_state(_tiny_text_encoder_state(layers), kind, group=group)
    name = TINY_TEXT_ENCODER_FILE.replace(".safetensors", f"_{kind}.safetensors")
    path = _save(tensors, Path(models) / "text_encoders" / name, None)
    if dequantised is not None:
        if kind != "int8_convrot":  # nvfp4_awq's input scales have no place in a plain file
            raise ValueError(f"dequantised copies are written for int8_convrot only, got {kind!r}")
        _dequantised_copy(tensors, quantized, dequantised, _dequantised_name(path), None)
    return path


def quantize_int8_convrot(state: dict, layers, *, group: int) -> tuple[dict, dict]:
    """``state`` with the weights of ``layers`` (layer names, without ``.weight``) quantised by comfy-kitchen in
    int8 ConvRot (groups of ``group``, a scale per row) as ComfyUI's int8_convrot files store them, each beside its
    ``comfy_quant`` sidecar. Returns the file's tensors and each quantised weight's ``QuantizedTensor``."""
    layers = set(layers)
    tensors, quantized = {}, {}
    for key, value in state.items():
        layer = key.removesuffix(".weight")
        if layer not in layers or not key.endswith(".weight"):
            tensors[key] = value
            continue
        qt, spec = _int8_convrot(value, group)
        tensors.update(qt.state_dict(key))
        tensors[f"{layer}.comfy_quant"] = _comfy_quant(spec)
        quantized[key] = qt
    return tensors, quantized


def _dequantised_copy(tensors: dict, quantized: dict, dtype: torch.dtype, path: Path, cfg) -> Path:
    """``tensors`` (a quantised file's) with each quantised weight replaced by comfy-kitchen's own dequantisation
    of its ``QuantizedTensor`` standing for a ``dtype`` weight, and the sidecars dropped, saved at ``path``."""
    from comfy_kitchen.tensor import QuantizedTensor

    stored = {k for key, qt in quantized.items() for k in qt.state_dict(key)}
    stored |= {key.removesuffix("weight") + "comfy_quant" for key in quantized}
    state = {k: v for k, v in tensors.items() if k not in stored}
    for key, qt in quantized.items():
        codes = qt.layout_cls.get_plain_tensors(qt)[0]
        state[key] = QuantizedTensor(codes, qt.layout_cls.__name__, replace(qt.params, orig_dtype=dtype)).dequantize()
    return _save(state, path, cfg)


def _dequantised_name(path: Path) -> Path:
    return path.with_name(path.name.replace(".safetensors", "_dequantised.safetensors"))


def write_tiny_quantized_checkpoints(
    models: str | Path, *, group: int = 16, dequantised: dict[str, torch.dtype] | None = None
) -> tuple[Path, Path]:
    """The tiny DiT and video VAE (written by ``write_tiny_checkpoints`` under ``models`` first) as ComfyUI's
    int8_convrot files (``INT8_CONVROT_FILES``): the DiT in bf16 with its blocks' four linears quantised, the VAE in
    fp16 with its decoder blocks' linears quantised (``quantize_int8_convrot``). ``dequantised`` ({"dit": dtype,
    "video_vae": dtype}) also writes beside each a ``*_dequantised.safetensors`` holding comfy-kitchen's
    dequantisation of its layers in that dtype. Returns (DiT, VAE) paths."""
    from safetensors.torch import load_file

    models = Path(models)
    written = []
    for kind, cfg, dtype, linears, blocks in (
        ("dit", TINY_DIT, torch.bfloat16, _DIT_INT8_LINEARS, "blocks"),
        ("video_vae", TINY_VIDEO_VAE, torch.float16, _VIDEO_VAE_INT8_LINEARS, "decoder.transformer_blocks"),
    ):
        folder = models / ("diffusion_models" if kind == "dit" else "vae")
        state = {
            k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(str(folder / TINY_FILES[kind])).items()
        }
        count = cfg.layers if kind == "dit" else cfg.decoder_layers
        tensors, quantized = quantize_int8_convrot(
            state, [f"{blocks}.{i}.{name}" for i in range(count) for name in linears], group=group
        )
        written.append(_save(tensors, folder / INT8_CONVROT_FILES[kind], cfg))
        if dequantised and kind in dequantised:
            _dequantised_copy(tensors, quantized, dequantised[kind], _dequantised_name(written[-1]), cfg)
    return written[0], written[1]


def write_tiny_checkpoints(models: str | Path) -> TinyCheckpoints:
    """Write every tiny checkpoint under ``models`` (a ComfyUI ``models/`` folder); returns their paths.
    Writing again replaces them with the same bytes (seeded)."""
    models = Path(models)
    dit, branch = _dit_files(models)
    video, audio = _vae_files(models)
    return TinyCheckpoints(dit, branch, video, audio, _text_encoder_folder(models))
