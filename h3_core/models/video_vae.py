"""The H3 video VAE: a causal 3-D CNN encoder (16× spatial, 4× temporal, 24 latent channels) and a
non-causal ViT3D decoder that turns every latent voxel into a 4×16×16 pixel block.

Pixels are ImageNet-normalised RGB (``(x - mean) / std`` on [0, 1]); latents in model space are
``(z - latents_mean) / latents_std``. Shapes: pixels ``[B, 3, F, H, W]``, latents ``[B, 24, T, h, w]``.
The encoder sees 17-frame clips (see ``h3_core.media.tiling`` for the clip and tile plans); the decoder sees
one tile of one temporal window at a time, with positions local to that tile, as it was trained.

Precision follows the released recipe: weights may be fp16 or bf16, but the decoder's norms, the
residual stream, the RoPE angles and the first and last projections run in fp32.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention.vae import vae_attention
from ..triton_forms import CompiledForm, guarded, runs_here, triton_form
from .latent_stats import LatentStats

__all__ = [
    "EAGER_BLOCKS",
    "compiled_decoder_blocks",
    "triton_decoder_blocks",
    "VideoVAEConfig",
    "VideoVAE",
    "keeps_fp32",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "LATENTS_MEAN",
    "LATENTS_STD",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Per-channel statistics of the released latents (vae/config.json).
LATENTS_MEAN = (
    0.858090,
    -0.960659,
    1.066164,
    -0.509033,
    -0.272758,
    -1.367541,
    -0.255325,
    -0.269076,
    -0.537684,
    -0.046410,
    0.665737,
    0.196901,
    -0.546061,
    -0.403534,
    -0.236830,
    0.259285,
    -0.301339,
    0.211342,
    -1.120685,
    0.358193,
    -0.042251,
    0.260483,
    0.228641,
    0.705603,
)
LATENTS_STD = (
    1.222377,
    1.276726,
    1.683177,
    1.754946,
    1.563622,
    2.194144,
    0.965314,
    1.056989,
    0.841949,
    0.772995,
    1.895594,
    0.946842,
    0.799681,
    0.449889,
    0.719740,
    0.693629,
    2.961095,
    2.769420,
    3.049618,
    2.108805,
    3.276226,
    3.162736,
    2.281681,
    2.612784,
)


@dataclass(frozen=True)
class VideoVAEConfig:
    """Sizes of the video VAE; the defaults are the released model."""

    latent_channels: int = 24
    block_out_channels: tuple[int, ...] = (128, 256, 256, 512, 512, 1024)
    layers_per_block: int = 2
    spatial_factors: tuple[int, ...] = (2, 2, 2, 2, 1, 1)
    temporal_factors: tuple[int, ...] = (1, 2, 2, 1, 1, 1)
    norm_groups: int = 32
    norm_eps: float = 1e-6
    decoder_layers: int = 36
    decoder_heads: int = 32
    decoder_head_dim: int = 64
    register_tokens: int = 4
    ffn_mult: int = 4
    rope_theta: float = 100.0
    rope_ratio: float = 0.75
    decoder_eps: float = 1e-5
    clip_length: int = 17
    token_drop: int = 3
    latents_mean: tuple[float, ...] = LATENTS_MEAN
    latents_std: tuple[float, ...] = LATENTS_STD

    def __post_init__(self):
        if not (len(self.latents_mean) == len(self.latents_std) == self.latent_channels):
            raise ValueError(f"latents_mean and latents_std need {self.latent_channels} entries")
        if not (len(self.block_out_channels) == len(self.spatial_factors) == len(self.temporal_factors)):
            raise ValueError("block_out_channels, spatial_factors and temporal_factors need one entry per level")
        if self.rope_dim % 6:
            raise ValueError(f"rope dims ({self.rope_dim}) must split into 3 axes of sin/cos pairs")

    @property
    def spatial_ratio(self) -> int:
        return math.prod(self.spatial_factors)

    @property
    def temporal_ratio(self) -> int:
        return math.prod(self.temporal_factors)

    @property
    def decoder_dim(self) -> int:
        return self.decoder_heads * self.decoder_head_dim

    @property
    def rope_dim(self) -> int:
        return int(self.decoder_head_dim * self.rope_ratio)


# ---- encoder -----------------------------------------------------------------------------------


class CausalConv3d(nn.Conv3d):
    """Conv3d with symmetric reflect padding in space and ``temporal_padding`` zero frames in front."""

    def __init__(self, cin, cout, kernel_size, stride=1, spatial_padding=0, temporal_padding=0):
        super().__init__(cin, cout, kernel_size, stride=stride, padding=0)
        self.spatial_padding, self.temporal_padding = spatial_padding, temporal_padding

    def forward(self, x):
        if self.spatial_padding:
            p = self.spatial_padding
            x = F.pad(x, (p, p, p, p, 0, 0), mode="reflect")
        if self.temporal_padding:
            x = F.pad(x, (0, 0, 0, 0, self.temporal_padding, 0))
        return super().forward(x)


class FrameGroupNorm(nn.GroupNorm):
    """GroupNorm over each frame on its own: statistics never mix frames."""

    def forward(self, x):
        B, C, T = x.shape[:3]
        frames = x.transpose(1, 2).reshape(B * T, C, *x.shape[3:])
        return super().forward(frames).reshape(B, T, C, *x.shape[3:]).transpose(1, 2)


def _conv3(cin, cout):
    return CausalConv3d(cin, cout, 3, spatial_padding=1, temporal_padding=2)


class ResBlock3d(nn.Module):
    def __init__(self, cin, cout, groups, eps):
        super().__init__()
        self.norm1 = FrameGroupNorm(groups, cin, eps=eps)
        self.conv1 = _conv3(cin, cout)
        self.norm2 = FrameGroupNorm(groups, cout, eps=eps)
        self.conv2 = _conv3(cout, cout)
        self.nin_shortcut = CausalConv3d(cin, cout, 1) if cin != cout else None

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class Downsample3d(nn.Module):
    """Strided 3³ conv; a spatial stride of 2 pads one reflected row and column at the bottom/right."""

    def __init__(self, channels, temporal_stride, spatial_stride):
        super().__init__()
        self.spatial_stride = spatial_stride
        self.conv = CausalConv3d(
            channels, channels, 3, stride=(temporal_stride, spatial_stride, spatial_stride), temporal_padding=2
        )

    def forward(self, x):
        if self.spatial_stride == 2:
            x = F.pad(x, (0, 1, 0, 1, 0, 0), mode="reflect")
        return self.conv(x)


class DownBlock3d(nn.Module):
    def __init__(self, cin, cout, layers, temporal, spatial, groups, eps):
        super().__init__()
        self.block = nn.ModuleList(ResBlock3d(cin if i == 0 else cout, cout, groups, eps) for i in range(layers))
        self.downsample = Downsample3d(cout, temporal, spatial) if temporal * spatial > 1 else None

    def forward(self, x):
        for block in self.block:
            x = block(x)
        return x if self.downsample is None else self.downsample(x)


class Encoder3d(nn.Module):
    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        ch = cfg.block_out_channels
        self.conv_in = _conv3(3, ch[0])
        ins = (ch[0],) + tuple(ch[:-1])
        self.down = nn.ModuleList(
            DownBlock3d(
                ins[i],
                ch[i],
                cfg.layers_per_block,
                cfg.temporal_factors[i],
                cfg.spatial_factors[i],
                cfg.norm_groups,
                cfg.norm_eps,
            )
            for i in range(len(ch))
        )
        self.norm_out = FrameGroupNorm(cfg.norm_groups, ch[-1], eps=cfg.norm_eps)
        self.conv_out = _conv3(ch[-1], 2 * cfg.latent_channels)

    def forward(self, x):
        x = self.conv_in(x)
        for level in self.down:
            x = level(x)
        return self.conv_out(F.silu(self.norm_out(x)))


# ---- decoder -----------------------------------------------------------------------------------


def rope_angles(frames: int, height: int, width: int, suffix: int, cfg: VideoVAEConfig, device) -> torch.Tensor:
    """fp32 RoPE angles ``[tokens, rope_dim / 2]`` for a ``frames × height × width`` tile followed by
    ``suffix`` tokens at position 0. Positions are tile-local, ``(i + 0.5) / n · 2 − 1`` per axis; each axis
    gets ``rope_dim / 6`` frequencies ``theta^(-j / (rope_dim / 6))``, angles scaled by 2π."""
    per_axis = cfg.rope_dim // 6
    inv_freq = cfg.rope_theta ** -(torch.arange(per_axis, dtype=torch.float32, device=device) / per_axis)
    axes = [(torch.arange(n, dtype=torch.float32, device=device) + 0.5) / n * 2 - 1 for n in (frames, height, width)]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
    grid = torch.cat([grid, grid.new_zeros(suffix, 3)])
    return (2 * math.pi * grid[:, :, None] * inv_freq).reshape(grid.shape[0], 3 * per_axis)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first ``2 · cos.shape[-1]`` channels of ``x`` ``[..., T, D]``."""
    half = cos.shape[-1]
    first, second, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([first * cos - second * sin, second * cos + first * sin, rest], dim=-1)


def block_attention_inputs(x, norm1_w, qkv_w, qkv_b, cos, sin, heads: int, head_dim: int, eps: float):
    """The first half of a decoder block up to attention: RMSNorm of the fp32 stream, the fused qkv (laid
    out per head as [q, k, v]), non-affine RMSNorm of q and k in fp32 as released, and RoPE.
    Returns head-major q, k, v ``[B, H, T, D]`` in the weights' dtype."""
    B, T, _ = x.shape
    h = F.rms_norm(x, (x.shape[-1],), norm1_w, eps).to(qkv_w.dtype)
    q, k, v = F.linear(h, qkv_w, qkv_b).view(B, T, heads, 3, head_dim).permute(3, 0, 2, 1, 4).unbind(0)
    q = apply_rope(F.rms_norm(q.float(), (head_dim,), eps=eps).to(v.dtype), cos, sin)
    k = apply_rope(F.rms_norm(k.float(), (head_dim,), eps=eps).to(v.dtype), cos, sin)
    return q, k, v


def block_finish(x, attn, out_w, out_b, scale1, norm2_w, w1_w, w1_b, w2_w, w2_b, scale2, eps: float):
    """The rest of a decoder block: output projection and LayerScale into the fp32 stream, then the gated
    FFN (``w1`` gives ``[gate | up]``) and its LayerScale."""
    B, H, T, D = attn.shape
    x = x + F.linear(attn.transpose(1, 2).reshape(B, T, H * D), out_w, out_b).float() * scale1
    h = F.rms_norm(x, (x.shape[-1],), norm2_w, eps).to(w1_w.dtype)
    gate, up = F.linear(h, w1_w, w1_b).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, w2_w, w2_b).float() * scale2


# The two halves every block runs, as written; ``compiled_decoder_blocks`` gives them compiled (one graph each,
# shared by all blocks, as the weights are arguments). Which form runs is the caller's argument, per decode.
EAGER_BLOCKS = {"attention_inputs": block_attention_inputs, "finish": block_finish}
_compiled_blocks: dict = {}  # the compiled halves, made on first use and ``guarded``


def triton_decoder_blocks(device: torch.device) -> dict | None:
    """The decoder blocks' halves with their per-element work as hand-written Triton passes (``decoder_triton``) on
    ``device``, each ``guarded``; None where Triton cannot be imported or the launch table does not run both
    there. No tracing in a new process, unlike ``compiled_decoder_blocks``."""
    try:
        from . import decoder_triton
    except ImportError:
        return None
    blocks = {name: triton_form(decoder_triton, name, device) for name in EAGER_BLOCKS}
    return None if None in blocks.values() else blocks


def compiled_decoder_blocks() -> dict:
    """The decoder blocks' halves fused by ``torch.compile`` (norms, RoPE, casts, LayerScale; attention stays on
    the kernel layer), each ``guarded``: one that fails to compile or launch raises
    ``triton_forms.CompileFailure``."""
    if not _compiled_blocks:
        _compiled_blocks.update({name: guarded(torch.compile(fn, dynamic=False)) for name, fn in EAGER_BLOCKS.items()})
    return _compiled_blocks


class DecoderAttention(nn.Module):
    """Fused qkv laid out per head as [q, k, v] and the output projection (weights only; the math is in
    ``block_attention_inputs`` / ``block_finish``)."""

    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        self.to_qkv = nn.Linear(cfg.decoder_dim, 3 * cfg.decoder_dim)
        self.to_out = nn.Linear(cfg.decoder_dim, cfg.decoder_dim)


class GatedFFN(nn.Module):
    """``w2(silu(gate) · up)`` with ``w1`` producing ``[gate | up]`` (weights only, see ``block_finish``)."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, 2 * hidden)
        self.w2 = nn.Linear(hidden, dim)


class DecoderBlock(nn.Module):
    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        dim = cfg.decoder_dim
        self.heads, self.head_dim, self.eps = cfg.decoder_heads, cfg.decoder_head_dim, cfg.decoder_eps
        self.norm1 = nn.RMSNorm(dim, eps=cfg.decoder_eps)
        self.attn = DecoderAttention(cfg)
        self.scale1 = nn.Parameter(torch.zeros(dim))
        self.norm2 = nn.RMSNorm(dim, eps=cfg.decoder_eps)
        self.ff = GatedFFN(dim, dim * cfg.ffn_mult)
        self.scale2 = nn.Parameter(torch.zeros(dim))

    def forward(self, x, cos, sin, overrides=None, blocks=EAGER_BLOCKS):
        """``x``: the fp32 residual stream ``[B, T, dim]``; ``blocks``: the halves' form (``EAGER_BLOCKS`` or
        ``compiled_decoder_blocks()``)."""
        attn, ff = self.attn, self.ff
        q, k, v = blocks["attention_inputs"](
            x, self.norm1.weight, attn.to_qkv.weight, attn.to_qkv.bias, cos, sin, self.heads, self.head_dim, self.eps
        )
        out = vae_attention(q, k, v, component="video_vae", overrides=overrides)
        return blocks["finish"](
            x,
            out,
            attn.to_out.weight,
            attn.to_out.bias,
            self.scale1,
            self.norm2.weight,
            ff.w1.weight,
            ff.w1.bias,
            ff.w2.weight,
            ff.w2.bias,
            self.scale2,
            self.eps,
        )


class ViTDecoder3d(nn.Module):
    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        self.cfg = cfg
        dim = cfg.decoder_dim
        self.x_embedder = nn.Linear(cfg.latent_channels, dim)
        self.register_tokens = nn.Parameter(torch.zeros(1, cfg.register_tokens, dim))
        self.transformer_blocks = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.decoder_layers))
        self.norm_out = nn.LayerNorm(dim, eps=cfg.decoder_eps)
        self.proj_out = nn.Linear(dim, 3 * cfg.temporal_ratio * cfg.spatial_ratio**2)

    def forward(self, z: torch.Tensor, overrides=None, blocks=EAGER_BLOCKS) -> torch.Tensor:
        """Latent tiles ``[B, C, t, h, w]`` → pixels ``[B, 3, t·4, h·16, w·16]`` (fp32); ``blocks`` as
        ``DecoderBlock.forward``."""
        cfg = self.cfg
        B, C, t, h, w = z.shape
        tokens = z.permute(0, 2, 3, 4, 1).reshape(B, t * h * w, C)
        x = F.linear(tokens.float(), self.x_embedder.weight.float(), self.x_embedder.bias.float())
        suffix = torch.cat([self.register_tokens.float().expand(B, -1, -1), x.new_zeros(B, 1, x.shape[2])], dim=1)
        x = torch.cat([x, suffix], dim=1)
        angles = rope_angles(t, h, w, suffix.shape[1], cfg, z.device)
        # RoPE is applied in the blocks' compute dtype, like the released decoder.
        dtype = self.transformer_blocks[0].ff.w1.weight.dtype if len(self.transformer_blocks) else torch.float32
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        for block in self.transformer_blocks:
            x = block(x, cos, sin, overrides, blocks)
        x = F.layer_norm(x, (x.shape[-1],), self.norm_out.weight.float(), self.norm_out.bias.float(), self.norm_out.eps)
        x = F.linear(x[:, : t * h * w], self.proj_out.weight.float(), self.proj_out.bias.float())
        r, rt = cfg.spatial_ratio, cfg.temporal_ratio
        x = x.view(B, t, h, w, 3, rt, r, r).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(B, 3, t * rt, h * r, w * r)


class VideoVAE(LatentStats, nn.Module):
    """Encoder, decoder and the 1×1×1 convs around the latent, with the released normalisations.
    Latents ``[.., 24, T, h, w]``."""

    LATENT_TRAILING_DIMS = 3

    def __init__(self, cfg: VideoVAEConfig = VideoVAEConfig()):
        super().__init__()
        self.cfg = cfg
        # the fallback of this VAE's compiled decoder blocks: a failure sends its later decodes eager
        self.compiled_form = CompiledForm("compiling the video decoder's blocks failed", "decoding eagerly")
        self.encoder = Encoder3d(cfg)
        self.quant_conv = nn.Conv3d(2 * cfg.latent_channels, 2 * cfg.latent_channels, 1)
        self.post_quant_conv = nn.Conv3d(cfg.latent_channels, cfg.latent_channels, 1)
        self.decoder = ViTDecoder3d(cfg)

    def encode_moments(self, pixels: torch.Tensor) -> torch.Tensor:
        """One clip (or a single frame) of ImageNet-normalised pixels → mean and log-variance ``[B, 48, T, h, w]``
        (log-variance clamped to [-30, 20]); the encoder runs in fp32."""
        moments = self.quant_conv(self.encoder(pixels.float()))
        mean, logvar = moments.chunk(2, dim=1)
        return torch.cat([mean, logvar.clamp(-30.0, 20.0)], dim=1)

    def offload_decoder_blocks(self) -> str:
        """Keep the decoder blocks' weights in (pinned) host memory and stream each block to the device
        just for its own forward: the lowest-memory way to decode, used when even one tile does not fit.
        Returns what it did, for the user."""
        device = self.decoder.x_embedder.weight.device
        blocks = self.decoder.transformer_blocks
        if getattr(self, "_offloaded", False) or len(blocks) == 0:
            return "decoder blocks were already streamed from host memory"
        for block in blocks:
            host = {}
            for name, param in block.named_parameters():
                copy = param.detach().to("cpu")
                host[name] = copy.pin_memory() if device.type == "cuda" else copy
                param.data = host[name]

            def fetch(module, args, host=host):
                for name, param in module.named_parameters():
                    param.data = host[name].to(device, non_blocking=True)

            def release(module, args, output, host=host):
                for name, param in module.named_parameters():
                    param.data = host[name]

            block.register_forward_pre_hook(fetch)
            block.register_forward_hook(release)
        self._offloaded = True
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return f"the decoder's {len(blocks)} blocks now stay in host memory and are streamed to {device} one at a time"

    def decode_tiles(self, z: torch.Tensor, overrides=None, compiled: bool = False) -> torch.Tensor:
        """Raw latent tiles ``[B, 24, t, h, w]`` → ImageNet-normalised pixels ``[B, 3, 4t, 16h, 16w]``; when
        ``compiled``, the blocks' per-element work as Triton passes where they run (``triton_decoder_blocks``: CUDA,
        or Triton's interpreter), else through ``torch.compile`` (``compiled_decoder_blocks``)."""
        z = F.conv3d(z.float(), self.post_quant_conv.weight.float(), self.post_quant_conv.bias.float())
        blocks = EAGER_BLOCKS
        if compiled:
            blocks = (triton_decoder_blocks(z.device) if runs_here(z) else None) or compiled_decoder_blocks()
        return self.decoder(z, overrides, blocks)


# ---- precision -------------------------------------------------------------------------------


_FP32_KEYS = re.compile(
    r"(encoder\.|quant_conv\.|post_quant_conv\.|decoder\.(x_embedder|proj_out|norm_out|register_tokens)"
    r"|decoder\.transformer_blocks\.\d+\.(norm1|norm2|scale1|scale2))"
)


def keeps_fp32(key: str) -> bool:
    """Weights the released recipe keeps in fp32 whatever the decoder's dtype."""
    return _FP32_KEYS.match(key) is not None
