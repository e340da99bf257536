"""A node pack the host tests install beside H3 Hybrid: it reports what the host's model management holds, makes
the host ask the loaded DiT for memory as it does when another model needs the room, and (on a GPU) holds device
memory so that a run meets an out-of-memory. Never shipped. Each probe takes optional inputs of any type, only
to be placed after the nodes whose outputs it takes, and passes a model through."""

import sys

import comfy.model_management as mm
import torch


class AnyType(str):
    """A socket type every output fits (the host compares types with ``!=``)."""

    def __ne__(self, other):
        return False


ANY = AnyType("*")
AFTER = {"optional": {"model": (ANY,), "after_images": (ANY,), "after_audio": (ANY,)}}


def _ours(patcher) -> bool:
    """The pack's patchers, and the host's patchers around the pack's models (the library loads as the pack's own
    ``<pack>.h3_core``)."""
    return type(patcher).__module__.endswith("nodes.patchers") or ".h3_core." in f".{type(patcher.model).__module__}"


class _Probe:
    CATEGORY = "H3 test probes"
    RETURN_TYPES = (ANY,)
    RETURN_NAMES = ("model",)
    OUTPUT_NODE = True
    FUNCTION = "probe"

    @classmethod
    def IS_CHANGED(cls, **_):
        return float("nan")  # runs every time


class H3ProbeLoadedModels(_Probe):
    """The host's loaded models (``current_loaded_models``) as its model management sees them."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tag": ("STRING", {"default": ""})}, **AFTER}

    def probe(self, tag, model=None, **_):
        listed = []
        for loaded in mm.current_loaded_models:
            patcher = loaded.model
            if patcher is None:
                continue
            listed.append(
                {
                    "patcher": type(patcher).__name__,
                    "model": type(patcher.model).__name__,
                    "loaded_bytes": int(patcher.loaded_size()),
                    "size": int(patcher.model_size()),
                    "device": str(loaded.device),
                    "ours": _ours(patcher),
                }
            )
        return {"ui": {"loaded": listed}, "result": (model,)}


class H3ProbeHostUnload(_Probe):
    """The host asking the loaded DiT ``model`` for ``megabytes`` of device memory, as its ``free_memory`` does when
    another model is loaded and the room is short: ``LoadedModel.model_unload(memory_to_free=...)``, which calls
    the model's ``partially_unload`` (or unloads it whole when that frees too little). Reports what the DiT was
    asked and what it freed, by its own record and by the host's count of its loaded bytes."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "megabytes": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1e6, "step": 0.0001}),
                "tag": ("STRING", {"default": ""}),
            },
            **AFTER,
        }

    def probe(self, megabytes, tag, model=None, **_):
        wanted = int(round(megabytes * 2**20))
        entry = next(
            (
                m
                for m in mm.current_loaded_models
                if m.model is not None and model is not None and m.model.is_clone(model)
            ),
            None,
        )
        if entry is None:
            return {"ui": {"unload": [{"loaded": False}]}, "result": (model,)}
        patcher = entry.model
        placement = patcher.attachments["h3_placement"]
        placement.last_unload = None
        before = int(patcher.loaded_size())
        stays = not entry.model_unload(memory_to_free=wanted)
        if not stays:
            mm.current_loaded_models.remove(entry)  # as the host's free_memory does with a model it unloaded
        blocks = [
            sum(t.numel() * t.element_size() for t in (*b.parameters(), *b.buffers())) for b in patcher.model.blocks
        ]
        asked, freed = placement.last_unload or (None, None)
        return {
            "ui": {
                "unload": [
                    {
                        "loaded": True,
                        "asked": asked,
                        "freed": freed,
                        "before": before,
                        "after": int(patcher.loaded_size()),
                        "stays_loaded": stays,
                        "largest_block": max(blocks, default=0),
                        "wanted": wanted,
                    }
                ]
            },
            "result": (model,),
        }


class H3ProbeLoadAnother(_Probe):
    """On a GPU: load another model (a plain module of ``other_megabytes`` held by the host's own ModelPatcher)
    through the host's ``load_models_gpu`` while the DiT ``model`` is resident, with the working memory chosen so
    that the host must find ``megabytes`` more than the device has free. The host's other loaded models are first
    unloaded by its own ``free_memory`` (keeping the DiT), so the DiT is the one it asks. Reports what the host
    asked of the DiT and what the DiT freed (its own record), the DiT's loaded bytes before and after by the host's
    count, and whether the other model came onto the device; then the host unloads the other model again."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "megabytes": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1e6, "step": 0.0001}),
                "other_megabytes": ("FLOAT", {"default": 16.0, "min": 1.0, "max": 1e6}),
                "tag": ("STRING", {"default": ""}),
            },
            **AFTER,
        }

    def probe(self, megabytes, other_megabytes, tag, model=None, **_):
        import comfy.model_patcher
        import torch

        device = mm.get_torch_device()
        ours = next(
            (
                m
                for m in mm.current_loaded_models
                if m.model is not None and model is not None and m.model.is_clone(model)
            ),
            None,
        )
        if device.type != "cuda" or ours is None:
            return {"ui": {"load": [{"loaded": ours is not None, "device": device.type}]}, "result": (model,)}
        mm.free_memory(float("inf"), device, keep_loaded=[ours])
        patcher = ours.model
        placement = patcher.attachments["h3_placement"]
        placement.last_unload = None
        other_bytes = int(other_megabytes * 2**20)
        other_module = torch.nn.Module()
        other_module.weight = torch.nn.Parameter(
            torch.zeros(other_bytes // 2, dtype=torch.bfloat16), requires_grad=False
        )
        other = comfy.model_patcher.ModelPatcher(
            other_module, load_device=device, offload_device=mm.unet_offload_device()
        )
        wanted = int(round(megabytes * 2**20))
        before = int(patcher.loaded_size())
        free = mm.get_free_memory(device)
        # load_models_gpu asks free_memory for 1.1 x the new model's size + (memory_required + --reserve-vram)
        working = free + wanted - 1.1 * other.model_size() - mm.extra_reserved_memory()
        mm.load_models_gpu([other], memory_required=working)
        other_loaded = int(other.loaded_size())
        still_ours = any(m.model is patcher for m in mm.current_loaded_models)
        asked, freed = placement.last_unload or (None, None)
        blocks = [
            sum(t.numel() * t.element_size() for t in (*b.parameters(), *b.buffers())) for b in patcher.model.blocks
        ]
        report = {
            "loaded": True,
            "device": device.type,
            "wanted": wanted,
            "asked": asked,
            "freed": freed,
            "before": before,
            "after": int(patcher.loaded_size()),
            "stays_loaded": still_ours,
            "largest_block": max(blocks, default=0),
            "other_size": int(other.model_size()),
            "other_loaded": other_loaded,
        }
        entry = next(m for m in mm.current_loaded_models if m.model is other)
        entry.model_unload()
        mm.current_loaded_models.remove(entry)
        return {"ui": {"load": [report]}, "result": (model,)}


class H3ProbePeakMemory(_Probe):
    """On a GPU: the most device memory torch held in this server process since the last probe (allocated and
    reserved by its caching allocator); the count starts again after it."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tag": ("STRING", {"default": ""})}, **AFTER}

    def probe(self, tag, model=None, **_):
        import torch

        report = {"device": mm.get_torch_device().type}
        if torch.cuda.is_available():
            report.update(
                allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
                total_gib=torch.cuda.get_device_properties(0).total_memory / 2**30,
            )
            torch.cuda.reset_peak_memory_stats()
        report.update(_dit_placement())
        return {"ui": {"peak": [report]}, "result": (model,)}


def _dit_placement() -> dict:
    """The loaded H3 DiT's placement: what its memory plan said and, with blocks streamed, the bytes copied to
    the device per evaluation."""
    for loaded in mm.current_loaded_models:
        placement = getattr(loaded.model, "placement", None)
        fitted = getattr(placement, "fitted", None)
        if placement is None:
            continue
        offload = getattr(fitted, "offload", None)
        return {
            "placement_said": list(getattr(placement, "said", [])),
            "streamed_blocks": offload.stats.streamed_blocks if offload else 0,
            "copied_gib_per_evaluation": offload.stats.copied_bytes / 2**30 if offload else 0.0,
        }
    return {}


_BALLAST = []


class H3ProbeBallast(_Probe):
    """On a GPU: take all but ``leave_megabytes`` of the device's free memory (held until released), so the next
    run meets an out-of-memory as it would on a smaller card; ``release`` gives it back."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "leave_megabytes": ("FLOAT", {"default": 64.0, "min": 0.0, "max": 1e7}),
                "release": ("BOOLEAN", {"default": False}),
            },
            **AFTER,
        }

    def probe(self, leave_megabytes, release, model=None, **_):
        import torch

        _BALLAST.clear()
        device = mm.get_torch_device()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            if not release:
                free, _ = torch.cuda.mem_get_info(device)
                _BALLAST.append(
                    torch.empty(max(free - int(leave_megabytes * 2**20), 0), dtype=torch.uint8, device=device)
                )
        held = sum(t.numel() for t in _BALLAST)
        return {"ui": {"ballast": [{"held": held, "device": device.type}]}, "result": (model,)}


class H3ProbeNativeConditioning:
    """A CONDITIONING as ComfyUI's own H3 nodes make it (not in the host these tests run), re-derived from
    Comfy-Org/ComfyUI at 542de101 (comfy_extras/nodes_minimax_h3.py: ``conditioning_set_values`` with
    ``minimax_keyframes``, entries ``{resolved_frame_index, latent [1, 24, t, h, w], audio_latent [1, 32, 2, Ta]}``;
    the text encoder's row tags under ``minimax_token_tags``): the given prompt's rows and tags, and one keyframe
    with seeded random latents, or (``references``) ``minimax_refs`` blocks as ``MiniMaxH3ReferenceToVideo`` makes
    them."""

    CATEGORY = "H3 test probes"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "probe"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "conditioning": ("CONDITIONING",),
                "frame_idx": ("INT", {"default": 0, "min": 0, "max": 9999}),
                "width": ("INT", {"default": 64}),
                "height": ("INT", {"default": 32}),
                "audio_latents": ("INT", {"default": 0, "min": 0, "max": 9999}),
            },
            "optional": {"references": ("BOOLEAN", {"default": False})},
        }

    def probe(self, conditioning, frame_idx, width, height, audio_latents, references=False):
        import torch

        tensor, extra = conditioning[0]
        prompt = next(v for k, v in extra.items() if k == "h3_prompt")
        gen = torch.Generator().manual_seed(frame_idx)
        keyframe = {
            "resolved_frame_index": frame_idx,
            "latent": torch.randn(1, 24, 1, height // 16, width // 16, generator=gen),
        }
        if audio_latents:
            keyframe["audio_latent"] = torch.randn(1, 32, 2, audio_latents, generator=gen)
        native = {"minimax_token_tags": prompt.tags[None].clone(), "minimax_keyframes": [keyframe]}
        if references:  # MiniMaxH3ReferenceToVideo's blocks instead: a 32 x 32 image and a sound
            image = torch.randn(1, 24, 1, 2, 2, generator=gen)
            sound = torch.randn(1, 32, 2, max(audio_latents, 1), generator=gen)
            native = {
                "minimax_token_tags": prompt.tags[None].clone(),
                "minimax_refs": [
                    {"kind": "image", "latent": image, "latent_h": image.shape[3], "latent_w": image.shape[4]},
                    {"kind": "audio", "ref_audio_t": sound.shape[-1], "audio_latent": sound},
                ],
            }
        return ([[tensor, native]],)


class H3ProbeKeep:
    """Saves what it is given (a LATENT, an IMAGE) with ``torch.save`` as ``<output>/probes/<name>.pt``, for a test to
    read back exactly."""

    CATEGORY = "H3 test probes"
    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "probe"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": (ANY,), "name": ("STRING", {"default": "kept"})}}

    def probe(self, value, name):
        import os

        import folder_paths
        import torch

        folder = os.path.join(folder_paths.get_output_directory(), "probes")
        os.makedirs(folder, exist_ok=True)
        torch.save(value, os.path.join(folder, f"{name}.pt"))
        return {}


def _native_protocol():
    """The tests' re-derivation of ComfyUI's native H3 model (``tests/native_h3_protocol.py``)."""
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parents[2])
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import native_h3_protocol

    return native_h3_protocol


class _NativeHolder(torch.nn.Module):
    """What the host's ModelPatcher holds for a diffusion model (its ``BaseModel``): the model as
    ``diffusion_model``, in fp32 here."""

    def __init__(self, diffusion_model):
        super().__init__()
        self.diffusion_model = diffusion_model
        self.manual_cast_dtype = None

    def get_dtype(self):
        return torch.float32


class H3ProbeNativeH3(_Probe):
    """A host MODEL holding the re-derived native H3 model (``native_h3_protocol.MiniMaxH3Model``) with the base
    weights of the pack's DiT ``h3_model`` (loaded without a branch), in fp32, in the host's own ModelPatcher: the
    MODEL ComfyUI's own H3 loader gives, for a host without native H3."""

    RETURN_TYPES = ("MODEL",)

    @classmethod
    def IS_CHANGED(cls, **_):
        return "the same"  # cached as a loader's output is: what follows it runs again only when its inputs change

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"h3_model": ("H3_MODEL",)}}

    def probe(self, h3_model, **_):
        import comfy.model_patcher

        model = _native_protocol().native_for(h3_model.model.cfg)
        model.load_state_dict({k: v.float() for k, v in h3_model.model.state_dict().items()})
        holder = _NativeHolder(model.eval())
        patcher = comfy.model_patcher.ModelPatcher(holder, load_device=mm.get_torch_device(),
                                                   offload_device=mm.unet_offload_device())  # fmt: skip
        return {"ui": {"native": [{"blocks": len(model.blocks)}]}, "result": (patcher,)}


class H3ProbeOtherModel(_Probe):
    """A host MODEL that is not MiniMax H3: one linear layer as its diffusion model."""

    RETURN_TYPES = ("MODEL",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tag": ("STRING", {"default": ""})}}

    def probe(self, tag, **_):
        import comfy.model_patcher

        holder = _NativeHolder(torch.nn.Linear(4, 4))
        patcher = comfy.model_patcher.ModelPatcher(holder, load_device=mm.get_torch_device(),
                                                   offload_device=mm.unet_offload_device())  # fmt: skip
        return {"ui": {"other": [tag]}, "result": (patcher,)}


class H3ProbeNativeEvaluate(_Probe):
    """One evaluation of the (patched) native ``model`` after the host loads it (``load_models_gpu``, which also
    loads what its block replacements' ``models()`` give), beside the pack's own DiT ``h3_model`` (VDN-H3, loaded
    with the branch) in fp32 on the same T2VA request (``frames`` latent frames of 2x4 latents): the largest
    difference of the two velocities, and the host's loaded models. With ``lora_name``, the pack's DiT has that
    LoRA merged at ``strength`` in fp32 by the library's ``merge_lora`` (the oracle of the host's weight patches on
    ``model``)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {"model": ("MODEL",), "h3_model": ("H3_MODEL",), "frames": ("INT", {"default": 12})},
            "optional": {"lora_name": ("STRING", {"default": ""}), "strength": ("FLOAT", {"default": 1.0})},
        }

    def probe(self, model, h3_model, frames, lora_name="", strength=1.0, **_):
        import copy

        native = _native_protocol()
        pack_module = type(h3_model.model).__module__.rsplit(".models.", 1)[0]  # <pack>.h3_core
        import importlib

        packing = importlib.import_module(pack_module + ".pipeline.packing")
        hybrid = importlib.import_module(pack_module + ".models.hybrid")
        noise = importlib.import_module(pack_module + ".pipeline.noise")
        mm.load_models_gpu([model])
        loaded = [type(m.model.model).__name__ for m in mm.current_loaded_models if m.model is not None]
        device = mm.get_torch_device()
        g = torch.Generator().manual_seed(3)
        cfg = h3_model.model.cfg
        video = torch.randn(1, cfg.video_channels, frames, 2, 4, generator=g)
        audio = torch.randn(1, cfg.audio_channels, 2, 7, generator=g)
        text = torch.randn(1, 5, cfg.text_dim, generator=g)
        sigma = 0.6
        options = copy.copy(model.model_options.get("transformer_options", {}))
        diffusion = model.model.diffusion_model
        with torch.no_grad():
            out_video, out_audio = diffusion(
                [video.to(device), audio.to(device)], torch.tensor([sigma * 1000.0]), text.to(device), options
            )
        packed = packing.pack_sequence(torch.ones(5, dtype=torch.long), frames, 2, 4, 7)
        sigma_v = float(torch.tensor(sigma, dtype=torch.float32))  # as the native model reads its timestep
        levels, per_row = noise.row_timesteps(packed, 1.0 - sigma_v, 1.0 - native.shifted_sigma(sigma_v, 12.0, 3.0))
        pack_dit = copy.deepcopy(h3_model.model).float().to(device)
        if lora_name:
            import folder_paths

            lora = importlib.import_module(pack_module + ".formats.lora")
            path = folder_paths.get_full_path_or_raise("loras", lora_name)
            lora.merge_lora(pack_dit, lora.read_lora(path, strength))
        # the window the patch node's defaults give
        ctx = hybrid.HybridContext(packed.layout, hybrid.RELEASE_WINDOW, "auto", (0, 5))
        rows = (native.to_rows(video), native.audio_to_rows(audio), text[0], levels, per_row)
        with torch.no_grad():
            v_rows, a_rows = pack_dit(*(t.to(device) for t in rows), *packed.model_inputs(device), hybrid=ctx)
        video_diff = (v_rows.cpu() + native.to_rows(out_video.cpu())).abs().max().item()
        audio_diff = (a_rows.cpu() + native.audio_to_rows(out_audio.cpu())).abs().max().item()
        scale = v_rows.abs().max().item()
        return {
            "ui": {"evaluate": [{"video": video_diff, "audio": audio_diff, "scale": scale, "loaded": loaded}]},
            "result": (model,),
        }


# What a node pack could change in the server's process: the environment variables compilers read, the garbage
# collector's settings, threads, the optional kernel libraries imported, CUDA and its page-locked memory.
WATCHED_ENVIRONMENT = (
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED",
    "PYTORCH_CUDA_ALLOC_CONF",
)
OPTIONAL_KERNELS = ("flash_attn", "flash_attn.cute", "triton", "cudnn", "comfy_kitchen.backends.triton")


class H3ProbeProcessState(_Probe):
    """The server process's state that a node pack could change: the whole environment, the garbage collector's
    frozen objects and thresholds, the threads' names, which optional kernel libraries are imported, whether CUDA
    is initialised and the page-locked memory PyTorch's host allocator holds."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tag": ("STRING", {"default": ""})}, **AFTER}

    def probe(self, tag, **_):
        import gc
        import os
        import sys
        import threading

        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        state = {
            "tag": tag,
            "environment": dict(os.environ),
            "gc_frozen": gc.get_freeze_count(),
            "gc_threshold": list(gc.get_threshold()),
            "gc_enabled": gc.isenabled(),
            "threads": sorted(t.name for t in threading.enumerate()),
            "kernel_modules": [name for name in OPTIONAL_KERNELS if name in sys.modules],
            "cuda_initialized": cuda,
            "pinned_bytes": torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) if cuda else 0,
        }
        return {"ui": {"state": [state]}, "result": (None,)}


NODE_CLASS_MAPPINGS = {
    "H3ProbeNativeH3": H3ProbeNativeH3,
    "H3ProbeProcessState": H3ProbeProcessState,
    "H3ProbeNativeEvaluate": H3ProbeNativeEvaluate,
    "H3ProbeOtherModel": H3ProbeOtherModel,
    "H3ProbeKeep": H3ProbeKeep,
    "H3ProbeNativeConditioning": H3ProbeNativeConditioning,
    "H3ProbeLoadedModels": H3ProbeLoadedModels,
    "H3ProbeHostUnload": H3ProbeHostUnload,
    "H3ProbeBallast": H3ProbeBallast,
    "H3ProbeLoadAnother": H3ProbeLoadAnother,
    "H3ProbePeakMemory": H3ProbePeakMemory,
}


# ---- a native H3 MODEL the host's own samplers run (tests/host/test_host_native_vdn_sampling.py) ---------------------
#
# ComfyUI 0.38 samples its MiniMax H3 model as a model_base ``MiniMaxH3`` (Comfy-Org/ComfyUI comfy/model_base.py at
# 094c74c1): model type FLOW_AV, whose model_sampling is ``ModelSamplingAV`` + ``CONST`` (comfy/model_sampling.py at
# 2fd20839: a discrete flow sampling at the video shift, with an ``audio_shift`` and ``audio_scale = shift /
# audio_shift``); the latent is a nested (video [1, 24, T, h, w], audio [1, 32, 2, Ta]) pair, which the sampler
# packs flat (``latent_shapes``), carrying the audio scaled onto the video schedule: ``process_latent_in`` multiplies
# the packed audio slice by ``audio_scale``, ``process_latent_out`` divides it again, and the diffusion model's
# ``forward`` (comfy/ldm/minimax/model.py at 01a56b76) reads the carried audio back at its own σ before its blocks
# and turns the audio output into the carried latent's. ComfyUI 0.3.75 has the nested latent and the flat pack but
# not the rest; ``_native_h3`` writes them again here, from reading them, for the tests only.

_NATIVE_H3 = {}


def _native_h3() -> dict:
    """The stand-ins (made once): ``MiniMaxH3Model`` (the re-derived native model with the carried audio undone
    around it), ``MiniMaxH3`` (the model_base), its ``config``, and ``record`` (the wrapper that gives it the
    sampler's packed shapes)."""
    if _NATIVE_H3:
        return _NATIVE_H3
    import math

    import comfy.conds
    import comfy.latent_formats
    import comfy.model_base
    import comfy.model_sampling
    import comfy.nested_tensor
    import comfy.supported_models_base

    native = _native_protocol()

    class MiniMaxH3AV(comfy.latent_formats.LatentFormat):
        """``latent_formats.MiniMaxH3AV``: the video stream's geometry, 32 channels (the wider stream's), no
        scaling. Without the preview factors: 0.3.75 hands preview callbacks the flat pack, not the nested pair."""

        latent_channels = 32
        latent_dimensions = 3
        spacial_downscale_ratio = 16
        temporal_downscale_ratio = 4
        scale_factor = 1.0

    class ModelSamplingAV(comfy.model_sampling.ModelSamplingDiscreteFlow):
        """``ModelSamplingAV``: the video shift's flow sampling, and the audio stream's shift beside it."""

        def __init__(self, model_config=None):
            super().__init__(model_config)
            settings = {} if model_config is None else model_config.sampling_settings
            self.audio_shift = settings.get("audio_shift")

        def set_parameters(self, shift=1.0, audio_shift=None, timesteps=1000, multiplier=1000):
            self.audio_shift = audio_shift
            super().set_parameters(shift=shift, timesteps=timesteps, multiplier=multiplier)

        @property
        def audio_scale(self):
            return 1.0 if self.audio_shift is None else self.shift / self.audio_shift

    class Sampling(ModelSamplingAV, comfy.model_sampling.CONST):
        pass

    class MiniMaxH3Config(comfy.supported_models_base.BASE):
        """``supported_models.MiniMaxH3``'s settings."""

        unet_config = {"image_model": "minimax_h3"}
        sampling_settings = {"shift": 12.0, "audio_shift": 3.0}
        memory_usage_factor = 0.17
        latent_format = MiniMaxH3AV
        supported_inference_dtypes = [torch.bfloat16, torch.float32]

    class MiniMaxH3Model(native.MiniMaxH3Model):
        """The re-derived native model (its ``forward`` is the host's ``_forward``) with what the host's ``forward``
        adds around it: the audio the sampler carries, ``(σ_v / σ_a) · x_audio``, read back at its own σ, and the
        audio output turned into the carried latent's (its derivative in σ_v), so that ``x − σ_v · output`` is
        ``audio_scale`` times the audio's clean estimate."""

        def forward(self, x, timestep, context, transformer_options=None, minimax_payload=None, denoise_mask=None,
                    audio_denoise_mask=None, **_):  # fmt: skip
            options = {} if transformer_options is None else transformer_options
            payload = minimax_payload or {}
            scale = float(payload.get("audio_scale", 1.0))
            video, audio = x
            if scale != 1.0:
                shift_v = float(options.get("minimax_h3_sigma_shift_video", self.sigma_shift_video))
                shift_a = float(options.get("minimax_h3_sigma_shift_audio", self.sigma_shift_audio))
                sigma_v = (timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6)
                sigma_a = native.shifted_sigma(sigma_v, shift_v, shift_a)
                audio = audio * (sigma_a / sigma_v).to(audio.dtype)
            out_video, out_audio = super().forward(
                [video, audio], timestep, context, options, payload, denoise_mask, audio_denoise_mask
            )
            if scale != 1.0:
                out_audio = (1.0 - scale) * audio + (1.0 + (scale - 1.0) * sigma_a).to(out_audio.dtype) * out_audio
            return [out_video, out_audio]

    class MiniMaxH3(comfy.model_base.BaseModel):
        """``model_base.MiniMaxH3`` on the host's ``BaseModel``: the carried audio's scale on the packed latent
        (``process_latent_in`` / ``_out``), and the conds its model reads (``extra_conds``: the text, the packed
        shapes, the ``minimax_payload``). The text goes to the model as the encoder gives it (0.38 refines it once
        per run; the re-derived model refines it in every evaluation, the same arithmetic), and the packed layout
        is the model's own each evaluation (0.38 builds it once per run in ``extra_conds``)."""

        def __init__(self, diffusion_model):
            config = MiniMaxH3Config({"image_model": "minimax_h3", "disable_unet_model_creation": True})
            super().__init__(config, comfy.model_base.ModelType.FLOW)  # 0.3.75 has no FLOW_AV
            self.diffusion_model = diffusion_model.eval()
            self.model_sampling = Sampling(config)
            self.latent_shapes = None  # the sampler's packed shapes (recorded by ``record_latent_shapes``)

        def get_dtype(self):
            return self.diffusion_model.dtype

        def audio_scale(self):
            if self.latent_shapes is None or len(self.latent_shapes) < 2:
                return 1.0
            return self.model_sampling.audio_scale

        def _scaled_audio(self, latent, scale):
            if scale == 1.0:
                return latent
            if getattr(latent, "is_nested", False):
                video, audio, *rest = latent.unbind()
                return comfy.nested_tensor.NestedTensor([video, audio * scale, *rest])
            video_size = math.prod(self.latent_shapes[0][1:])
            latent = latent.clone()
            latent[..., video_size:] *= scale
            return latent

        def process_latent_in(self, latent):
            return self._scaled_audio(super().process_latent_in(latent), self.audio_scale())

        def process_latent_out(self, latent):
            return super().process_latent_out(self._scaled_audio(latent, 1.0 / self.audio_scale()))

        def extra_conds(self, **kwargs):
            out = super().extra_conds(**kwargs)
            if kwargs.get("cross_attn") is not None:
                out["c_crossattn"] = comfy.conds.CONDRegular(kwargs["cross_attn"])
            latent_shapes = kwargs.get("latent_shapes")
            if latent_shapes is not None:
                out["latent_shapes"] = comfy.conds.CONDConstant(latent_shapes)
            if kwargs.get("denoise_mask") is not None:
                raise ValueError("the test host's native H3 stand-in does not take denoise masks")
            payload = {}
            if kwargs.get("minimax_token_tags") is not None:
                payload["text_token_tags"] = kwargs["minimax_token_tags"]
            # keyframes, then references: their latents are the condition rows, in that order
            for key, name in (("minimax_keyframes", "keyframes"), ("minimax_refs", "refs")):
                blocks = kwargs.get(key)
                if blocks is None:
                    continue
                payload[name] = blocks
                for stream, latent in (("video", "latent"), ("audio", "audio_latent")):
                    found = [b[latent] for b in blocks if b.get(latent) is not None]
                    payload[f"cond_{stream}_latents"] = payload.get(f"cond_{stream}_latents", []) + found
            for name in ("visual_cond_noise_aug", "audio_cond_noise_aug"):
                if kwargs.get(f"minimax_{name}") is not None:
                    payload[name] = kwargs[f"minimax_{name}"]
            payload["seed"] = kwargs.get("seed", 0)
            payload["audio_scale"] = self.audio_scale()
            out["minimax_payload"] = comfy.conds.CONDConstant(payload)
            return out

    def record_latent_shapes(executor, *args, **kwargs):
        """An OUTER_SAMPLE wrapper: the packed shapes on the model before anything is scaled, where 0.38's
        ``CFGGuider.inner_sample`` puts them (``inner_model.latent_shapes``)."""
        executor.class_obj.model_patcher.model.latent_shapes = kwargs.get("latent_shapes")
        return executor(*args, **kwargs)

    _NATIVE_H3.update(
        MiniMaxH3Model=MiniMaxH3Model, MiniMaxH3=MiniMaxH3, config=MiniMaxH3Config, record=record_latent_shapes
    )
    return _NATIVE_H3


class H3ProbeNativeH3Model(_Probe):
    """A host MODEL as ComfyUI 0.38's own H3 loader gives it, which the host's samplers run: the re-derived native
    model with the base weights of the pack's DiT ``h3_model`` (loaded without a branch), in fp32, in a
    ``BaseModel`` like 0.38's ``model_base.MiniMaxH3`` (``_native_h3``), held by the host's own ModelPatcher."""

    RETURN_TYPES = ("MODEL",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"h3_model": ("H3_MODEL",)}}

    def probe(self, h3_model, **_):
        import comfy.model_patcher
        import comfy.patcher_extension

        parts, cfg = _native_h3(), h3_model.model.cfg
        model = parts["MiniMaxH3Model"](
            cfg.hidden, cfg.layers, cfg.heads, cfg.head_dim, cfg.ffn, cfg.text_dim, cfg.freq_dim, cfg.time_hidden,
            cfg.time_embed, cfg.rope_freqs, refiner_layers=cfg.refiner_layers, eps=cfg.eps,
        )  # fmt: skip
        model.load_state_dict({k: v.float() for k, v in h3_model.model.state_dict().items()})
        model.dtype = torch.float32  # as the host's model records the dtype it was made in
        patcher = comfy.model_patcher.ModelPatcher(parts["MiniMaxH3"](model), load_device=mm.get_torch_device(),
                                                   offload_device=mm.unet_offload_device())  # fmt: skip
        patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, "h3_probe", parts["record"])
        return {"ui": {"native": [{"blocks": len(model.blocks)}]}, "result": (patcher,)}


class H3ProbeEmptyNativeLatentAV(_Probe):
    """``EmptyMiniMaxH3LatentAV`` (comfy_extras/nodes_minimax_h3.py at 13a83ce7): the length snapped up to 17k + 5
    frames, a nested pair of zeros, video [1, 24, T, height/16, width/16] and audio [1, 32, 2, round(seconds · 40)]."""

    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("latent",)

    @classmethod
    def INPUT_TYPES(cls):
        size = {"default": 64, "min": 32, "max": 16384}
        return {"required": {"width": ("INT", size), "height": ("INT", size), "length": ("INT", {"default": 22})}}

    def probe(self, width, height, length, **_):
        from comfy.nested_tensor import NestedTensor

        frames = max(5, length)
        frames += (5 - frames) % 17
        latent_t = 2 if frames <= 5 else (frames - 5) // 17 * 5 + 2
        device = mm.intermediate_device()
        video = torch.zeros([1, 24, latent_t, height // 16, width // 16], device=device)
        audio = torch.zeros([1, 32, 2, round(frames / 24 * 40)], device=device)
        shapes = {"video": list(video.shape), "audio": list(audio.shape)}
        return {"ui": {"latent": [shapes]}, "result": ({"samples": NestedTensor((video, audio))},)}


class H3ProbeNativeTextConditioning:
    """A CONDITIONING as ComfyUI's own H3 text encoder gives it: the pack's encoded prompt's rows, and its row tags
    under ``minimax_token_tags`` (nothing else)."""

    CATEGORY = "H3 test probes"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "probe"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"conditioning": ("CONDITIONING",)}}

    def probe(self, conditioning):
        tensor, extra = conditioning[0]
        return ([[tensor, {"minimax_token_tags": extra["h3_prompt"].tags[None].clone()}]],)


class H3ProbeFloat32DiT(_Probe):
    """The pack's DiT ``h3_model`` in fp32 (a copy of its weights, each exactly as loaded), in the pack's own patcher
    with the same offload policy: the pack's sampler then runs in the dtype the native model above runs in."""

    RETURN_TYPES = ("H3_MODEL",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"h3_model": ("H3_MODEL",)}}

    def probe(self, h3_model, **_):
        import copy

        model = copy.deepcopy(h3_model.model).float()
        patcher = type(h3_model).wrap(model, h3_model.placement.offload, "cpu", load_device=h3_model.load_device)
        return {"ui": {"dtype": [str(next(model.parameters()).dtype)]}, "result": (patcher,)}


class H3ProbeKeepStreams:
    """Saves a LATENT's streams as plain tensors with ``torch.save`` as ``<output>/probes/<name>.pt``: ``[video,
    audio]`` of ComfyUI's own nested H3 AV latent (readable without the host's ``NestedTensor``)."""

    CATEGORY = "H3 test probes"
    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "probe"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"latent": ("LATENT",), "name": ("STRING", {"default": "kept"})}}

    def probe(self, latent, name):
        import os

        import folder_paths

        samples = latent["samples"]
        streams = [t.detach().cpu().clone() for t in samples.unbind()] if samples.is_nested else [samples.cpu()]
        folder = os.path.join(folder_paths.get_output_directory(), "probes")
        os.makedirs(folder, exist_ok=True)
        torch.save(streams, os.path.join(folder, f"{name}.pt"))
        return {}


NODE_CLASS_MAPPINGS.update(
    {
        "H3ProbeNativeH3Model": H3ProbeNativeH3Model,
        "H3ProbeEmptyNativeLatentAV": H3ProbeEmptyNativeLatentAV,
        "H3ProbeNativeTextConditioning": H3ProbeNativeTextConditioning,
        "H3ProbeFloat32DiT": H3ProbeFloat32DiT,
        "H3ProbeKeepStreams": H3ProbeKeepStreams,
    }
)


# ---- the layers the sampler's model crosses (tests/host/test_host_call_layers.py) ------------------------------------

# The pack's layers top down, as docs/architecture.md draws them; h3_core's own top-level modules are the lowest.
PACK_LAYERS = ("nodes", "pipeline", "media", "memory", "formats", "models", "parallel", "attention", "h3_core")
_traced = {}
# a decorator's wrapper is the function it wraps: its frame is skipped, not counted as the caller
_WRAPPERS = {"h3_core.triton_forms:guarded.<locals>.call"}


def _pack_layer(module: str):
    """The layer of a module of the pack (loaded as ``<pack>.nodes...`` and ``<pack>.h3_core...``), else None."""
    parts = module.split(".")
    if len(parts) < 3 or parts[0] + ".h3_core" not in sys.modules:
        return None
    if parts[1] == "nodes":
        return 0
    if parts[1] == "h3_core":
        return PACK_LAYERS.index(parts[2]) if parts[2] in PACK_LAYERS[1:-1] else len(PACK_LAYERS) - 1
    return None


def _where(frame) -> str:
    return f"{frame.f_globals.get('__name__', '?').split('.', 1)[-1]}:{frame.f_code.co_qualname}"


def _layer_tracer(frame, event, arg):
    """While the sampler node's ``execute`` runs: every call of a pack function whose nearest pack caller on the
    stack (host and torch frames between them skipped) is in a lower layer, kept once per (caller, callee)."""
    if event != "call":
        if event == "return" and frame is _traced.get("execute"):
            _traced["execute"] = None
        return
    module = frame.f_globals.get("__name__", "")
    layer = _pack_layer(module)
    if layer is None:
        return
    if _traced.get("execute") is None:
        if module.endswith(".nodes.sampler") and frame.f_code.co_name == "execute":
            _traced["execute"] = frame
        return
    caller = frame.f_back
    while caller is not None and (
        _pack_layer(caller.f_globals.get("__name__", "")) is None or _where(caller) in _WRAPPERS
    ):
        caller = caller.f_back
    if caller is None:
        return
    below = _pack_layer(caller.f_globals["__name__"])
    if below > layer:
        key = (_where(caller), _where(frame))
        _traced["upward"].setdefault(key, [PACK_LAYERS[below], PACK_LAYERS[layer], 0])[2] += 1
    elif below == 0 and layer > 0 and caller is _traced["execute"]:
        _traced["descents"].add(_where(frame))


class H3ProbeTraceLayersStart(_Probe):
    """Starts recording, on the thread that runs the prompt, which calls of the pack go back up its layers while
    the H3 Sampler runs (the sampler takes this node's ``model`` output, so it runs after this)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": (ANY,)}}

    def probe(self, model):
        _traced.update(execute=None, upward={}, descents=set())
        sys.setprofile(_layer_tracer)
        return {"ui": {"started": [True]}, "result": (model,)}


class H3ProbeTraceLayersStop(_Probe):
    """Stops the recording (placed after the sampler's latent) and reports each upward call: the caller, the
    callee, their layers and how many times it was made; and the pack functions the sampler's ``execute`` called
    itself."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"after": (ANY,)}}

    def probe(self, after):
        sys.setprofile(None)
        upward = [
            {"caller": caller, "callee": callee, "from": below, "to": above, "calls": calls}
            for (caller, callee), (below, above, calls) in sorted(_traced.get("upward", {}).items())
        ]
        return {"ui": {"upward": upward, "descents": sorted(_traced.get("descents", ()))}, "result": (after,)}


NODE_CLASS_MAPPINGS.update(
    {"H3ProbeTraceLayersStart": H3ProbeTraceLayersStart, "H3ProbeTraceLayersStop": H3ProbeTraceLayersStop}
)
