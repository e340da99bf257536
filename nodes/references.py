"""Ref2VA references: the node that collects them (images, videos with their soundtrack, audio) in the order
the prompt names them, and the audio-file loader. The references are normalised to H3's rates and sizes
where they are used (``h3_core.pipeline.conditioning``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from comfy_api.v0_0_2 import io

from ..h3_core.errors import H3InputError
from ..h3_core.media.mp4 import read_audio
from ..h3_core.pipeline.conditioning import (
    encode_reference,
    normalize_audio_reference,
    normalize_image_reference,
    normalize_video_reference,
)
from ..h3_core.pipeline.presentation import PresentedReference
from . import _host
from .checks import check_choice, check_linked_types, linked, verdict
from .images import single_image, single_waveform
from .io_types import H3References

KINDS = ("image", "video", "audio")
AUDIO_EXTENSIONS = (".wav", ".flac", ".mp3", ".ogg", ".m4a", ".aac", ".opus", ".mp4", ".mov", ".mkv", ".webm")


@dataclass(frozen=True)
class RawReference:
    kind: str
    pixels: torch.Tensor | None = None  # image [H, W, 3] or video frames [F, H, W, 3], floats in [0, 1]
    fps: float = 24.0
    waveform: torch.Tensor | None = None  # [channels, samples]
    sample_rate: int | None = None


def normalized(references, frames: int):
    """Each reference on H3's rates and sizes for a clip of ``frames`` frames (``NormalizedReference``)."""
    out = []
    for ref in references:
        if ref.kind == "image":
            out.append(normalize_image_reference(ref.pixels))
        elif ref.kind == "video":
            out.append(
                normalize_video_reference(
                    ref.pixels, ref.fps, frames=frames, audio=ref.waveform, sample_rate=ref.sample_rate
                )
            )
        else:
            out.append(normalize_audio_reference(ref.waveform, ref.sample_rate, frames=frames))
    return out


def presented(references, frames: int) -> tuple[PresentedReference, ...]:
    """What the text encoder is shown of each reference."""
    return tuple(PresentedReference(n.kind, n.pixels, n.has_audio) for n in normalized(references, frames))


def encoded(references, frames: int, video_vae, audio_vae, check_cancel, overrides=None):
    """``ReferenceLatents`` of each reference for ``generate_ref2va``; ``overrides`` are the VAE attention
    choices (the audio VAE's encoder attention is the one that runs here)."""
    return [
        encode_reference(n, video_vae, audio_vae, audio_overrides=overrides, check_cancel=check_cancel)
        for n in normalized(references, frames)
    ]


def check_kind(kind, input_types) -> None:
    """What each kind of reference needs connected (known at validation)."""
    check_choice("kind", kind, KINDS)
    images, audio = linked(input_types, "images"), linked(input_types, "audio")
    if kind == "image" and audio:
        raise H3InputError("kind image: takes no audio; add the audio as its own reference (kind audio)")
    if kind == "audio" and images:
        raise H3InputError("kind audio: takes no images; add a video reference for pictures with sound")


class H3AddReference(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3AddReference",
            display_name="H3 Add Reference (Ref2VA)",
            category=_host.CATEGORY,
            description="Adds one Ref2VA reference after the ones connected: an image (one IMAGE), a video (its "
            "frames as an IMAGE batch with their fps, and optionally its soundtrack as AUDIO) or audio. "
            "The prompt names them <Picture i>, <Video k> and <Audio j>, counted per kind in this order.",
            inputs=[
                io.Combo.Input("kind", options=list(KINDS), default="image"),
                io.Float.Input(
                    "fps",
                    default=24.0,
                    min=1.0,
                    max=240.0,
                    step=0.001,
                    tooltip="the video's frame rate (video references)",
                ),
                io.Image.Input("images", optional=True, tooltip="the image, or the video's frames"),
                io.Audio.Input("audio", optional=True, tooltip="the audio reference, or the video's soundtrack"),
                H3References.Input("references", optional=True, tooltip="references added before this one"),
            ],
            outputs=[H3References.Output(display_name="references")],
        )

    @classmethod
    def validate_inputs(cls, kind=None, input_types=None):
        return verdict(lambda: check_linked_types(cls, input_types), lambda: check_kind(kind, input_types))

    @classmethod
    def execute(cls, kind, fps, images=None, audio=None, references=None):
        check_kind(kind, {name: None for name, value in (("images", images), ("audio", audio)) if value is not None})
        waveform, rate = single_waveform(audio, "audio") if audio is not None else (None, None)
        if kind == "image":
            if images is None:
                raise H3InputError("kind image: needs the images input (one image)")
            ref = RawReference("image", single_image(images, "images"))
        elif kind == "video":
            if images is None or images.dim() != 4:
                raise H3InputError("kind video: needs its frames on the images input (an IMAGE batch)")
            ref = RawReference("video", images[..., :3], float(fps), waveform, rate)
        else:
            if waveform is None:
                raise H3InputError("kind audio: needs the audio input")
            ref = RawReference("audio", waveform=waveform, sample_rate=rate)
        return io.NodeOutput(list(references or []) + [ref])


def _audio_files() -> list[str]:
    import folder_paths

    folder = folder_paths.get_input_directory()
    return sorted(f for f in folder_paths.recursive_search(folder)[0] if f.lower().endswith(AUDIO_EXTENSIONS))


def check_audio_file(audio_file) -> None:
    import folder_paths

    if audio_file is not None and not folder_paths.exists_annotated_filepath(audio_file):
        raise H3InputError(f"audio_file: {audio_file!r} is not in the input folder; pick one from the list")


class H3LoadAudio(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3LoadAudio",
            display_name="H3 Load Audio",
            category=_host.CATEGORY,
            description="Loads every sample of an audio (or video) file's first audio stream from the input folder, "
            "with PyAV.",
            inputs=[io.Combo.Input("audio_file", options=_audio_files())],
            outputs=[io.Audio.Output(display_name="audio")],
        )

    @classmethod
    def validate_inputs(cls, audio_file=None):
        return verdict(lambda: check_audio_file(audio_file))

    @classmethod
    def fingerprint_inputs(cls, audio_file):
        import folder_paths

        path = folder_paths.get_annotated_filepath(audio_file)
        return _host.path_version(path)

    @classmethod
    def execute(cls, audio_file):
        import folder_paths

        check_audio_file(audio_file)
        waveform, rate = read_audio(folder_paths.get_annotated_filepath(audio_file))
        return io.NodeOutput({"waveform": waveform[None], "sample_rate": rate})
