"""Decode nodes: the video latents to IMAGE frames by trained-size tiles, the audio latents to the host's AUDIO
(stereo, 32 kHz). Each has the host load its VAE, with room for the decode's working memory."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..h3_core.media.tiling import (
    TRAINED_OVERLAP_PX,
    TRAINED_TILE_PX,
    UNTRAINED_TILES_NOTE,
    DecodeHooks,
    Tiling,
    decode_video,
)
from ..h3_core.memory.decode import decode_working_bytes
from ..h3_core.pipeline.conditioning import AUDIO_SAMPLE_RATE
from ..h3_core.pipeline.soundtrack import decode_soundtrack
from . import _host
from .attention import DEFAULT
from .io_types import H3Attention, H3AudioVAE, H3VideoVAE
from .latents import from_latent


class H3VideoDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3VideoDecode",
            display_name="H3 Video Decode (tiled)",
            category=_host.CATEGORY,
            description="Decodes the video latents as the decoder was trained: 256 px tiles with tile-local positions, "
            "blended over every tile that covers a pixel, 17-frame temporal windows with the released "
            "cross-fade; memory does not grow with the clip's length. Progress per tile.",
            inputs=[
                H3VideoVAE.Input("video_vae"),
                io.Latent.Input("latent"),
                *tile_inputs(),
                H3Attention.Input("attention", optional=True),
            ],
            outputs=[io.Image.Output(display_name="images")],
        )

    @classmethod
    def execute(cls, video_vae, latent, tile_size, overlap, tiles_per_batch, attention=None):
        vae, video, options = prepare_video_decode(video_vae, latent, tile_size, overlap, tiles_per_batch, attention)
        return io.NodeOutput(
            decode_here_or_on_ranks(video_vae, video, options, lambda o: decode_video(vae, video, **o))
        )


def decode_here_or_on_ranks(video_vae, latents, options, decode):
    """``decode(options)``, or with its tile batches shared among the ranks H3 Multi-GPU chose for ``video_vae``."""
    from .ranks import RANKS_KEY, decode_on_ranks

    choice = video_vae.attachments.get(RANKS_KEY)
    if choice is None:
        return decode(options)
    return decode_on_ranks(video_vae, choice, latents, options, decode)


def tile_inputs() -> list:
    """The tiled decode's inputs, shared by every node that decodes the video."""
    return [
        io.Int.Input(
            "tile_size",
            default=TRAINED_TILE_PX,
            min=64,
            max=2048,
            step=16,
            tooltip=f"pixels; 256 is the trained size. {UNTRAINED_TILES_NOTE}",
        ),
        io.Int.Input(
            "overlap",
            default=TRAINED_OVERLAP_PX,
            min=16,
            max=1024,
            step=16,
            tooltip=f"minimum overlap in pixels; 64 is the trained setting. {UNTRAINED_TILES_NOTE}",
        ),
        io.Int.Input(
            "tiles_per_batch",
            default=4,
            min=1,
            max=64,
            tooltip="tiles decoded together; fewer use less memory (an out-of-memory retries with fewer by itself)",
        ),
    ]


def prepare_video_decode(video_vae, latent, tile_size, overlap, tiles_per_batch, attention):
    """The host loads the video VAE with room for the decode's working memory; returns the VAE, the video latents
    on its device and ``decode_video``'s options (the user's settings, progress per tile, cancel)."""
    from .patchers import load_vae

    settings = attention or DEFAULT
    video, _, _ = from_latent(latent)
    tiling = Tiling(tile_px=tile_size, overlap_px=overlap, tiles_per_batch=tiles_per_batch)
    cfg = video_vae.model.cfg
    blocks = video_vae.model.decoder.transformer_blocks
    working = decode_working_bytes(
        cfg,
        video.shape[-1] * cfg.spatial_ratio,
        tile_px=tiling.tile_px,
        tiles_per_batch=tiling.tiles_per_batch,
        dtype=blocks[0].ff.w1.weight.dtype if len(blocks) else video.dtype,
    )
    vae = load_vae(video_vae, working)
    options = dict(
        overrides=settings.overrides,
        compile=settings.compile,
        tiling=tiling,
        hooks=DecodeHooks(progress=_host.Progress(), check_cancel=_host.check_cancel, report=_host.say),
    )
    return vae, video.to(video_vae.load_device), options


def decode_audio(audio_vae, latent):
    """The host loads the audio VAE; returns the soundtrack ``[2, samples]`` and its rate."""
    from .patchers import load_vae

    _, audio, frames = from_latent(latent)
    return decode_soundtrack(
        load_vae(audio_vae), audio, frames=frames, check_cancel=_host.check_cancel
    ), AUDIO_SAMPLE_RATE


class H3AudioDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3AudioDecode",
            display_name="H3 Audio Decode",
            category=_host.CATEGORY,
            description="Decodes the stereo audio latents (fp32, 32 kHz), cut to the video's duration.",
            inputs=[H3AudioVAE.Input("audio_vae"), io.Latent.Input("latent")],
            outputs=[io.Audio.Output(display_name="audio")],
        )

    @classmethod
    def execute(cls, audio_vae, latent):
        waveform, rate = decode_audio(audio_vae, latent)
        return io.NodeOutput({"waveform": waveform[None], "sample_rate": rate})
