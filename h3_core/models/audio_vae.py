"""The H3 audio VAE: a DAC-lineage encoder with a causal attention projection to 32 latent channels,
and a BigVGAN decoder with alias-free SnakeBeta activations. Mono 32 kHz, hop 800 (40 latents/s);
stereo is two mono items in the batch. Everything runs in fp32, as released (bf16 decodes come out
about 20 dB quieter).

Shapes: waveforms ``[B, 1, samples]`` in [-1, 1]; latents ``[B, 32, frames]``. The sampler's latents are
``(z - latents_mean) / latents_std`` per channel; H3 encodes with the posterior mean.

Weight-normalised convolutions are stored as ``weight_g`` / ``weight_v`` in the checkpoints; they are
folded into one plain weight when loaded, so no re-normalisation runs per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention.vae import vae_attention
from .latent_stats import LatentStats

__all__ = ["AudioVAEConfig", "AudioVAE", "AUDIO_LATENTS_MEAN", "AUDIO_LATENTS_STD"]

# Per-channel statistics of the released latents (audio_vae/config.json), to 4 decimals; a diffusers
# folder's config.json replaces them with the full-precision values.
AUDIO_LATENTS_MEAN = (
    -0.0202,
    0.3876,
    -0.0440,
    -0.2859,
    0.0818,
    -0.3578,
    0.0406,
    -0.0155,
    -0.2234,
    0.1821,
    0.2942,
    -0.0790,
    -0.0568,
    -0.3699,
    -0.3162,
    0.5906,
    -0.0521,
    0.0137,
    -0.0369,
    0.0973,
    -0.3395,
    -0.3069,
    -0.2450,
    -0.0347,
    0.0287,
    -0.2122,
    -0.1678,
    0.3221,
    -0.1223,
    0.4357,
    -0.0503,
    0.3979,
)
AUDIO_LATENTS_STD = (
    1.6896,
    2.7626,
    1.7945,
    1.6802,
    1.6390,
    2.7788,
    1.7659,
    1.6200,
    2.6337,
    1.8539,
    2.5056,
    1.8110,
    1.9580,
    1.6685,
    1.4922,
    3.2987,
    1.9492,
    1.8720,
    1.8334,
    1.6488,
    1.6177,
    1.9131,
    1.5695,
    1.6944,
    1.8318,
    1.5541,
    1.9345,
    1.5992,
    1.7180,
    1.6307,
    1.8661,
    1.5614,
)


@dataclass(frozen=True)
class AudioVAEConfig:
    """Sizes of the audio VAE; the defaults are the released model."""

    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (2, 4, 4, 5, 5)
    latent_dim: int = 2048
    latent_channels: int = 32
    attention_heads: int = 8
    decoder_dim: int = 1024
    decoder_rates: tuple[int, ...] = (5, 5, 2, 2, 2, 2, 2)
    decoder_kernels: tuple[int, ...] = (9, 9, 4, 4, 4, 4, 4)
    resblock_kernels: tuple[int, ...] = (3, 7, 11)
    resblock_dilations: tuple[int, ...] = (1, 3, 5)
    sample_rate: int = 32000
    latents_mean: tuple[float, ...] = AUDIO_LATENTS_MEAN
    latents_std: tuple[float, ...] = AUDIO_LATENTS_STD

    def __post_init__(self):
        if math.prod(self.encoder_rates) != math.prod(self.decoder_rates):
            raise ValueError("encoder and decoder rates must multiply to the same hop length")
        if not (len(self.latents_mean) == len(self.latents_std) == self.latent_channels):
            raise ValueError(f"latents_mean and latents_std need {self.latent_channels} entries")

    @property
    def hop(self) -> int:
        return math.prod(self.encoder_rates)


def kaiser_sinc(cutoff: float, half_width: float, size: int) -> torch.Tensor:
    """The Kaiser-windowed sinc low-pass filter ``[1, 1, size]`` of the alias-free resamplers, normalised to sum 1,
    on the CPU (built under a meta device context, torch.arange would import dynamo and sympy on first use)."""
    half = size // 2
    attenuation = 2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    cpu = torch.device("cpu")
    window = torch.kaiser_window(size, beta=beta, periodic=False, device=cpu)
    time = torch.arange(-half, half, device=cpu) + 0.5 if size % 2 == 0 else torch.arange(size, device=cpu) - half
    taps = 2 * cutoff * window * torch.sinc(2 * cutoff * time)
    return (taps / taps.sum()).view(1, 1, size)


# ---- encoder -----------------------------------------------------------------------------------


class Snake(nn.Module):
    """``x + sin²(αx) / (α + 1e-9)`` with a per-channel α ``[1, C, 1]``."""

    def __init__(self, channels):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x):
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class ResidualUnit(nn.Module):
    def __init__(self, dim, dilation):
        super().__init__()
        self.block = nn.Sequential(
            Snake(dim),
            nn.Conv1d(dim, dim, 7, dilation=dilation, padding=3 * dilation),
            Snake(dim),
            nn.Conv1d(dim, dim, 1),
        )

    def forward(self, x):
        y = self.block(x)
        crop = (x.shape[-1] - y.shape[-1]) // 2
        return (x[..., crop:-crop] if crop > 0 else x) + y


class EncoderBlock(nn.Module):
    """Residual units at dilations 1, 3, 9, then a strided convolution doubling the channels."""

    def __init__(self, dim, stride):
        super().__init__()
        half = dim // 2
        self.block = nn.Sequential(
            ResidualUnit(half, 1),
            ResidualUnit(half, 3),
            ResidualUnit(half, 9),
            Snake(half),
            nn.Conv1d(half, dim, 2 * stride, stride=stride, padding=math.ceil(stride / 2)),
        )

    def forward(self, x):
        return self.block(x)


class Encoder(nn.Module):
    def __init__(self, cfg: AudioVAEConfig):
        super().__init__()
        dim = cfg.encoder_dim
        layers: list[nn.Module] = [nn.Conv1d(1, dim, 7, padding=3)]
        for stride in cfg.encoder_rates:
            dim *= 2
            layers.append(EncoderBlock(dim, stride))
        layers += [Snake(dim), nn.Conv1d(dim, cfg.latent_dim, 3, padding=1)]
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        return self.block(x)


class CausalAttention(nn.Module):
    """Causal attention that narrows ``in_dim`` to ``out_dim``: heads are averaged, not concatenated, and the
    head width is pooled down to ``out_dim``. The key bias is a fixed zero buffer."""

    def __init__(self, in_dim, out_dim, heads):
        super().__init__()
        self.heads, self.out_dim = heads, out_dim
        self.qkv = nn.Linear(in_dim, 3 * in_dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(in_dim))
        self.v_bias = nn.Parameter(torch.zeros(in_dim))
        self.register_buffer("zero_k_bias", torch.zeros(in_dim))
        self.proj = nn.Linear(out_dim, out_dim)

    def forward(self, x, overrides=None):
        B, T, C = x.shape
        qkv = F.linear(x, self.qkv.weight, torch.cat([self.q_bias, self.zero_k_bias, self.v_bias]))
        q, k, v = qkv.view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)  # [B, H, T, D] each
        out = vae_attention(q, k, v, component="audio_vae", overrides=overrides)
        return self.proj(F.adaptive_avg_pool1d(out.mean(dim=1), self.out_dim))


class GeGluMlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w0, self.w1, self.w2 = nn.Linear(dim, hidden), nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        x = self.norm(x)
        return self.w2(F.gelu(self.w0(x), approximate="tanh") * self.w1(x))


class AttnProjection(nn.Module):
    """``y = proj(LN3(x)) + attn(LN1(x)); y += mlp(LN2(y))``: ``latent_dim`` → ``latent_channels``."""

    def __init__(self, in_dim, out_dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(in_dim)
        self.attn = CausalAttention(in_dim, out_dim, heads)
        self.proj = nn.Linear(in_dim, out_dim)
        self.norm3 = nn.LayerNorm(in_dim)
        self.norm2 = nn.LayerNorm(out_dim)
        self.mlp = GeGluMlp(out_dim, 2 * out_dim)

    def forward(self, x, overrides=None):
        y = self.proj(self.norm3(x)) + self.attn(self.norm1(x), overrides)
        return y + self.mlp(self.norm2(y))


# ---- decoder -----------------------------------------------------------------------------------


class SnakeBeta(nn.Module):
    """``x + sin²(e^α x) / (e^β + 1e-9)``, α and β per channel in log space."""

    def __init__(self, channels):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x):
        alpha, beta = self.alpha.exp()[None, :, None], self.beta.exp()[None, :, None]
        return x + (beta + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


class UpSample(nn.Module):
    def __init__(self, ratio=2, size=12):
        super().__init__()
        self.ratio, self.pad = ratio, size // ratio - 1
        self.crop_left = self.pad * ratio + (size - ratio) // 2
        self.crop_right = self.pad * ratio + (size - ratio + 1) // 2
        self.register_buffer("filter", kaiser_sinc(0.5 / ratio, 0.6 / ratio, size).to(torch.get_default_device()))

    def forward(self, x):
        C = x.shape[1]
        x = F.pad(x, (self.pad, self.pad), mode="replicate")
        x = self.ratio * F.conv_transpose1d(x, self.filter.expand(C, -1, -1), stride=self.ratio, groups=C)
        return x[..., self.crop_left : -self.crop_right]


class LowPass(nn.Module):
    def __init__(self, ratio=2, size=12):
        super().__init__()
        self.stride = ratio
        self.pads = (size // 2 - int(size % 2 == 0), size // 2)
        self.register_buffer("filter", kaiser_sinc(0.5 / ratio, 0.6 / ratio, size).to(torch.get_default_device()))

    def forward(self, x):
        C = x.shape[1]
        return F.conv1d(
            F.pad(x, self.pads, mode="replicate"), self.filter.expand(C, -1, -1), stride=self.stride, groups=C
        )


class DownSample(nn.Module):
    def __init__(self, ratio=2, size=12):
        super().__init__()
        self.lowpass = LowPass(ratio, size)

    def forward(self, x):
        return self.lowpass(x)


class AliasFreeSnakeBeta(nn.Module):
    """2× upsample → SnakeBeta → 2× downsample."""

    def __init__(self, channels):
        super().__init__()
        self.act = SnakeBeta(channels)
        self.upsample, self.downsample = UpSample(), DownSample()

    def forward(self, x):
        return self.downsample(self.act(self.upsample(x)))


class AMPBlock(nn.Module):
    def __init__(self, channels, kernel, dilations):
        super().__init__()
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel, dilation=d, padding=(kernel * d - d) // 2) for d in dilations
        )
        self.convs2 = nn.ModuleList(nn.Conv1d(channels, channels, kernel, padding=(kernel - 1) // 2) for _ in dilations)
        self.activations = nn.ModuleList(AliasFreeSnakeBeta(channels) for _ in range(2 * len(dilations)))

    def forward(self, x):
        for i, (conv1, conv2) in enumerate(zip(self.convs1, self.convs2)):
            x = x + conv2(self.activations[2 * i + 1](conv1(self.activations[2 * i](x))))
        return x


class BigVGAN(nn.Module):
    def __init__(self, cfg: AudioVAEConfig):
        super().__init__()
        base = cfg.decoder_dim
        self.conv_pre = nn.Conv1d(cfg.latent_dim, base, 7, padding=3)
        self.ups = nn.ModuleList(
            nn.ModuleList([nn.ConvTranspose1d(base >> i, base >> (i + 1), k, r, padding=(k - r) // 2)])
            for i, (r, k) in enumerate(zip(cfg.decoder_rates, cfg.decoder_kernels))
        )
        self.resblocks = nn.ModuleList(
            AMPBlock(base >> (i + 1), k, cfg.resblock_dilations)
            for i in range(len(cfg.decoder_rates))
            for k in cfg.resblock_kernels
        )
        channels = base >> len(cfg.decoder_rates)
        self.activation_post = AliasFreeSnakeBeta(channels)
        self.conv_post = nn.Conv1d(channels, 1, 7, padding=3, bias=False)
        self.kernels = len(cfg.resblock_kernels)

    def forward(self, x):
        x = self.conv_pre(x)
        for i, (up,) in enumerate(self.ups):
            x = up(x)
            blocks = self.resblocks[i * self.kernels : (i + 1) * self.kernels]
            x = sum(block(x) for block in blocks) / self.kernels
        return self.conv_post(self.activation_post(x)).clamp(-1.0, 1.0)


class AudioVAE(LatentStats, nn.Module):
    """Latents ``[B, 32, frames]``."""

    def __init__(self, cfg: AudioVAEConfig = AudioVAEConfig()):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.pre_block = AttnProjection(cfg.latent_dim, cfg.latent_channels, cfg.attention_heads)
        self.mean_proj = nn.Conv1d(cfg.latent_channels, cfg.latent_channels, 1)
        self.logs_proj = nn.Conv1d(cfg.latent_channels, cfg.latent_channels, 1)
        self.dec_in_proj = nn.Conv1d(cfg.latent_channels, cfg.latent_dim, 1)
        self.decoder = BigVGAN(cfg)

    def encode_mean(self, waveform: torch.Tensor, overrides=None) -> torch.Tensor:
        """``[B, 1, samples]`` → the posterior mean ``[B, 32, ceil(samples / 800)]`` (raw, not normalised); the
        waveform is right-padded with zeros to a whole number of hops."""
        if waveform.dim() != 3 or waveform.shape[1] != 1:
            raise ValueError(f"waveform must be [batch, 1, samples], got {tuple(waveform.shape)}")
        pad = -waveform.shape[-1] % self.cfg.hop
        x = self.encoder(F.pad(waveform.float(), (0, pad)))
        x = self.pre_block(x.transpose(1, 2), overrides).transpose(1, 2)
        return self.mean_proj(x)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Raw latents ``[B, 32, frames]`` → waveform ``[B, 1, frames · 800]`` in [-1, 1]."""
        return self.decoder(self.dec_in_proj(latents.float()))
