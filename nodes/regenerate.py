"""Extend and inpaint: the node that turns a generated clip into what the sampler starts from, the parts to hold
and the parts to generate (``h3_core.pipeline.masks``), with the canvas of the clip to generate."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..h3_core.errors import H3InputError
from ..h3_core.pipeline.geometry import CLIP, audio_latents, latent_frames
from ..h3_core.pipeline.masks import MaskedStart, extend_start, region_mask, span_mask
from . import _host
from .canvas import Canvas, check
from .checks import check_choice, check_linked_types, verdict
from .io_types import H3Canvas, H3Start
from .latents import from_latent

MODES = ("extend", "frames", "region")
AUDIO = ("follow", "generate", "hold")


def region_of(mask, latent):
    """The region to regenerate ``[H, W]``: the mask input, else the latent's own noise mask (the host's Set Latent
    Noise Mask stores it as ``[1, 1, H, W]``)."""
    if mask is None and isinstance(latent, dict) and latent.get("noise_mask") is not None:
        mask = latent["noise_mask"].reshape(-1, *latent["noise_mask"].shape[-2:])
    if mask is None:
        raise H3InputError(
            "mode region: needs the mask input (white where the clip is regenerated) or a latent with a noise mask "
            "(Set Latent Noise Mask)"
        )
    if mask.dim() != 3 or mask.shape[0] != 1:
        raise H3InputError(f"mask: one mask [1, height, width] is needed, got {tuple(mask.shape)}")
    return mask[0]


class H3ExtendOrInpaint(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3ExtendOrInpaint",
            display_name="H3 Extend / Inpaint",
            category=_host.CATEGORY,
            description="Starts the sampler from a generated clip: extend appends extend_frames new frames after "
            "it; frames regenerates from_frame up to (not including) to_frame; region regenerates the mask's "
            "area (white; or the latent's noise mask from Set Latent Noise Mask) in those frames. What is not "
            "regenerated is held exactly, as ComfyUI's own H3 masks hold it. audio: follow (the sound under the "
            "regenerated frames), generate (all of it) or hold (none; extend always generates the new part's "
            "sound). Connect start and canvas to the sampler (and the canvas to H3 Text Encode).",
            inputs=[
                io.Latent.Input("latent", tooltip="the clip (an H3 Sampler's LATENT, or ComfyUI's own H3 AV latent)"),
                io.Combo.Input("mode", options=list(MODES), default="extend"),
                io.Int.Input(
                    "extend_frames", default=102, min=CLIP, max=3570, step=CLIP, tooltip="extend: frames to add"
                ),
                io.Int.Input("from_frame", default=0, min=0, max=9999, tooltip="frames / region: the first frame"),
                io.Int.Input("to_frame", default=24, min=1, max=9999, tooltip="frames / region: the frame after"),
                io.Combo.Input("audio", options=list(AUDIO), default="follow"),
                io.Mask.Input(
                    "mask",
                    optional=True,
                    tooltip="region: white where the clip is regenerated (else the latent's own noise mask)",
                ),
            ],
            outputs=[H3Start.Output(display_name="start"), H3Canvas.Output(display_name="canvas")],
        )

    @classmethod
    def validate_inputs(cls, mode=None, audio=None, input_types=None):
        return verdict(
            lambda: check_linked_types(cls, input_types),
            lambda: mode is None or check_choice("mode", mode, MODES),
            lambda: audio is None or check_choice("audio", audio, AUDIO),
        )

    @classmethod
    def execute(cls, latent, mode, extend_frames, from_frame, to_frame, audio, mask=None):
        check_choice("mode", mode, MODES)
        check_choice("audio", audio, AUDIO)
        video, sound, frames = from_latent(latent)
        _, T, h, w = video.shape
        if mode == "extend":
            if extend_frames % CLIP:
                raise H3InputError(f"extend_frames: {extend_frames} is not a multiple of {CLIP} (17, 34, ..., 102)")
            length = frames + int(extend_frames)
            check(length=length)
            start = extend_start(video, sound, latent_frames(length), audio_latents(length))
        else:
            length = frames
            video_mask, audio_mask = span_mask(T, h, w, int(sound.shape[-1]), from_frame, to_frame, audio=audio)
            if mode == "region":
                video_mask = video_mask * region_mask(region_of(mask, latent), h, w)[None]
            start = MaskedStart(video.float(), sound.float(), video_mask, audio_mask)
        return io.NodeOutput(start, Canvas(16 * w, 16 * h, int(length)))
