"""The attention and memory settings node: window softmax backend, VAE attention overrides, the low-VRAM
policy and compilation, which the sampler and the decoders follow."""

from __future__ import annotations

from dataclasses import dataclass

from comfy_api.v0_0_2 import io

from ..h3_core.attention.vae import VAE_BACKENDS, check_vae_overrides
from ..h3_core.attention.window import BACKENDS, PRECISIONS, check_precision
from ..h3_core.memory.policy import COMPILE_MODES, MEMORY_MODES
from . import _host
from .checks import check_choice, verdict
from .io_types import H3Attention


@dataclass(frozen=True)
class AttentionSettings:
    window_backend: str = "auto"
    vae_overrides: tuple[tuple[str, str], ...] = ()
    memory: str = "auto"
    compile: str = "auto"
    attention_precision: str = "bf16"

    @property
    def overrides(self) -> dict[str, str]:
        return dict(self.vae_overrides)


DEFAULT = AttentionSettings()


class H3AttentionSettings(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3AttentionSettings",
            display_name="H3 Attention & Memory",
            category=_host.CATEGORY,
            description="Window softmax backend and precision, VAE attention per component, the memory policy "
            "(auto: the sampler predicts the run's peak against the memory the host gives it and, of head groups "
            "with a chunked FFN, AdaLN projections in host memory and blocks streamed from host memory, takes what "
            "fits in the least predicted time, saying what it chose) and compilation (auto: compiled and "
            "hand-written kernels where CUDA and Triton are present, falling back to the plain path if they fail; "
            "off: the plain path).",
            inputs=[
                io.Combo.Input(
                    "window_backend",
                    options=list(BACKENDS),
                    default="auto",
                    tooltip="auto: decomposed with the best dense kernel on CUDA; an explicit choice that "
                    "cannot run is an error",
                ),
                io.Combo.Input("video_vae_attention", options=list(VAE_BACKENDS), default="auto"),
                io.Combo.Input(
                    "audio_vae_attention",
                    options=list(VAE_BACKENDS),
                    default="auto",
                    tooltip="auto: fp32 causal SDPA as released; a fused backend casts q/k/v for the attention only",
                ),
                io.Combo.Input(
                    "memory_mode",
                    options=list(MEMORY_MODES),
                    default="auto",
                    tooltip="auto: the low-VRAM policy; off: run the plain path whatever the free memory",
                ),
                io.Combo.Input(
                    "compile",
                    options=list(COMPILE_MODES),
                    default="auto",
                    tooltip="auto: torch.compile and the Triton kernels where they run, the plain path if "
                    "they fail (one log line says why); off: the plain path always",
                ),
                io.Combo.Input(
                    "attention_precision",
                    options=list(PRECISIONS),
                    default="bf16",
                    tooltip="VDN-H3's window softmax. bf16: exact (the default). fp8: q, k, v and the attention "
                    "probabilities in e4m3 through cuDNN's fp8 attention (nvidia-cudnn-frontend, Hopper or newer), "
                    "approximate: the clip differs from bf16's at the same seed, for speed (the README has the "
                    "measured errors and gain). An error where no fp8 kernel runs; emulated, not faster, on the CPU.",
                    optional=True,
                ),
            ],
            outputs=[H3Attention.Output(display_name="attention")],
        )

    @classmethod
    def validate_inputs(
        cls,
        window_backend=None,
        video_vae_attention=None,
        audio_vae_attention=None,
        memory_mode=None,
        compile=None,
        attention_precision=None,
    ):
        return verdict(
            lambda: check_choice("window_backend", window_backend, BACKENDS),
            lambda: check_choice("attention_precision", attention_precision, PRECISIONS),
            lambda: precision_fits(attention_precision, window_backend),
            lambda: check_choice("video_vae_attention", video_vae_attention, VAE_BACKENDS),
            lambda: check_choice("audio_vae_attention", audio_vae_attention, VAE_BACKENDS),
            lambda: check_choice("memory_mode", memory_mode, MEMORY_MODES),
            lambda: check_choice("compile", compile, COMPILE_MODES),
        )

    @classmethod
    def execute(
        cls,
        window_backend,
        video_vae_attention,
        audio_vae_attention,
        memory_mode,
        compile="auto",
        attention_precision="bf16",
    ):
        overrides = check_vae_overrides({"video_vae": video_vae_attention, "audio_vae": audio_vae_attention})
        check_precision(attention_precision, window_backend)
        settings = AttentionSettings(
            window_backend, tuple(sorted(overrides.items())), memory_mode, compile, attention_precision
        )
        return io.NodeOutput(settings)


def precision_fits(precision, backend) -> None:
    """fp8 with the flex backend is refused at validation (both inputs are known then); links are checked later."""
    if precision in PRECISIONS and backend in BACKENDS:
        check_precision(precision, backend)
