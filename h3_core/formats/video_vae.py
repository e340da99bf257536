"""The video VAE's checkpoint layouts (ComfyUI's file and the official one, diffusers' folder) and its loader."""

from __future__ import annotations

import torch

from ..models.video_vae import VideoVAE, VideoVAEConfig, keeps_fp32
from .keymap import KeyMap, Rule, swap_halves
from .vae import load_model

__all__ = ["load_video_vae", "layouts", "comfy_layout", "diffusers_layout"]


def _fuse_qkv_per_head(head_dim: int):
    """Separate q, k, v projections → one laid out per head as [q, k, v] (rows or bias entries)."""

    def combine(parts):
        q = parts[0]
        heads = q.shape[0] // head_dim
        return torch.stack([p.reshape(heads, head_dim, *p.shape[1:]) for p in parts], 1).reshape(-1, *q.shape[1:])

    return combine


_BLOCK = r"decoder\.transformer_blocks\.(?P<i>\d+)\."
_RESNET = r"encoder\.down\.(?P<l>\d+)\.block\.(?P<j>\d+)\."


def comfy_layout() -> KeyMap:
    """ComfyUI's repackaged single file (``minimax_h3_video_vae_fp16.safetensors``) and the official
    ``video_vae/source/model.safetensors``: our own names. ``decoder.mask_token`` (unused at inference)
    and the latent statistics (read separately) may be present."""
    return KeyMap("ComfyUI/official", ignore=(r"decoder\.mask_token", r"latents_(mean|std)"))


def diffusers_layout(cfg: VideoVAEConfig) -> KeyMap:
    """diffusers ``AutoencoderKLMiniMaxH3`` names (the ``vae/`` folder of a diffusers repository)."""
    block = "decoder.transformer_blocks.{i}."
    return KeyMap(
        "diffusers",
        (
            Rule(
                _RESNET + r"nin_shortcut\.(?P<p>weight|bias)",
                ("encoder.down_blocks.{l}.resnets.{j}.conv_shortcut.{p}",),
            ),
            Rule(_RESNET + r"(?P<rest>.+)", ("encoder.down_blocks.{l}.resnets.{j}.{rest}",)),
            Rule(
                r"encoder\.down\.(?P<l>\d+)\.downsample\.(?P<rest>.+)",
                ("encoder.down_blocks.{l}.downsamplers.0.{rest}",),
            ),
            Rule(r"decoder\.x_embedder\.(?P<p>weight|bias)", ("decoder.proj_in.{p}",)),
            Rule(
                _BLOCK + r"attn\.to_qkv\.(?P<p>weight|bias)",
                tuple(block + f"attn.to_{x}.{{p}}" for x in "qkv"),
                _fuse_qkv_per_head(cfg.decoder_head_dim),
            ),
            Rule(_BLOCK + r"attn\.to_out\.(?P<p>weight|bias)", (block + "attn.to_out.0.{p}",)),
            Rule(_BLOCK + r"ff\.w1\.(?P<p>weight|bias)", (block + "ff.net.0.proj.{p}",), swap_halves),
            Rule(_BLOCK + r"ff\.w2\.(?P<p>weight|bias)", (block + "ff.net.2.{p}",)),
        ),
    )


def load_video_vae(
    path, *, device="cpu", dtype: torch.dtype = torch.float16, cfg: VideoVAEConfig | None = None, run_device=None
) -> VideoVAE:
    """Load a video VAE checkpoint (a single file or a folder) in any supported layout.

    The decoder's blocks are held in ``dtype``; the encoder, the latent convs, the first and last
    decoder projections, the norms and the LayerScales stay fp32. ``cfg`` gives the sizes (default: the
    released model); the file's ``latents_mean`` / ``latents_std`` tensors or a folder's ``config.json``
    supply the latent statistics.

    ComfyUI's quantised file (``minimax_h3_video_vae_int8_convrot.safetensors``: the decoder blocks' linears in
    int8 ConvRot, ``h3_core.formats.quantized_files``) loads too: on a GPU where comfy-kitchen has kernels for them the
    quantised linears keep the file's codes as comfy-kitchen weights (the blocks' ``F.linear`` calls run the
    library's int8 matmul), anywhere else they are dequantised by comfy-kitchen into ``dtype``; one log line
    says which (``keymap.load_into``). Read into ``device`` for a run on ``run_device`` (default ``device``), the
    choice is made for ``run_device``."""
    return load_model(
        VideoVAE,
        VideoVAEConfig,
        cfg,
        path,
        layouts,
        what="MiniMax H3 video VAE",
        device=device,
        dtype=dtype,
        keep_fp32=keeps_fp32,
        run_device=run_device,
    )


def layouts(cfg: VideoVAEConfig) -> tuple[KeyMap, ...]:
    """Every checkpoint layout a video VAE file may have."""
    return (comfy_layout(), diffusers_layout(cfg))
