"""The audio VAE's checkpoint layouts (ComfyUI's file, diffusers' and the official weight-normed names) and its
loader."""

from __future__ import annotations

import torch

from ..models.audio_vae import AudioVAE, AudioVAEConfig
from .keymap import KeyMap, Rule
from .vae import load_model

__all__ = ["load_audio_vae", "layouts", "comfy_layout", "diffusers_layout", "parametrized_layout"]


# The weight-normalised convolutions of the encoder and the decoder.
_WEIGHT_NORMED = (
    r"(?P<m>encoder\.block\.\d+(\.block\.\d+(\.block\.[13])?)?"
    r"|decoder\.(conv_pre|conv_post|ups\.\d+\.0|resblocks\.\d+\.convs[12]\.\d+))\.weight"
)


def _fold_weight_norm(parts):
    g, v = parts
    return torch._weight_norm(v, g, 0)


def comfy_layout() -> KeyMap:
    """ComfyUI's repackaged single file (``minimax_h3_audio_vae_fp32.safetensors``): weight norm already
    folded, so our own names, plus the latent statistics (read separately)."""
    return KeyMap("ComfyUI", ignore=(r"latents_(mean|std)",))


def diffusers_layout() -> KeyMap:
    """diffusers ``AutoencoderKLMiniMaxH3Audio`` names, which the official ``audio_vae/model.safetensors``
    shares: weight norm as ``weight_g`` / ``weight_v``."""
    return KeyMap("diffusers/official", (Rule(_WEIGHT_NORMED, ("{m}.weight_g", "{m}.weight_v"), _fold_weight_norm),))


def parametrized_layout() -> KeyMap:
    """The official module saved with ``torch.nn.utils.parametrizations.weight_norm``."""
    return KeyMap(
        "parametrized weight norm",
        (
            Rule(
                _WEIGHT_NORMED,
                ("{m}.parametrizations.weight.original0", "{m}.parametrizations.weight.original1"),
                _fold_weight_norm,
            ),
        ),
    )


def layouts() -> tuple[KeyMap, ...]:
    """Every checkpoint layout an audio VAE file may have."""
    return (comfy_layout(), diffusers_layout(), parametrized_layout())


def load_audio_vae(path, *, device="cpu", cfg: AudioVAEConfig | None = None) -> AudioVAE:
    """Load an audio VAE checkpoint (a single file or a folder) in any supported layout, in fp32."""
    return load_model(
        AudioVAE,
        AudioVAEConfig,
        cfg,
        path,
        lambda cfg: layouts(),
        what="MiniMax H3 audio VAE",
        device=device,
        dtype=torch.float32,
    )
