"""Decode & Save: the video and audio latents straight into an mp4, the encoder taking each decoder window's
finished frames while the next window decodes (``h3_core.pipeline.decode_to_mp4``), so writing the file costs
only its tail. The frames also come out as IMAGE for graphs that go on with them."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..h3_core.media.mp4 import (
    DEFAULT_PRESET,
    ENCODERS,
    HARDWARE_ENCODERS,
    PRESETS,
    PROBE_SIZE,
    Mp4Writer,
    video_encoder,
)
from ..h3_core.pipeline.decode_to_mp4 import decode_to_mp4
from ..h3_core.pipeline.geometry import FPS
from . import _host
from .checks import verdict
from .decode import decode_audio, decode_here_or_on_ranks, prepare_video_decode, tile_inputs
from .io_types import H3Attention, H3AudioVAE, H3VideoVAE
from .save import disk_errors, output_target, saved, workflow_tags


class H3DecodeAndSave(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3DecodeAndSave",
            display_name="H3 Decode & Save (mp4)",
            category=_host.CATEGORY,
            description="Decodes the video latents (trained-size tiles and windows, as H3 Video Decode) and the "
            "soundtrack and writes them as one mp4 (H.264 yuv420p + AAC) with the workflow in its "
            "metadata, encoding each window's frames while the next one decodes. The file appears under "
            "its name only when complete. The frames also come out as images.",
            inputs=[
                H3VideoVAE.Input("video_vae"),
                io.Latent.Input("latent"),
                io.String.Input("filename_prefix", default="H3/clip"),
                io.Int.Input("fps", default=FPS, min=1, max=120),
                io.Combo.Input(
                    "encoder",
                    options=list(ENCODERS),
                    default="auto",
                    tooltip="auto: a hardware H.264 encoder (NVENC) where one opens on this machine, else "
                    "libx264; NVENC's quality against libx264's is not measured",
                ),
                io.Combo.Input(
                    "encoder_preset",
                    options=list(PRESETS),
                    default=DEFAULT_PRESET,
                    tooltip="libx264's speed/size trade at the same quality setting (crf 18)",
                ),
                *tile_inputs(),
                H3AudioVAE.Input(
                    "audio_vae", optional=True, tooltip="the soundtrack's VAE; without it the clip is silent"
                ),
                H3Attention.Input("attention", optional=True),
            ],
            outputs=[io.Image.Output(display_name="images")],
            is_output_node=True,
            hidden=[io.Hidden.prompt, io.Hidden.extra_pnginfo, io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, encoder):
        # a hardware encoder named outright must open here (tried at a small size: the clip's is known only later);
        # "auto" is decided when the clip is written
        return verdict(lambda: encoder in HARDWARE_ENCODERS and video_encoder(*PROBE_SIZE, choice=encoder))

    @classmethod
    def execute(
        cls,
        video_vae,
        latent,
        filename_prefix,
        fps,
        encoder,
        encoder_preset,
        tile_size,
        overlap,
        tiles_per_batch,
        audio_vae=None,
        attention=None,
    ):
        waveform, rate = decode_audio(audio_vae, latent) if audio_vae is not None else (None, 32000)
        _host.tell(cls.hidden.unique_id, ["soundtrack decoded" if audio_vae is not None else "no soundtrack"])
        vae, latents, options = prepare_video_decode(video_vae, latent, tile_size, overlap, tiles_per_batch, attention)
        _host.tell(cls.hidden.unique_id, [f"video VAE ready on {latents.device}"])
        ratio = vae.cfg.spatial_ratio
        width, height = latents.shape[-1] * ratio, latents.shape[-2] * ratio
        target, subfolder = output_target(filename_prefix, width, height)
        with disk_errors(target):
            writer = Mp4Writer(
                target,
                width,
                height,
                fps=fps,
                preset=encoder_preset,
                waveform=waveform,
                sample_rate=rate,
                metadata=workflow_tags(cls.hidden.prompt, cls.hidden.extra_pnginfo),
                encoder=encoder,
            )
            clip = decode_here_or_on_ranks(
                video_vae,
                latents,
                options,
                lambda o: decode_to_mp4(vae, latents, writer, tail_cancel=_host.check_cancel, **o),
            )
        _host.say(
            f"the mp4 was complete {clip.tail_s:.2f} s after the decode ended ({clip.frames_behind} frames "
            f"were still to encode then)"
        )
        return saved(target, subfolder, clip.frames)
