"""The attention and memory settings node: window softmax backend, VAE attention overrides and the
low-VRAM policy that the sampler and the decoders follow."""

from __future__ import annotations

from dataclasses import dataclass

from h3_core.attention.vae import VAE_BACKENDS, check_vae_overrides
from h3_core.attention.window import BACKENDS
from h3_core.errors import H3InputError
from h3_core.placement import MEMORY_MODES

from . import _host


@dataclass(frozen=True)
class AttentionSettings:
    window_backend: str = "auto"
    vae_overrides: tuple[tuple[str, str], ...] = ()
    memory: str = "auto"

    @property
    def overrides(self) -> dict[str, str]:
        return dict(self.vae_overrides)


DEFAULT = AttentionSettings()


class H3AttentionSettings:
    CATEGORY = _host.CATEGORY
    RETURN_TYPES = ("H3_ATTENTION",)
    RETURN_NAMES = ("attention",)
    FUNCTION = "settings"
    DESCRIPTION = ("Window softmax backend, VAE attention per component, and the memory policy: with memory_mode auto "
                   "the sampler predicts the run's peak against the free memory and gives things up in order "
                   "(head groups and a chunked FFN, AdaLN projections in host memory, then streamed blocks), saying "
                   "what it chose.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "window_backend": (list(BACKENDS), {"default": "auto", "tooltip": "auto: decomposed with the best dense "
                               "kernel on CUDA; an explicit choice that cannot run is an error"}),
            "video_vae_attention": (list(VAE_BACKENDS), {"default": "auto"}),
            "audio_vae_attention": (list(VAE_BACKENDS), {"default": "auto", "tooltip": "auto: fp32 causal SDPA as "
                                    "released; a fused backend casts q/k/v for the attention only"}),
            "memory_mode": (list(MEMORY_MODES), {"default": "auto", "tooltip": "auto: the low-VRAM policy; off: run "
                            "the plain path whatever the free memory"}),
        }}

    def settings(self, window_backend, video_vae_attention, audio_vae_attention, memory_mode):
        if window_backend not in BACKENDS:
            raise H3InputError(f"window_backend must be one of {list(BACKENDS)}, got {window_backend!r}")
        if memory_mode not in MEMORY_MODES:
            raise H3InputError(f"memory_mode must be one of {list(MEMORY_MODES)}, got {memory_mode!r}")
        overrides = check_vae_overrides({"video_vae": video_vae_attention, "audio_vae": audio_vae_attention})
        return (AttentionSettings(window_backend, tuple(sorted(overrides.items())), memory_mode),)
