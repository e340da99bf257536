"""Decode nodes: the video latents to IMAGE frames by trained-size tiles, the audio latents to the host's
AUDIO (stereo, 32 kHz)."""

from __future__ import annotations

from h3_core.pipeline.media import AUDIO_SAMPLE_RATE
from h3_core.pipeline.soundtrack import decode_soundtrack
from h3_core.tiling import TRAINED_OVERLAP_PX, TRAINED_TILE_PX, UNTRAINED_TILES_NOTE, decode_video

from . import _host
from .attention import DEFAULT
from .latents import from_latent
from .residency import ready


class H3VideoDecode:
    CATEGORY = _host.CATEGORY
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("images",)
    FUNCTION = "decode"
    DESCRIPTION = ("Decodes the video latents as the decoder was trained: 256 px tiles with tile-local positions, "
                   "blended over every tile that covers a pixel, 17-frame temporal windows with the released "
                   "cross-fade; memory does not grow with the clip's length. Progress per tile.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "video_vae": ("H3_VIDEO_VAE",),
            "latent": ("LATENT",),
            "tile_size": ("INT", {"default": TRAINED_TILE_PX, "min": 64, "max": 2048, "step": 16,
                                  "tooltip": f"pixels; 256 is the trained size. {UNTRAINED_TILES_NOTE}"}),
            "overlap": ("INT", {"default": TRAINED_OVERLAP_PX, "min": 16, "max": 1024, "step": 16,
                                "tooltip": f"minimum overlap in pixels; 64 is the trained setting. {UNTRAINED_TILES_NOTE}"}),
            "tiles_per_batch": ("INT", {"default": 4, "min": 1, "max": 64, "tooltip": "tiles decoded together; "
                                "fewer use less memory (an out-of-memory retries with fewer by itself)"}),
        }, "optional": {"attention": ("H3_ATTENTION",)}}

    def decode(self, video_vae, latent, tile_size, overlap, tiles_per_batch, attention=None):
        settings = attention or DEFAULT
        video, _, _ = from_latent(latent)
        video_vae = ready(video_vae, "video VAE")
        device = next(video_vae.parameters()).device
        frames = decode_video(video_vae, video.to(device), overrides=settings.overrides, tile_px=tile_size,
                              overlap_px=overlap, tiles_per_batch=tiles_per_batch, progress=_host.Progress(),
                              check_cancel=_host.check_cancel, report=_host.say)
        return (frames,)


class H3AudioDecode:
    CATEGORY = _host.CATEGORY
    RETURN_TYPES = ("AUDIO",)
    RETURN_NAMES = ("audio",)
    FUNCTION = "decode"
    DESCRIPTION = "Decodes the stereo audio latents (fp32, 32 kHz), cut to the video's duration."

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"audio_vae": ("H3_AUDIO_VAE",), "latent": ("LATENT",)}}

    def decode(self, audio_vae, latent):
        _, audio, frames = from_latent(latent)
        audio_vae = ready(audio_vae, "audio VAE")
        waveform = decode_soundtrack(audio_vae, audio, frames=frames, check_cancel=_host.check_cancel)
        return ({"waveform": waveform[None], "sample_rate": AUDIO_SAMPLE_RATE},)
