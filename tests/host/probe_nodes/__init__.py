"""A node pack the host tests install beside H3 Hybrid: it reports what the host's model management holds, makes
the host ask the loaded DiT for memory as it does when another model needs the room, and (on a GPU) holds device
memory so that a run meets an out-of-memory. Never shipped. Each probe takes optional inputs of any type, only
to be placed after the nodes whose outputs it takes, and passes a model through."""

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
        return {"ui": {"peak": [report]}, "result": (model,)}


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
    difference of the two velocities, and the host's loaded models."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "h3_model": ("H3_MODEL",), "frames": ("INT", {"default": 12})}}

    def probe(self, model, h3_model, frames, **_):
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


NODE_CLASS_MAPPINGS = {
    "H3ProbeNativeH3": H3ProbeNativeH3,
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
