"""Ref2VA references: the node that collects them (images, videos with their soundtrack, audio) in the order
the prompt names them, and the audio-file loader. The references are normalised to H3's rates and sizes
where they are used (``h3_core.pipeline.media``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3_core.errors import H3InputError
from h3_core.mp4 import read_audio
from h3_core.pipeline.media import (encode_reference, normalize_audio_reference, normalize_image_reference,
                                    normalize_video_reference)
from h3_core.pipeline.presentation import PresentedReference

from . import _host
from .images import single_image, single_waveform

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
            out.append(normalize_video_reference(ref.pixels, ref.fps, frames=frames, audio=ref.waveform,
                                                 sample_rate=ref.sample_rate))
        else:
            out.append(normalize_audio_reference(ref.waveform, ref.sample_rate, frames=frames))
    return out


def presented(references, frames: int) -> tuple[PresentedReference, ...]:
    """What the text encoder is shown of each reference."""
    return tuple(PresentedReference(n.kind, n.pixels, n.has_audio) for n in normalized(references, frames))


def encoded(references, frames: int, video_vae, audio_vae, check_cancel, overrides=None):
    """``ReferenceLatents`` of each reference for ``generate_ref2va``; ``overrides`` are the VAE attention
    choices (the audio VAE's encoder attention is the one that runs here)."""
    return [encode_reference(n, video_vae, audio_vae, audio_overrides=overrides, check_cancel=check_cancel)
            for n in normalized(references, frames)]


class H3AddReference:
    CATEGORY = _host.CATEGORY
    RETURN_TYPES = ("H3_REFERENCES",)
    RETURN_NAMES = ("references",)
    FUNCTION = "add"
    DESCRIPTION = ("Adds one Ref2VA reference after the ones connected: an image (one IMAGE), a video (its frames as an "
                   "IMAGE batch with their fps, and optionally its soundtrack as AUDIO) or audio. The prompt names them "
                   "<Picture i>, <Video k> and <Audio j>, counted per kind in this order.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "kind": (list(KINDS), {"default": "image"}),
            "fps": ("FLOAT", {"default": 24.0, "min": 1.0, "max": 240.0, "step": 0.001,
                              "tooltip": "the video's frame rate (video references)"}),
        }, "optional": {
            "images": ("IMAGE", {"tooltip": "the image, or the video's frames"}),
            "audio": ("AUDIO", {"tooltip": "the audio reference, or the video's soundtrack"}),
            "references": ("H3_REFERENCES", {"tooltip": "references added before this one"}),
        }}

    def add(self, kind, fps, images=None, audio=None, references=None):
        if kind not in KINDS:
            raise H3InputError(f"kind must be one of {list(KINDS)}, got {kind!r}")
        waveform, rate = single_waveform(audio, "audio") if audio is not None else (None, None)
        if kind == "image":
            if images is None:
                raise H3InputError("an image reference needs the images input (one image)")
            if audio is not None:
                raise H3InputError("an image reference takes no audio; add the audio as its own reference")
            ref = RawReference("image", single_image(images, "images"))
        elif kind == "video":
            if images is None or images.dim() != 4:
                raise H3InputError("a video reference needs its frames on the images input (an IMAGE batch)")
            ref = RawReference("video", images[..., :3], float(fps), waveform, rate)
        else:
            if waveform is None:
                raise H3InputError("an audio reference needs the audio input")
            if images is not None:
                raise H3InputError("an audio reference takes no images; add a video reference for pictures with sound")
            ref = RawReference("audio", waveform=waveform, sample_rate=rate)
        return (list(references or []) + [ref],)


class H3LoadAudio:
    CATEGORY = _host.CATEGORY
    RETURN_TYPES = ("AUDIO",)
    RETURN_NAMES = ("audio",)
    FUNCTION = "load"
    DESCRIPTION = "Loads every sample of an audio (or video) file's first audio stream from the input folder, with PyAV."

    @classmethod
    def INPUT_TYPES(cls):
        import folder_paths

        folder = folder_paths.get_input_directory()
        files = sorted(f for f in folder_paths.recursive_search(folder)[0] if f.lower().endswith(AUDIO_EXTENSIONS))
        return {"required": {"audio_file": (files,)}}

    def load(self, audio_file):
        import folder_paths

        if not folder_paths.exists_annotated_filepath(audio_file):
            raise H3InputError(f"audio_file: {audio_file!r} is not in the input folder")
        waveform, rate = read_audio(folder_paths.get_annotated_filepath(audio_file))
        return ({"waveform": waveform[None], "sample_rate": rate},)
