"""VDN-H3 on the host's own MiniMax H3 model: a clone of the native MODEL whose blocks run the hybrid attention.

The host's H3 block loop (``comfy/ldm/minimax/model.py``, ComfyUI 0.30 and later) lets a block replacement
(``patches_replace["dit"][("double_block", i)]``) pass ``attention=`` to the block. Each replacement here passes
the pack's hybrid attention over the block's own weights (``h3_core.models.native_hybrid``); the branch file's
weights are a model of their own for the host's model management (the host's core patcher, dynamic VRAM
where it is on), reached through the replacements' ``models()``, which ``load_models_gpu`` loads beside the
DiT, counting their size (``ModelPatcher.model_patches_models``)."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..h3_core.attention.layout import ANCHOR_MODES, WindowSpec
from ..h3_core.attention.window import BACKENDS, PRECISIONS, check_precision
from ..h3_core.errors import H3InputError
from ..h3_core.models.hybrid import RELEASE_WINDOW
from ..h3_core.triton_forms import COMPILE_MODES
from . import _host
from .attention import precision_fits
from .checks import check_choice, check_model_file, verdict

NATIVE_CLASS = "MiniMaxH3Model"  # the host's H3 diffusion model (comfy.ldm.minimax.model)
NEEDS = "ComfyUI 0.30 or later (its native MiniMax H3 model)"


def native_diffusion_model(model):
    """The host's H3 diffusion model inside ``model`` (a host MODEL), or an error naming what it is instead."""
    inner = getattr(model, "model", None)
    diffusion = getattr(inner, "diffusion_model", None)
    if diffusion is None or type(diffusion).__name__ != NATIVE_CLASS or not hasattr(diffusion, "blocks"):
        what = type(diffusion if diffusion is not None else inner if inner is not None else model).__name__
        raise H3InputError(
            f"model: is a {what}, not ComfyUI's native MiniMax H3 ({NATIVE_CLASS}); H3 VDN-H3 Patch takes the "
            f"MODEL of the host's own H3 loader (needs {NEEDS}); for the pack's H3 DiT Loader choose its "
            "linear_branch instead"
        )
    attn = diffusion.blocks[0].attn
    missing = [n for n in ("qkv_proj", "q_norm", "k_norm", "out_proj", "heads", "head_dim") if not hasattr(attn, n)]
    if missing:
        raise H3InputError(f"model: its {NATIVE_CLASS} blocks lack {missing}; this ComfyUI's H3 model is not one "
                           "VDN-H3 knows")  # fmt: skip
    return diffusion


def _replacements(model) -> dict:
    options = model.model_options.get("transformer_options", {})
    return options.get("patches_replace", {}).get("dit", {})


def _host_norm_rope():
    """The host's fused q/k norm and split-half rotation (comfy-kitchen's, as its H3 attention calls it), or None
    on a host without it (the plain form then runs)."""
    try:
        import comfy.quant_ops
    except ImportError:
        return None
    return getattr(getattr(comfy.quant_ops, "ck", None), "rms_rope_split_half", None)


class _HostBlockPatch:
    """A block replacement as the host's model management sees it: ``models()`` gives the branch weights' patcher,
    loaded beside the DiT; ``to()`` (the host passes the device, then the dtype) leaves them to that patcher."""

    def __init__(self, patch, branch_patcher):
        self.patch, self.branch_patcher = patch, branch_patcher

    def __call__(self, args, extra):
        return self.patch(args, extra)

    def models(self):
        return [self.branch_patcher]

    def to(self, _device_or_dtype):
        return self

    def cleanup(self):
        pass

    def __deepcopy__(self, memo):
        # Hosts before 0.38 deep-copy a MODEL's options on clone(); the patch holds the host's own model and the
        # branch weights' patcher, which a copy must share (a copy of the model would miss its weight patches).
        return self


class H3VDNPatch(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3VDNPatch",
            display_name="H3 VDN-H3 Patch",
            category=_host.CATEGORY,
            description="Turns ComfyUI's own MiniMax H3 MODEL into VDN-H3: each block's attention becomes the hybrid "
            "attention (the window softmax plus the linear branch from the branch file), on the block's own weights "
            "as the host holds them (any format its loader reads). The host's samplers, guides, masks, LoRAs and "
            f"previews work as before. Needs {NEEDS}; on older hosts use H3 DiT Loader's linear_branch.",
            inputs=[
                io.Model.Input("model", tooltip="the MODEL of the host's own H3 loader (Load Diffusion Model)"),
                io.Combo.Input(
                    "linear_branch",
                    options=_host.model_files("diffusion_models"),
                    tooltip="VDN-H3's linear_branch/model.safetensors (renamed), in diffusion_models/",
                ),
                io.Int.Input(
                    "window_radius",
                    default=RELEASE_WINDOW.radius,
                    min=0,
                    max=64,
                    tooltip="chunks seen on each side of a frame's own (1 as released)",
                ),
                io.Int.Input(
                    "window_chunk",
                    default=RELEASE_WINDOW.chunk,
                    min=0,
                    max=64,
                    tooltip="latent frames per chunk (5 as released); 0: per-frame windows",
                ),
                io.Combo.Input("window_anchors", options=list(ANCHOR_MODES), default=RELEASE_WINDOW.anchors),
                io.Combo.Input(
                    "window_backend",
                    options=list(BACKENDS),
                    default="auto",
                    tooltip="auto: decomposed with the best dense kernel on CUDA, the reference loop elsewhere; "
                    "an explicit choice that cannot run is an error",
                ),
                io.Combo.Input("attention_precision", options=list(PRECISIONS), default="bf16"),
                io.Combo.Input(
                    "compile",
                    options=list(COMPILE_MODES),
                    default="auto",
                    tooltip="auto: the linear branch fused and compiled where CUDA and Triton are present, the "
                    "plain path if that fails (one log line says why); off: the plain path always",
                ),
            ],
            outputs=[io.Model.Output(display_name="model")],
        )

    @classmethod
    def validate_inputs(
        cls, linear_branch=None, window_anchors=None, window_backend=None, attention_precision=None, compile=None, **_
    ):
        return verdict(
            lambda: check_choice("window_anchors", window_anchors, ANCHOR_MODES),
            lambda: check_choice("compile", compile, COMPILE_MODES),
            lambda: check_choice("window_backend", window_backend, BACKENDS),
            lambda: check_choice("attention_precision", attention_precision, PRECISIONS),
            lambda: precision_fits(attention_precision, window_backend),
            lambda: check_model_file("diffusion_models", linear_branch, "linear_branch", "linear_branch"),
        )

    @classmethod
    def fingerprint_inputs(cls, linear_branch, **_):
        return _host.file_version("diffusion_models", linear_branch)

    @classmethod
    def execute(
        cls,
        model,
        linear_branch,
        window_radius,
        window_chunk,
        window_anchors,
        window_backend,
        attention_precision,
        compile="auto",
    ):
        import comfy.model_management as mm
        import comfy.model_patcher

        from ..h3_core.formats.checkpoints import load_branch_weights
        from ..h3_core.models.dit import DiTConfig
        from ..h3_core.models.native_hybrid import NativeBlockPatch, NativeHybridSettings, NativeVDN, kitchen_norm_rope

        diffusion = native_diffusion_model(model)
        already = [key for key, patch in _replacements(model).items() if isinstance(patch, _HostBlockPatch)]
        if already:
            raise H3InputError(
                f"model: is already VDN-H3 ({len(already)} blocks carry an H3 VDN-H3 Patch); apply the patch once"
            )
        window = WindowSpec(window_radius, window_chunk, window_anchors)
        check_precision(attention_precision, window_backend)
        attn = diffusion.blocks[0].attn
        cfg = DiTConfig(
            hidden=int(diffusion.hidden_size), layers=len(diffusion.blocks), heads=int(attn.heads),
            head_dim=int(attn.head_dim),
        )  # fmt: skip
        dtype = getattr(model.model, "manual_cast_dtype", None) or model.model_dtype()
        path = _host.model_path("diffusion_models", linear_branch, "linear_branch")
        branch = load_branch_weights(path, cfg, dtype=dtype)
        make_patcher = getattr(comfy.model_patcher, "CoreModelPatcher", comfy.model_patcher.ModelPatcher)
        branch_patcher = make_patcher(branch, load_device=model.load_device, offload_device=model.offload_device)
        kitchen = _host_norm_rope()

        vdn = NativeVDN(
            diffusion,
            branch,
            NativeHybridSettings(window, window_backend, attention_precision, compile),
            norm_rope=None if kitchen is None else kitchen_norm_rope(kitchen),
            cast_weight=lambda weight, device: mm.cast_to(weight, device=device),
        )
        patched = model.clone()
        previous = _replacements(model)
        for i in range(cfg.layers):
            patch = NativeBlockPatch(vdn, i, previous.get(("double_block", i)))
            patched.set_model_patch_replace(_HostBlockPatch(patch, branch_patcher), "dit", "double_block", i)
        _host.say(
            f"VDN-H3 on the native H3 model: {path.name} ({branch.layout}, {dtype}) on {cfg.layers} blocks, window "
            f"radius {window.radius} chunk {window.chunk} anchors {window.anchors}, softmax {window_backend} "
            f"{attention_precision}, compile {compile}"
        )
        return io.NodeOutput(patched)
