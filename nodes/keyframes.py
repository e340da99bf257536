"""Keyframes anywhere: the node that anchors an image, a short clip and/or audio at a frame of the clip, chained
in the order they are packed (placed as ComfyUI's native guides: ``h3_core.pipeline.keyframes``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from comfy_api.v0_0_2 import io

from ..h3_core.errors import H3InputError
from ..h3_core.pipeline.conditioning import encode_keyframe
from . import _host
from .checks import check_linked_types, linked, verdict
from .images import single_waveform
from .io_types import H3Keyframes

FRAME_INDEX_RANGE = (-9999, 9999)


@dataclass(frozen=True)
class RawKeyframe:
    frame_idx: int  # as given: from 0 at the start, negative from the end
    pixels: torch.Tensor | None = None  # [F, H, W, 3] floats in [0, 1]
    waveform: torch.Tensor | None = None  # [channels, samples]
    sample_rate: int | None = None


def check_sources(input_types) -> None:
    """A keyframe anchors images, audio or both (known at validation)."""
    if isinstance(input_types, dict) and not (linked(input_types, "images") or linked(input_types, "audio")):
        raise H3InputError(
            "images / audio: a keyframe anchors an image, a clip or audio; connect images, audio or both"
        )


def encoded(keyframes, frames: int, width: int, height: int, video_vae, audio_vae, check_cancel, overrides=None):
    """``Keyframe``s for ``ClipRequest(keyframes=...)``, each named by its place in the chain in errors."""
    out = []
    for i, raw in enumerate(keyframes, start=1):
        if raw.pixels is not None and video_vae is None:
            raise H3InputError(
                f"video_vae: keyframe {i} (frame_idx {raw.frame_idx}) has images; connect an H3 Video VAE Loader"
            )
        if raw.waveform is not None and audio_vae is None:
            raise H3InputError(
                f"audio_vae: keyframe {i} (frame_idx {raw.frame_idx}) has audio; connect an H3 Audio VAE Loader"
            )
        try:
            out.append(
                encode_keyframe(
                    raw.frame_idx,
                    frames,
                    width,
                    height,
                    images=raw.pixels,
                    waveform=raw.waveform,
                    sample_rate=raw.sample_rate,
                    vae=video_vae,
                    audio_vae=audio_vae,
                    audio_overrides=overrides,
                    check_cancel=check_cancel,
                )
            )
        except H3InputError as exc:
            raise H3InputError(f"keyframe {i} of {len(keyframes)}: {exc}") from exc
    return out


def placed_lines(keyframes) -> list[str]:
    """What each encoded keyframe became, for the log and the sampler's progress text."""
    lines = []
    for i, keyframe in enumerate(keyframes, start=1):
        parts = []
        if keyframe.video is not None:
            frames = int(keyframe.video.shape[1])
            parts.append("an image" if frames == 1 else f"a clip of {frames} latent frames")
        if keyframe.audio is not None:
            parts.append(f"{int(keyframe.audio.shape[-1])} audio latents")
        lines.append(f"keyframe {i}: {' and '.join(parts)} at frame {keyframe.frame_index}")
    return lines


class H3AddKeyframe(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3AddKeyframe",
            display_name="H3 Add Keyframe",
            category=_host.CATEGORY,
            description="Anchors an image, a short clip (its frames as an IMAGE batch, cut to 5, 22, 39, ... = "
            "17k + 5 frames; fewer than 5 use the first image) and/or audio at a frame of the clip, after the "
            "keyframes connected. frame_idx counts pixel frames at 24 fps from 0, or from the end when negative "
            "(-1 is the last frame); the clip must fit before the end, and audio is cut to what the clip has left "
            "after that frame. Placed as ComfyUI's own H3 guides are. For the sampler's FL2VA mode.",
            inputs=[
                io.Int.Input(
                    "frame_idx",
                    default=0,
                    min=FRAME_INDEX_RANGE[0],
                    max=FRAME_INDEX_RANGE[1],
                    tooltip="the pixel frame the image (or the clip's first frame, or the audio) starts at; "
                    "negative counts from the end",
                ),
                io.Image.Input("images", optional=True, tooltip="an image, or a clip's frames"),
                io.Audio.Input("audio", optional=True, tooltip="audio starting at the same frame"),
                H3Keyframes.Input("keyframes", optional=True, tooltip="keyframes added before this one"),
            ],
            outputs=[H3Keyframes.Output(display_name="keyframes")],
        )

    @classmethod
    def validate_inputs(cls, input_types=None):
        return verdict(lambda: check_linked_types(cls, input_types), lambda: check_sources(input_types))

    @classmethod
    def execute(cls, frame_idx, images=None, audio=None, keyframes=None):
        check_sources({name: None for name, value in (("images", images), ("audio", audio)) if value is not None})
        pixels = None
        if images is not None:
            if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[0] == 0:
                raise H3InputError("images: expected an IMAGE batch [images, height, width, channels]")
            if images.shape[-1] < 3:
                raise H3InputError(f"images: needs RGB (3 channels), got {images.shape[-1]}")
            pixels = images[..., :3]
        waveform, rate = single_waveform(audio, "audio") if audio is not None else (None, None)
        raw = RawKeyframe(int(frame_idx), pixels, waveform, rate)
        return io.NodeOutput(list(keyframes or []) + [raw])
