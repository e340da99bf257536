"""Attention for H3: dense kernels with log-sum-exp, the VDN-H3 window softmax and its geometry, and the
attention of the two VAEs."""

from .kernels import KERNELS, AttnOut, dense_attention, force_kernel, probed_kernels, resolve_kernel
from .layout import (
    ANCHOR_MODES,
    SequenceLayout,
    Span,
    WindowSpec,
    anchor_frames,
    is_full_cover,
    window_bounds,
)
from .vae import VAE_BACKENDS, VAE_COMPONENTS, check_vae_overrides, resolve_vae_attention, vae_attention
from .window import (
    BACKENDS,
    WindowBackend,
    WindowRun,
    force_window_backend,
    resolve_window_backend,
    window_softmax,
)

__all__ = [
    "ANCHOR_MODES",
    "VAE_BACKENDS",
    "VAE_COMPONENTS",
    "check_vae_overrides",
    "resolve_vae_attention",
    "vae_attention",
    "AttnOut",
    "BACKENDS",
    "KERNELS",
    "SequenceLayout",
    "Span",
    "WindowBackend",
    "WindowRun",
    "WindowSpec",
    "anchor_frames",
    "dense_attention",
    "force_kernel",
    "force_window_backend",
    "is_full_cover",
    "probed_kernels",
    "resolve_kernel",
    "resolve_window_backend",
    "window_bounds",
    "window_softmax",
]
