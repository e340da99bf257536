"""Attention inside the two H3 VAEs, through the same kernel layer as the DiT.

Each VAE component picks its backend separately, from an override map such as
``{"video_vae": "flash_attn", "audio_vae": "sdpa"}``:

* ``video_vae`` (the ViT3D decoder; non-causal, tile-local): fp16/bf16 on CUDA runs the chosen backend
  (``auto``: the best probed fused kernel); fp32 always runs SDPA, because the fused kernels reject fp32
  and the decoder's precision is kept; MPS runs SDPA; ROCm gfx95 runs SDPA's math path.
* ``audio_vae`` (the encoder's causal attention, released in fp32): ``auto`` is causal SDPA in the input
  dtype; an explicitly chosen fused backend casts q, k, v to fp16 for the attention only and returns
  the input dtype.

Backends: ``auto``; ``sdpa`` (``F.scaled_dot_product_attention``, PyTorch's own dispatch); ``sdpa_math``;
``flash_attn`` (the first usable of flash-attn 4, 3, 2); or any kernel of ``KERNELS`` by name. VAE
attention has no sequence-parallel path: tiles are independent, so each device attends over its own
tiles only. Tensors are head-major ``[B, H, T, D]``, as the VAE modules lay them out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import H3BackendUnavailable, H3InputError
from .kernels import KERNELS, dense_attention, device_facts, resolve_kernel

__all__ = [
    "VAE_COMPONENTS",
    "VAE_BACKENDS",
    "VAEAttentionChoice",
    "check_vae_overrides",
    "resolve_vae_attention",
    "vae_attention",
]

log = logging.getLogger(__name__)

VAE_COMPONENTS = ("video_vae", "audio_vae")
FLASH_ATTN_KERNELS = ("fa4", "fa3", "fa2")
VAE_BACKENDS = ("auto", "sdpa", "sdpa_math", "flash_attn", *KERNELS)
_CAUSAL = {"video_vae": False, "audio_vae": True}
# Fused kernels take half precision; fp16 keeps 3 more mantissa bits than bf16 for the audio
# encoder's LayerNorm-ed inputs, which sit far inside its range.
FUSED_AUDIO_DTYPE = torch.float16


@dataclass(frozen=True)
class VAEAttentionChoice:
    """How one component's attention runs: ``backend`` is ``sdpa``, ``sdpa_math`` or a kernel name;
    ``compute_dtype`` is the dtype q, k, v are cast to (None: their own); ``reason`` says why."""

    component: str
    backend: str
    compute_dtype: torch.dtype | None
    reason: str


def check_vae_overrides(overrides: Mapping[str, str] | None) -> dict[str, str]:
    """Validate an override map; unknown components or backends raise, listing the valid names."""
    overrides = dict(overrides or {})
    for component, backend in overrides.items():
        if component not in VAE_COMPONENTS:
            raise H3InputError(
                f"unknown VAE attention component {component!r}; valid components: {list(VAE_COMPONENTS)}"
            )
        if backend not in VAE_BACKENDS:
            raise H3InputError(
                f"unknown VAE attention backend {backend!r} for {component}; valid backends: {list(VAE_BACKENDS)}"
            )
    return overrides


def _explicit_kernel(backend: str, device, dtype, head_dim) -> str:
    """The kernel for an explicitly chosen fused backend, or an error saying why it cannot run."""
    if backend != "flash_attn":
        resolve_kernel(device, dtype, head_dim, backend)  # raises H3BackendUnavailable with the reason
        return backend
    reasons = []
    for name in FLASH_ATTN_KERNELS:
        try:
            return resolve_kernel(device, dtype, head_dim, name)
        except H3BackendUnavailable as exc:
            reasons.append(str(exc))
    raise H3BackendUnavailable(
        "VAE attention backend 'flash_attn' needs flash-attn 4, 3 or 2 usable on this device: " + "; ".join(reasons)
    )


def resolve_vae_attention(
    component: str, device: torch.device, dtype: torch.dtype, head_dim: int, backend: str = "auto"
) -> VAEAttentionChoice:
    """Apply the VAE attention contract (module docstring) to one component's request."""
    check_vae_overrides({component: backend})
    device = torch.device(device)
    if component == "audio_vae":
        if backend == "auto":
            return VAEAttentionChoice(component, "sdpa", None, "audio VAE default: causal SDPA in its own dtype")
        if backend in ("sdpa", "sdpa_math"):
            return VAEAttentionChoice(component, backend, None, "chosen")
        try:
            return VAEAttentionChoice(component, _explicit_kernel(backend, device, dtype, head_dim), None, "chosen")
        except H3BackendUnavailable:
            if dtype == FUSED_AUDIO_DTYPE:
                raise
        kernel = _explicit_kernel(backend, device, FUSED_AUDIO_DTYPE, head_dim)
        return VAEAttentionChoice(
            component, kernel, FUSED_AUDIO_DTYPE, f"chosen; q, k, v cast to {FUSED_AUDIO_DTYPE} for the kernel"
        )
    facts = device_facts(device)
    if facts.rocm and (facts.arch or "").startswith("gfx95"):
        return VAEAttentionChoice(component, "sdpa_math", None, f"ROCm {facts.arch}: SDPA math")
    if facts.type == "mps":
        return VAEAttentionChoice(component, "sdpa", None, "MPS: SDPA")
    if facts.type != "cuda":
        return VAEAttentionChoice(component, "sdpa", None, f"{facts.type}: SDPA")
    if dtype not in (torch.float16, torch.bfloat16):
        return VAEAttentionChoice(component, "sdpa", None, f"{dtype}: SDPA keeps the precision fused kernels lack")
    if backend == "auto":
        return VAEAttentionChoice(component, resolve_kernel(device, dtype, head_dim), None, "best probed kernel")
    if backend in ("sdpa", "sdpa_math"):
        return VAEAttentionChoice(component, backend, None, "chosen")
    return VAEAttentionChoice(component, _explicit_kernel(backend, device, dtype, head_dim), None, "chosen")


_logged: set = set()


def vae_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    component: str,
    overrides: Mapping[str, str] | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of one VAE component under the contract; causal for ``audio_vae`` only.

    Args:
        q, k, v: head-major ``[B, H, T, D]``.
        component: ``"video_vae"`` or ``"audio_vae"``.
        overrides: component → backend map (``VAE_BACKENDS``); a missing component means ``auto``.
        scale: score scale. Default: ``D ** -0.5``.
    Returns:
        ``[B, H, T, D]`` in q's dtype.
    """
    if component not in VAE_COMPONENTS:
        raise H3InputError(f"unknown VAE attention component {component!r}; valid components: {list(VAE_COMPONENTS)}")
    backend = check_vae_overrides(overrides).get(component, "auto")
    choice = resolve_vae_attention(component, q.device, q.dtype, q.shape[-1], backend)
    key = (choice, str(q.device), q.dtype)
    if key not in _logged:
        _logged.add(key)
        log.info("%s attention on %s %s: %s (%s)", component, q.device, q.dtype, choice.backend, choice.reason)
    causal = _CAUSAL[component]
    if choice.backend in ("sdpa", "sdpa_math"):
        if choice.backend == "sdpa_math":
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    cast = choice.compute_dtype
    args = (q, k, v) if cast is None else (q.to(cast), k.to(cast), v.to(cast))
    out = dense_attention(*args, scale=scale, head_major=True, kernel=choice.backend, causal=causal).out
    return out.to(q.dtype)
