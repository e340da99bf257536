"""Loader nodes: the DiT (with the optional VDN linear branch and LoRAs), both VAEs, the text encoder and
prompt-embedding files. Files come from the host's model folders."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from h3_core.checkpoints import load_h3_model
from h3_core.errors import H3InputError
from h3_core.models.audio_vae import load_audio_vae
from h3_core.models.video_vae import load_video_vae
from h3_core.pipeline.prompt import load_prompt_embedding
from h3_core.pipeline.text_encoder import OFFLOAD_MODES, load_text_encoder

from . import _host
from .conditioning import to_conditioning

NONE = "none"
WEIGHT_DTYPES = {"bf16": (torch.bfloat16, "dtype"), "fp16": (torch.float16, "dtype"), "fp8": (torch.bfloat16, "fp8")}
OFFLOAD_POLICIES = ("auto", "resident", "stream blocks")
TEXT_ENCODER_MARKER = "config.json"


@dataclass
class H3Model:
    """What the DiT loader hands the sampler: the model (on the host until a run places it) and how the
    user wants it placed."""

    model: torch.nn.Module
    offload: str
    description: str
    fitted: object = field(default=None, repr=False)  # the last run's FittedModel, undone before the next
    residency: object = field(default=None, repr=False)  # how the host's model management sees the model


def _describe(model) -> str:
    kind = "VDN-H3 (hybrid attention)" if model.cfg.hybrid else "MiniMax H3 (dense attention)"
    loras = ", ".join(f"{m.lora.path.name} × {m.lora.strength:g}" for m in model.merged_loras) or "no LoRAs"
    return f"{kind}, {model.checkpoint.layout} layout, linears {model.linears}, {loras}"


class H3LoraList:
    """One LoRA with its strength, added to a list that the DiT loader merges in order."""

    CATEGORY = _host.CATEGORY
    RETURN_TYPES = ("H3_LORAS",)
    RETURN_NAMES = ("loras",)
    FUNCTION = "add"
    DESCRIPTION = "Adds a LoRA (ComfyUI .safetensors file from loras/) with its strength to the list the DiT loader merges."

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"lora_name": (_host.model_files("loras"),),
                             "strength": ("FLOAT", {"default": 1.0, "min": -10.0, "max": 10.0, "step": 0.05})},
                "optional": {"loras": ("H3_LORAS", {"tooltip": "LoRAs added before this one (merged first)"})}}

    def add(self, lora_name, strength, loras=None):
        path = _host.model_path("loras", lora_name, "lora_name")
        return (list(loras or []) + [(str(path), float(strength))],)


class H3DiTLoader:
    CATEGORY = _host.CATEGORY
    RETURN_TYPES = ("H3_MODEL",)
    RETURN_NAMES = ("model",)
    FUNCTION = "load"
    DESCRIPTION = ("Loads the MiniMax H3 DiT from diffusion_models/ (ComfyUI, official, diffusers, pruned or "
                   "fp8-scaled files), optionally with VDN-H3's linear branch, and merges LoRAs before any quantisation.")

    @classmethod
    def INPUT_TYPES(cls):
        files = _host.model_files("diffusion_models")
        return {"required": {
            "dit_name": (files, {"tooltip": "the H3 DiT checkpoint"}),
            "linear_branch": ([NONE] + files, {"default": NONE, "tooltip": "VDN-H3's linear_branch/model.safetensors "
                                                                            "(hybrid attention); none runs plain H3"}),
            "weight_dtype": (list(WEIGHT_DTYPES), {"default": "bf16", "tooltip": "fp8: the big linears in e4m3 with "
                                                   "per-channel scales (fp8-scaled files are used as they are)"}),
            "offload": (list(OFFLOAD_POLICIES), {"default": "auto", "tooltip": "auto: the attention node's memory "
                        "policy decides per run; resident: all weights on the GPU; stream blocks: blocks from host memory"}),
        }, "optional": {"loras": ("H3_LORAS",)}}

    def load(self, dit_name, linear_branch, weight_dtype, offload, loras=None):
        if weight_dtype not in WEIGHT_DTYPES:
            raise H3InputError(f"weight_dtype must be one of {list(WEIGHT_DTYPES)}, got {weight_dtype!r}")
        if offload not in OFFLOAD_POLICIES:
            raise H3InputError(f"offload must be one of {list(OFFLOAD_POLICIES)}, got {offload!r}")
        base = _host.model_path("diffusion_models", dit_name, "dit_name")
        branch = None if linear_branch == NONE else _host.model_path("diffusion_models", linear_branch, "linear_branch")
        dtype, linears = WEIGHT_DTYPES[weight_dtype]
        model = load_h3_model(base, branch=branch, loras=list(loras or []), device="cpu", dtype=dtype, linears=linears)
        description = _describe(model)
        _host.say(f"loaded {base.name}: {description}")
        return (H3Model(model, offload, description),)


class H3VideoVAELoader:
    CATEGORY = _host.CATEGORY
    RETURN_TYPES = ("H3_VIDEO_VAE",)
    RETURN_NAMES = ("video_vae",)
    FUNCTION = "load"
    DESCRIPTION = "Loads the MiniMax H3 video VAE (minimax_h3_video_vae_fp16.safetensors or a diffusers folder) from vae/."

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"vae_name": (_host.model_files("vae"),)}}

    def load(self, vae_name):
        path = _host.model_path("vae", vae_name, "vae_name")
        return (load_video_vae(path, device=_host.torch_device(), dtype=torch.float16 if _on_gpu() else torch.float32),)


class H3AudioVAELoader:
    CATEGORY = _host.CATEGORY
    RETURN_TYPES = ("H3_AUDIO_VAE",)
    RETURN_NAMES = ("audio_vae",)
    FUNCTION = "load"
    DESCRIPTION = "Loads the MiniMax H3 audio VAE (minimax_h3_audio_vae_fp32.safetensors) from vae/; it runs in fp32."

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"vae_name": (_host.model_files("vae"),)}}

    def load(self, vae_name):
        path = _host.model_path("vae", vae_name, "vae_name")
        return (load_audio_vae(path, device=_host.torch_device()),)


class H3TextEncoderLoader:
    CATEGORY = _host.CATEGORY
    RETURN_TYPES = ("H3_TEXT_ENCODER",)
    RETURN_NAMES = ("text_encoder",)
    FUNCTION = "load"
    DESCRIPTION = ("Loads Qwen3-VL (a folder in text_encoders/ with its config, weights and tokenizer) whose layer-50 "
                   "states condition H3.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "folder": (_host.model_folders("text_encoders", TEXT_ENCODER_MARKER),),
            "offload": (list(OFFLOAD_MODES), {"default": "auto", "tooltip": "layers: stream one decoder layer at a "
                        "time from host memory; auto: only when the model does not fit"}),
        }}

    def load(self, folder, offload):
        path = _host.model_folder("text_encoders", folder, TEXT_ENCODER_MARKER, "folder")
        dtype = torch.bfloat16 if _on_gpu() else torch.float32
        return (load_text_encoder(path, device=_host.torch_device(), dtype=dtype, offload=offload),)


class H3PromptEmbeddingLoader:
    CATEGORY = _host.CATEGORY
    RETURN_TYPES = ("CONDITIONING",)
    RETURN_NAMES = ("conditioning",)
    FUNCTION = "load"
    DESCRIPTION = "Loads a saved prompt embedding (.safetensors, or a .pt read with weights_only) from the input folder."

    @classmethod
    def INPUT_TYPES(cls):
        import folder_paths

        files = sorted(f for f in folder_paths.get_filename_list(_host.PROMPT_FOLDER))
        return {"required": {"embedding": (files,)}}

    def load(self, embedding):
        path = _host.model_path(_host.PROMPT_FOLDER, embedding, "embedding")
        return (to_conditioning(load_prompt_embedding(path)),)


def _on_gpu() -> bool:
    return _host.torch_device().type == "cuda"
