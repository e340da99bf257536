"""Loader nodes: the DiT (with the optional VDN linear branch), both VAEs, the text encoder and prompt-embedding
files, from the host's model folders. Each file is checked from its header at validation, before any loader
runs; the DiT and the text encoder are read into host memory (the DiT straight to the GPU where it will run there
as it is, or where the host's rule for diffusion models puts it there), the VAEs where the host first loads them,
and each is handed to the host's model management, which moves it to the device when the node that runs it asks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from comfy_api.v0_0_2 import io

from ..h3_core.formats.audio_vae import load_audio_vae
from ..h3_core.formats.checkpoints import describe_dit_checkpoint, load_h3_model
from ..h3_core.formats.files import CheckpointFiles
from ..h3_core.formats.video_vae import load_video_vae
from ..h3_core.memory.policy import BUDGET_SHARE
from ..h3_core.pipeline.clip_on_ranks import DiTSource, VideoVAESource
from ..h3_core.pipeline.prompt import load_prompt_embedding
from ..h3_core.pipeline.release_clip import release_activations
from ..h3_core.pipeline.text_encoder import OFFLOAD_MODES, load_text_encoder
from . import _host
from .checks import check_choice, check_host_room, check_model_file, check_path, verdict
from .conditioning import to_conditioning
from .io_types import H3AudioVAE, H3Model, H3TextEncoder, H3VideoVAE
from .ranks import SOURCE_KEY

NONE = "none"
WEIGHT_DTYPES = {"bf16": (torch.bfloat16, "dtype"), "fp16": (torch.float16, "dtype"), "fp8": (torch.bfloat16, "fp8")}
OFFLOAD_POLICIES = ("auto", "resident", "stream blocks")
TEXT_ENCODER_MARKER = "config.json"


def _describe(model) -> str:
    kind = "VDN-H3 (hybrid attention)" if model.cfg.hybrid else "MiniMax H3 (dense attention)"
    return f"{kind}, {model.checkpoint.layout} layout, linears {model.linears}"


class H3DiTLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        files = _host.model_files("diffusion_models")
        return io.Schema(
            node_id="H3DiTLoader",
            display_name="H3 DiT Loader",
            category=_host.CATEGORY,
            description="Loads the MiniMax H3 DiT from diffusion_models/ (ComfyUI, official, diffusers, pruned or "
            "fp8-scaled files), optionally with VDN-H3's linear branch, straight to the GPU where ComfyUI loads "
            "diffusion models there, else into host memory, from where the sampler has the host load it. Add "
            "LoRAs with H3 LoRA nodes after it.",
            inputs=[
                io.Combo.Input("dit_name", options=files, tooltip="the H3 DiT checkpoint"),
                io.Combo.Input(
                    "linear_branch",
                    options=[NONE] + files,
                    default=NONE,
                    tooltip="VDN-H3's linear_branch/model.safetensors (hybrid attention); none runs plain H3",
                ),
                io.Combo.Input(
                    "weight_dtype",
                    options=list(WEIGHT_DTYPES),
                    default="bf16",
                    tooltip="fp8: the big linears in e4m3 with per-channel scales (fp8-scaled files are "
                    "used as they are)",
                ),
                io.Combo.Input(
                    "offload",
                    options=list(OFFLOAD_POLICIES),
                    default="auto",
                    tooltip="auto: the attention node's memory policy decides per run; resident: all "
                    "weights on the GPU; stream blocks: blocks from host memory",
                ),
                device_input("DiT"),
            ],
            outputs=[H3Model.Output(display_name="model")],
        )

    @classmethod
    def validate_inputs(cls, dit_name=None, linear_branch=None, device=None):
        # The host lists a refusal under every input this method takes: the files and the device (a workflow from a
        # machine with other GPUs) are checked here, the other lists' choices when the node runs.
        return verdict(
            lambda: check_device(device),
            lambda: check_model_file("diffusion_models", dit_name, "dit_name", "dit"),
            lambda: (
                linear_branch in (None, NONE)
                or check_model_file("diffusion_models", linear_branch, "linear_branch", "linear_branch")
            ),
        )

    @classmethod
    def fingerprint_inputs(cls, dit_name, linear_branch, weight_dtype, offload, device=_host.DEFAULT_DEVICE):
        return (
            _host.file_version("diffusion_models", dit_name),
            None if linear_branch == NONE else _host.file_version("diffusion_models", linear_branch),
            weight_dtype,
            offload,
            device,
        )

    @classmethod
    def execute(cls, dit_name, linear_branch, weight_dtype, offload, device=_host.DEFAULT_DEVICE):
        from .patchers import H3DiTPatcher

        check_choice("weight_dtype", weight_dtype, WEIGHT_DTYPES)
        check_choice("offload", offload, OFFLOAD_POLICIES)
        check_device(device)
        base = _host.model_path("diffusion_models", dit_name, "dit_name")
        branch = None if linear_branch == NONE else _host.model_path("diffusion_models", linear_branch, "linear_branch")
        import comfy.model_management as mm

        dtype, linears = WEIGHT_DTYPES[weight_dtype]
        run_on = _host.chosen_device(device, mm.get_torch_device())
        parameters = sum(CheckpointFiles(p).parameters for p in (base, branch) if p is not None)

        def runs_as_is() -> int:  # the weights as loaded and one evaluation of the released clip
            cfg = replace(describe_dit_checkpoint(base).cfg, hybrid=branch is not None)
            return _host_bytes(parameters, dtype, linears) + release_activations(cfg, dtype, linears)

        first = _first_device(parameters, dtype, offload, run_on, runs_as_is)
        if first.type == "cpu":
            check_host_room("dit_name", base, _host_bytes(parameters, dtype, linears), _host.host_memory_available())
        # A quantised file's layers stay comfy-kitchen layers when the device the host will run the model on has
        # the library's kernels for them.
        model = load_h3_model(base, branch=branch, device=first, dtype=dtype, linears=linears, run_device=run_on)
        where = "host memory" if first.type == "cpu" else f"the {first.type.upper()} ({first})"
        _host.say(f"loaded {base.name} into {where}: {_describe(model)}")
        patcher = H3DiTPatcher.wrap(model, offload, first, load_device=run_on)
        patcher.attachments[SOURCE_KEY] = DiTSource(str(base), None if branch is None else str(branch), dtype, linears)
        return io.NodeOutput(patcher)


def _host_bytes(parameters: int, dtype, linears: str) -> int:
    """What ``parameters`` weight values take in host memory once loaded: ``dtype``'s size each, one byte with fp8
    linears (an upper bound: the fp32 islands and the norms are a sliver)."""
    per_value = 1 if linears == "fp8" else dtype.itemsize
    return parameters * per_value


def _first_device(parameters: int, dtype, offload: str, run_on: torch.device, runs_as_is: Callable[[], int]):
    """Where the DiT (``parameters`` weight values in its files) is read to. For the host's own device: straight to
    it where ``runs_as_is()`` (the weights and one evaluation of the released clip, in bytes) fits the share of
    the memory the user left the host (free less ``--reserve-vram``) that a plan may fill — the sampler keeps it
    there, so nothing is moved later; otherwise by the host's rule for diffusion models
    (``unet_inital_load_device``: straight to the GPU when it has more memory free than the host and the weights
    fit, else host memory; the pack applies that rule itself where the host streams its own models with dynamic
    VRAM and answers host memory), and to the GPU only where the weights, counted as the host counts them (values
    × the dtype's size), fit the memory the user left, which the host's rule does not take off. For another device
    chosen on the loader, host memory, from where the host's model management loads it there. With blocks
    streamed always host memory, where they stream from."""
    import comfy.model_management as mm

    cpu = torch.device("cpu")
    if offload == "stream blocks" or run_on != torch.device(mm.get_torch_device()):
        return cpu
    size, room = parameters * dtype.itemsize, _host.free_memory(run_on)
    if size >= room:
        return cpu  # the weights would take the room the user reserved: host memory, and the plan streams them
    if run_on.type != "cpu" and runs_as_is() <= BUDGET_SHARE * room:
        return run_on
    chosen = torch.device(mm.unet_inital_load_device(parameters, dtype))
    if chosen.type == "cpu" and _host.dynamic_vram():
        # With dynamic VRAM (0.38) the host reads its own models to host memory and streams them from there; this
        # DiT is placed by the pack, so the host's earlier rule stays its rule
        free_device, free_host = mm.get_free_memory(run_on), mm.get_free_memory(cpu)
        if free_device > free_host and size < free_device:
            chosen = run_on
    return chosen


def _vae_patcher(model, device):
    import comfy.model_management as mm

    from .patchers import VAEPatcher

    return VAEPatcher(model, load_device=device, offload_device=mm.vae_offload_device())


def device_input(what: str):
    """A loader's ``device`` choice (``_host.device_choices``)."""
    return io.Combo.Input(
        "device",
        options=_host.device_choices(),
        default=_host.DEFAULT_DEVICE,
        optional=True,
        tooltip=f"where the {what} runs: default (the host's choice), the CPU, or a GPU of its own (e.g. a second "
        "card beside the DiT); the host's model management loads and frees it there",
    )


def check_device(device) -> None:
    if device is not None:
        check_choice("device", device, _host.device_choices())


def _vae_device(device):
    import comfy.model_management as mm

    return _host.chosen_device(device, mm.vae_device())


class _VAELoader(io.ComfyNode):
    """A VAE from the host's ``vae`` folder, checked as ``KIND`` from its header and held by the host's model
    management (``patchers.VAEPatcher``), which reads its weights from the file where it first loads it."""

    NODE_ID = DISPLAY = DESCRIPTION = KIND = ""
    OUTPUT = None

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id=cls.NODE_ID,
            display_name=cls.DISPLAY,
            category=_host.CATEGORY,
            description=cls.DESCRIPTION,
            inputs=[
                io.Combo.Input("vae_name", options=_host.model_files("vae")),
                device_input(cls.KIND.replace("_", " ")),
            ],
            outputs=[cls.OUTPUT.Output(display_name=cls.KIND)],
        )

    @classmethod
    def validate_inputs(cls, vae_name=None, device=None):
        return verdict(lambda: check_device(device), lambda: check_model_file("vae", vae_name, "vae_name", cls.KIND))

    @classmethod
    def fingerprint_inputs(cls, vae_name, device=_host.DEFAULT_DEVICE):
        return _host.file_version("vae", vae_name), device

    @classmethod
    def execute(cls, vae_name, device=_host.DEFAULT_DEVICE):
        check_device(device)
        where = _vae_device(device)
        path = _host.model_path("vae", vae_name, "vae_name")
        patcher = _vae_patcher(cls.read(path, where), where)
        if cls.KIND == "video_vae":
            patcher.attachments[SOURCE_KEY] = VideoVAESource(str(path))
        return io.NodeOutput(patcher)


class H3VideoVAELoader(_VAELoader):
    NODE_ID, DISPLAY, KIND, OUTPUT = "H3VideoVAELoader", "H3 Video VAE Loader", "video_vae", H3VideoVAE
    DESCRIPTION = (
        "Loads the MiniMax H3 video VAE (minimax_h3_video_vae_fp16.safetensors or a diffusers folder) from vae/; "
        "its weights are read where the host first loads it; the decoder runs in fp16 on a GPU."
    )

    @staticmethod
    def read(path, device):
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        # a quantised file's decoder linears stay comfy-kitchen layers where the VAE's device has kernels
        return load_video_vae(path, device="meta", dtype=dtype, run_device=device)


class H3AudioVAELoader(_VAELoader):
    NODE_ID, DISPLAY, KIND, OUTPUT = "H3AudioVAELoader", "H3 Audio VAE Loader", "audio_vae", H3AudioVAE
    DESCRIPTION = (
        "Loads the MiniMax H3 audio VAE (minimax_h3_audio_vae_fp32.safetensors) from vae/; its weights are read "
        "where the host first loads it; it runs in fp32."
    )

    @staticmethod
    def read(path, device):
        return load_audio_vae(path, device="meta")


def _text_encoder_choices() -> list[str]:
    """ComfyUI's single text-encoder files and Hugging Face folders in ``text_encoders/``."""
    folders = _host.model_folders("text_encoders", TEXT_ENCODER_MARKER)
    files = [
        f
        for f in _host.model_files("text_encoders")
        if f.endswith(".safetensors") and f.replace("\\", "/").split("/")[0] not in folders
    ]
    return sorted(set(files) | set(folders))


def _text_encoder_path(name):
    """The file or folder the dropdown's ``name`` is."""
    if name in _host.model_folders("text_encoders", TEXT_ENCODER_MARKER):
        return _host.model_folder("text_encoders", name, TEXT_ENCODER_MARKER, "text_encoder_name")
    return _host.model_path("text_encoders", name, "text_encoder_name")


def _host_tokenizer():
    """The Qwen tokenizer files the host ships (a single file has none of its own)."""
    import comfy.text_encoders

    return Path(list(comfy.text_encoders.__path__)[0]) / "qwen25_tokenizer"  # a namespace package: no __file__


class H3TextEncoderLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3TextEncoderLoader",
            display_name="H3 Text Encoder Loader",
            category=_host.CATEGORY,
            description="Loads Qwen3-VL, whose layer-50 states condition H3, into host memory: ComfyUI's single file "
            "(qwen3vl_32b_minimax_h3_bf16.safetensors; tokenized with the host's Qwen tokenizer files) or "
            "a Hugging Face folder, from text_encoders/; only the layers up to the 50th and the vision "
            "tower are held.",
            inputs=[
                io.Combo.Input("text_encoder_name", options=_text_encoder_choices()),
                io.Combo.Input(
                    "offload",
                    options=list(OFFLOAD_MODES),
                    default="auto",
                    tooltip="layers: stream one decoder layer at a time from host memory; auto: when the "
                    "host cannot give the whole model room on the GPU; none: always whole",
                ),
                device_input("text encoder"),
            ],
            outputs=[H3TextEncoder.Output(display_name="text_encoder")],
        )

    @classmethod
    def validate_inputs(cls, text_encoder_name=None, device=None):
        return verdict(
            lambda: check_device(device),
            lambda: (
                text_encoder_name is None
                or check_path(_text_encoder_path(text_encoder_name), "text_encoder", "text_encoder_name")
            ),
        )

    @classmethod
    def fingerprint_inputs(cls, text_encoder_name, offload, device=_host.DEFAULT_DEVICE):
        return _host.path_version(_text_encoder_path(text_encoder_name)), offload, device

    @classmethod
    def execute(cls, text_encoder_name, offload, device=_host.DEFAULT_DEVICE):
        import comfy.model_management as mm

        from .patchers import TextEncoderPatcher

        check_choice("offload", offload, OFFLOAD_MODES)
        check_device(device)
        path = _text_encoder_path(text_encoder_name)
        run_device = _host.chosen_device(device, mm.text_encoder_device())
        dtype = torch.bfloat16 if run_device.type == "cuda" else torch.float32
        tokenizer = _host_tokenizer() if path.is_file() else None
        # into host memory; a quantised file's linears stay comfy-kitchen layers where the device has its kernels
        encoder = load_text_encoder(
            path, tokenizer=tokenizer, device="cpu", dtype=dtype, offload="none", run_device=run_device
        )
        _host.say(f"loaded {path.name} into host memory: Qwen3-VL, {encoder.resident_bytes / 2**30:.2f} GiB held")
        return io.NodeOutput(TextEncoderPatcher.wrap(encoder, offload, run_device))


class H3PromptEmbeddingLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3PromptEmbeddingLoader",
            display_name="H3 Prompt Embedding Loader",
            category=_host.CATEGORY,
            description="Loads a saved prompt embedding (.safetensors, or a .pt read with weights_only) from "
            "models/h3_prompts/.",
            inputs=[io.Combo.Input("embedding", options=sorted(_host.model_files(_host.PROMPT_FOLDER)))],
            outputs=[io.Conditioning.Output(display_name="conditioning")],
        )

    @classmethod
    def validate_inputs(cls, embedding=None):
        return verdict(lambda: check_model_file(_host.PROMPT_FOLDER, embedding, "embedding", "prompt_embedding"))

    @classmethod
    def fingerprint_inputs(cls, embedding):
        return _host.file_version(_host.PROMPT_FOLDER, embedding)

    @classmethod
    def execute(cls, embedding):
        path = _host.model_path(_host.PROMPT_FOLDER, embedding, "embedding")
        return io.NodeOutput(to_conditioning(load_prompt_embedding(path)))
