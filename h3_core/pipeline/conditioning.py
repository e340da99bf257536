"""User media → the conditioning latents ``generate`` and ``generate_ref2va`` take, as the released pipeline
makes them (diffusers 0.42.1's MiniMax-H3 blocks are the oracle, tests/unit/test_media.py the proof).

Pixels arrive as ComfyUI IMAGE frames: ``[H, W, 3]`` (one frame) or ``[F, H, W, 3]``, floats in [0, 1] (uint8
is taken as already quantised). They are quantised first, ``round(x · 255)``, because the released model
was conditioned on 8-bit media: every resize below works on those bytes, as Pillow's LANCZOS does, bit for
bit. Waveforms arrive as ``[channels, samples]`` at their own sample rate.

Keyframes (FL2VA): the first keyframe in packed order is the geometry anchor and is *stretched* onto the
canvas; any later one (the "last" frame of a first-and-last request) is *cover-cropped* (scaled to cover,
centred crop). Both are encoded as one frame: ``[24, 1, h, w]``.

References (Ref2VA), normalised as diffusers' setup step does, then encoded as its encoder step does:

* image: its own short edge (2048 for the released checkpoint, upscaling included, no area cap), both
  sides rounded to 32; aspect 1:4 to 4:1.
* video: onto 24 fps by holding and dropping whole frames (ffmpeg's ``fps`` filter), truncated to the
  generated length, LANCZOS onto the canvas its own aspect ratio resolves to (the target's canvas rule);
  the VAE then encodes the largest ``17k + 5`` prefix (all frames when there are fewer than 22).
* audio (a reference, or a video's soundtrack): truncated at its own rate to the generated duration, mono
  repeated to stereo, resampled once to 32 kHz with torchaudio's default windowed-sinc resampler
  (reimplemented here), encoded with the audio VAE's posterior *mean*.

Visual conditions take the posterior *sampled* under the fixed seed 42, rounded to fp16, then normalised
(``h3_core.media.tiling.encode_video``).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import H3InputError
from ..media.tiling import encode_video
from .generate import ReferenceLatents
from .geometry import (
    CANVAS_MULTIPLE,
    FPS,
    MAX_ASPECT,
    MAX_PIXELS,
    MIN_ASPECT,
    SHORT_EDGE,
    audio_latents,
    canvas_size,
    check_canvas,
    snap_frames,
)
from .keyframes import Keyframe, guide_audio_latents, guide_frames, resolve_frame_index

__all__ = [
    "AUDIO_SAMPLE_RATE",
    "REFERENCE_IMAGE_SHORT_EDGE",
    "MIN_VIDEO_REFERENCE_FRAMES",
    "KEYFRAME_FITS",
    "NormalizedReference",
    "quantize_pixels",
    "lanczos_resize",
    "resample_audio",
    "keyframe_canvas",
    "fit_keyframe",
    "fit_keyframes",
    "encode_keyframes",
    "encode_keyframe",
    "normalize_image_reference",
    "normalize_video_reference",
    "normalize_audio_reference",
    "encode_reference",
]

AUDIO_SAMPLE_RATE = 32000
REFERENCE_IMAGE_SHORT_EDGE = 2048
# Qwen3-VL reads a reference video at 2 fps and merges the frames it reads in pairs: at 24 fps the second
# frame it reads is frame 12, so a shorter reference cannot be presented to it.
MIN_VIDEO_REFERENCE_FRAMES = 13
KEYFRAME_FITS = ("stretch", "cover")
# The resampling kernel has (target rate / gcd) phases of about 2 · 6 · (source rate / gcd) taps; rates
# whose ratio does not reduce would make it gigabytes.
_MAX_RESAMPLE_KERNEL = 1 << 26


# ---- pixels ------------------------------------------------------------------------------------


def quantize_pixels(
    pixels: torch.Tensor, name: str, *, frames: bool = False, select: torch.Tensor | None = None
) -> torch.Tensor:
    """``[H, W, 3]`` (or ``[F, H, W, 3]`` with ``frames``) floats in [0, 1] or uint8 → uint8 on the CPU;
    ``select`` (frame indices, repeats allowed) picks the frames to convert, after the whole input is checked.

    Floats are rounded half to even after ``· 255`` in their own dtype, as diffusers' ``numpy_to_pil`` and
    its video normalisation do, so the bytes we resize and encode are the bytes it would. Frames are
    converted a few at a time: a long video in fp32 never has a second full-size fp32 copy."""
    layout = "[frames, height, width, 3]" if frames else "[height, width, 3]"
    if not isinstance(pixels, torch.Tensor):
        raise H3InputError(f"{name} must be a tensor {layout}, got {type(pixels).__name__}")
    if pixels.dim() != (4 if frames else 3) or pixels.shape[-1] != 3:
        raise H3InputError(f"{name} must be RGB pixels {layout}, got shape {tuple(pixels.shape)}")
    if frames and pixels.shape[0] == 0:
        raise H3InputError(f"{name} has no frames (shape {tuple(pixels.shape)}); give at least one")
    if min(pixels.shape[-3:-1]) < 1:
        raise H3InputError(f"{name} must be at least 1x1 pixels, got shape {tuple(pixels.shape)}")
    if pixels.dtype != torch.uint8:
        if not pixels.is_floating_point():
            raise H3InputError(f"{name} must be floats in [0, 1] or uint8, got {pixels.dtype}")
        low, high = float(pixels.min()), float(pixels.max())
        if not (low >= 0.0 and high <= 1.0):  # also refuses NaN
            raise H3InputError(f"{name} must hold values in [0, 1], got values from {low:g} to {high:g}")
    stack = pixels if frames else pixels[None]
    index = torch.arange(stack.shape[0]) if select is None else select.cpu()
    out = torch.empty(index.shape[0], *stack.shape[1:], dtype=torch.uint8)
    for start in range(0, index.shape[0], 8):
        chunk = stack.index_select(0, index[start : start + 8].to(stack.device)).cpu()
        if chunk.dtype != torch.uint8:
            chunk = (chunk * 255).round().clamp(0, 255).to(torch.uint8)
        out[start : start + chunk.shape[0]] = chunk
    return out if frames else out[0]


def _lanczos(x: float) -> float:
    """Pillow's Lanczos-3 kernel, ``sinc(x) · sinc(x / 3)`` on [-3, 3)."""

    def sinc(v: float) -> float:
        if v == 0.0:
            return 1.0
        v = v * math.pi
        return math.sin(v) / v

    return sinc(x) * sinc(x / 3) if -3.0 <= x < 3.0 else 0.0


@functools.lru_cache(maxsize=16)
def _lanczos_taps(in_size: int, out_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Source indices and fixed-point weights ``[out_size, taps]`` (int32, 22 fractional bits) of one axis,
    computed as Pillow's ``precompute_coeffs`` and ``normalize_coeffs_8bpc`` do; cached, since every frame
    of a video shares them.

    Python floats and ``math.sin`` are the C doubles and libm Pillow uses, and the sums run in the same
    order (not ``sum()``, which compensates from Python 3.12 on), so the weights are Pillow's to the bit."""
    scale = in_size / out_size
    filter_scale = max(scale, 1.0)
    support = 3.0 * filter_scale
    taps = int(math.ceil(support)) * 2 + 1
    index = torch.zeros(out_size, taps, dtype=torch.int64)
    weight = torch.zeros(out_size, taps, dtype=torch.int32)
    one, inverse_scale = 1 << 22, 1.0 / filter_scale
    for out in range(out_size):
        center = (out + 0.5) * scale
        first = max(int(center - support + 0.5), 0)
        stop = min(int(center + support + 0.5), in_size)
        raw = [_lanczos((x - center + 0.5) * inverse_scale) for x in range(first, stop)]
        total = 0.0
        for w in raw:
            total += w
        for k, w in enumerate(raw):
            w = w / total if total != 0.0 else w
            weight[out, k] = int(-0.5 + w * one) if w < 0 else int(0.5 + w * one)
            index[out, k] = first + k
    return index, weight


def _resample_axis(pixels: torch.Tensor, axis: int, out_size: int) -> torch.Tensor:
    """One LANCZOS pass of uint8 ``pixels`` along ``axis``, in Pillow's integer arithmetic: the sum of
    byte × weight plus one half, floored at 22 bits and clipped to a byte. int32 holds every sum, as it
    does in Pillow (its 22-bit weights leave two bits of headroom), so this is exact on any device."""
    index, weight = (t.to(pixels.device) for t in _lanczos_taps(pixels.shape[axis], out_size))
    source = pixels.movedim(axis, 0).to(torch.int32)  # whole rows per tap: index_select copies blocks
    spread = (-1,) + (1,) * (source.dim() - 1)
    total = torch.full((out_size, *source.shape[1:]), 1 << 21, dtype=torch.int32, device=pixels.device)
    for k in range(index.shape[1]):  # one tap at a time: memory stays one output image
        total += source.index_select(0, index[:, k]) * weight[:, k].view(spread)
    return torch.div(total, 1 << 22, rounding_mode="floor").clamp(0, 255).to(torch.uint8).movedim(0, axis)


def _resize_frame(frame: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """One uint8 ``[H, W, 3]`` frame through Pillow 13's two passes (see ``lanczos_resize``)."""
    rows_lost, columns_lost = frame.shape[0] - height, frame.shape[1] - width
    vertical_first = rows_lost > 0 and rows_lost > 2 * columns_lost
    passes = [(0, height), (1, width)]
    for axis, size in passes if vertical_first else passes[::-1]:
        if frame.shape[axis] != size:
            frame = _resample_axis(frame, axis, size)
    return frame


def lanczos_resize(pixels: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """uint8 ``[H, W, 3]`` or ``[F, H, W, 3]`` → ``[height, width, 3]`` (or ``[F, ...]``), equal to Pillow 13's
    ``Image.resize((width, height), LANCZOS)`` of every frame: two separable passes, each rounded to bytes;
    an axis whose size does not change is not filtered (so an unchanged size is a copy). Runs on the
    pixels' device, one frame at a time.

    The released pipeline resized with Pillow's LANCZOS (diffusers' ``VaeImageProcessor.resize`` on a PIL
    image), and conditioning is sensitive to single-byte differences, so this is Pillow's arithmetic. The
    pass order is Pillow 13's: vertical first when the image loses more than twice as many rows as columns,
    horizontal first otherwise. Pillow 12 and older always went horizontal first, which rounds differently
    (by a few levels, on some pixels) in that one case."""
    if pixels.dtype != torch.uint8 or pixels.dim() not in (3, 4) or pixels.shape[-1] != 3:
        raise H3InputError(
            f"pixels to resize must be uint8 [H, W, 3] or [F, H, W, 3], got {pixels.dtype} {tuple(pixels.shape)}"
        )
    if width < 1 or height < 1:
        raise H3InputError(f"the resize target must be at least 1x1, got {width}x{height}")
    if pixels.dim() == 3:
        return _resize_frame(pixels, width, height).clone()
    out = torch.empty(pixels.shape[0], height, width, 3, dtype=torch.uint8, device=pixels.device)
    for i, frame in enumerate(pixels):
        out[i] = _resize_frame(frame, width, height)
    return out


# ---- audio -------------------------------------------------------------------------------------


def _positive_finite(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _check_rate(rate, name: str) -> int:
    """A sample rate as a positive whole number of Hz (the resampler works on their ratio in integers)."""
    if not _positive_finite(rate) or rate != int(rate):
        raise H3InputError(f"{name} must be a positive whole number of Hz, got {rate!r}")
    return int(rate)


def _sinc_kernel(orig: int, new: int) -> tuple[torch.Tensor, int]:
    """torchaudio's ``Resample`` kernel for the reduced rates ``orig → new`` (defaults: Hann-windowed sinc,
    6 zero crossings, roll-off 0.99), ``[new, 1, 2 · width + orig]`` fp32, and its half width.

    Built in fp64 and cast to fp32 as ``transforms.Resample`` builds it (the phase offsets ``j / new`` are
    fp32 there, an artefact kept here), so the kernel is torchaudio's to the last bit."""
    zero_crossings, rolloff = 6, 0.99
    base = min(orig, new) * rolloff
    width = math.ceil(zero_crossings * orig / base)
    offsets = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    phases = torch.arange(0, -new, -1, dtype=torch.float32)[:, None, None] / new
    t = (phases + offsets) * base
    t = t.clamp(-zero_crossings, zero_crossings)
    window = torch.cos(t * math.pi / zero_crossings / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.ones((), dtype=t.dtype), t.sin() / t)
    kernel = kernel * (window * (base / orig))
    return kernel.to(torch.float32), width


def resample_audio(waveform: torch.Tensor, from_rate: int, to_rate: int) -> torch.Tensor:
    """``[channels, samples]`` at ``from_rate`` → fp32 ``[channels, ceil(samples · to / from)]`` at ``to_rate``.

    The resampler the released pipeline used: torchaudio's ``transforms.Resample(from_rate, to_rate)``
    with its defaults — a polyphase windowed-sinc FIR, zero-padded at both ends, applied as a strided
    convolution. Kernel, padding and output length (including torchaudio's fp32 rounding of the length
    before its ceiling) are reproduced; on the CPU the output equals torchaudio 2.11's to fp32 rounding."""
    from_rate = _check_rate(from_rate, "the source sample rate")
    to_rate = _check_rate(to_rate, "the target sample rate")
    waveform = waveform.to(torch.float32)
    if from_rate == to_rate:
        return waveform
    g = math.gcd(from_rate, to_rate)
    orig, new = from_rate // g, to_rate // g
    if new * (2 * math.ceil(6 / 0.99 * orig / min(orig, new)) + orig) > _MAX_RESAMPLE_KERNEL:
        raise H3InputError(
            f"resampling {from_rate} Hz to {to_rate} Hz needs a {new}-phase filter, too large; "
            f"convert the audio to a common rate (16000, 22050, 24000, 44100, 48000 Hz) first"
        )
    kernel, width = _sinc_kernel(orig, new)
    channels, length = waveform.shape
    padded = torch.nn.functional.pad(waveform, (width, width + orig))
    phases = torch.nn.functional.conv1d(padded[:, None], kernel.to(waveform.device), stride=orig)
    out = phases.transpose(1, 2).reshape(channels, -1)
    # torchaudio takes the ceiling of the length held in an fp32 tensor.
    target = math.ceil(float(torch.tensor(new * length / orig, dtype=torch.float32)))
    return out[:, :target]


def _normalize_soundtrack(waveform: torch.Tensor, sample_rate, frames: int, name: str) -> torch.Tensor:
    """A reference waveform ``[1 or 2, samples]`` → stereo fp32 ``[2, samples]`` at 32 kHz, no longer than
    ``frames`` at 24 fps: truncated at its own rate first, then upmixed, then resampled once, in the order
    the released pipeline does it (truncating after resampling would cut on a different sample)."""
    rate = _check_rate(sample_rate, f"the sample rate of {name}")
    if not isinstance(waveform, torch.Tensor) or waveform.dim() != 2:
        shape = tuple(waveform.shape) if isinstance(waveform, torch.Tensor) else type(waveform).__name__
        raise H3InputError(f"{name} must be a waveform [channels, samples], got {shape}")
    if waveform.shape[0] not in (1, 2):
        raise H3InputError(f"{name} must be mono or stereo (1 or 2 channels), got {waveform.shape[0]} channels")
    if not waveform.is_floating_point():
        raise H3InputError(f"{name} must be floating point samples in [-1, 1], got {waveform.dtype}")
    if waveform.shape[1] == 0:
        raise H3InputError(f"{name} is empty (0 samples); give at least one sample")
    waveform = waveform.to(torch.float32)[:, : int(frames / FPS * rate)]
    if waveform.shape[0] == 1:
        waveform = waveform.expand(2, -1).contiguous()
    return resample_audio(waveform, rate, AUDIO_SAMPLE_RATE)


def _encode_audio(audio_vae, waveform: torch.Tensor, overrides=None) -> torch.Tensor:
    """Stereo ``[2, samples]`` at 32 kHz → model-space latents ``[2, 32, ceil(samples / 800)]`` on the CPU:
    the two channels as a batch of the mono VAE, the posterior mean (a soundtrack is never sampled);
    ``overrides`` picks the encoder attention's backend (``h3_core.attention.vae``)."""
    if audio_vae is None:
        raise H3InputError("an audio reference or a video soundtrack needs the audio VAE; none was given")
    device = next(audio_vae.parameters()).device
    with torch.inference_mode():
        z = audio_vae.encode_mean(waveform.to(device)[:, None], overrides)
        return audio_vae.normalize_latents(z.float()).cpu()


# ---- keyframes ---------------------------------------------------------------------------------


def keyframe_canvas(image: torch.Tensor) -> tuple[int, int]:
    """``(height, width)`` of the canvas an FL2VA request gets by default: the first keyframe's aspect
    ratio on H3's canvas rule (768 short edge, 768 × 1344 area, sides rounded to 32)."""
    pixels = quantize_pixels(image, "the first keyframe")
    height, width = pixels.shape[:2]
    return canvas_size(width, height)


def fit_keyframe(image: torch.Tensor, width: int, height: int, *, fit: str = "stretch") -> torch.Tensor:
    """One keyframe ``[H, W, 3]`` → uint8 ``[height, width, 3]`` on the canvas.

    ``"stretch"``: resized to the canvas whatever its aspect (the geometry anchor, i.e. the first keyframe).
    ``"cover"``: scaled by the larger of the two ratios, each side rounded to a pixel (never below the
    canvas), and the canvas cut from the middle with the offset floored — the released arithmetic, which
    differs by a pixel from diffusers' generic ``resize_mode="crop"`` on many aspect ratios. A keyframe
    already at the canvas size is used as it is."""
    if fit not in KEYFRAME_FITS:
        raise H3InputError(f"keyframe fit must be one of {list(KEYFRAME_FITS)}, got {fit!r}")
    check_canvas(width, height)
    pixels = quantize_pixels(image, "the keyframe")
    source_height, source_width = pixels.shape[:2]
    if (source_height, source_width) == (height, width):
        return pixels
    if fit == "stretch":
        return lanczos_resize(pixels, width, height)
    scale = max(width / source_width, height / source_height)
    cover_width = max(width, round(source_width * scale))
    cover_height = max(height, round(source_height * scale))
    left, top = max(0, (cover_width - width) // 2), max(0, (cover_height - height) // 2)
    covered = lanczos_resize(pixels, cover_width, cover_height)
    return covered[top : top + height, left : left + width].contiguous()


def fit_keyframes(images: Sequence[torch.Tensor], width: int, height: int) -> list[torch.Tensor]:
    """Keyframes in packed order → uint8 ``[height, width, 3]`` each: the first stretched (it sets the
    geometry), the others cover-cropped. These are also the pixels Qwen3-VL is shown."""
    return [fit_keyframe(image, width, height, fit="stretch" if i == 0 else "cover") for i, image in enumerate(images)]


def encode_keyframes(
    vae, keyframes: Sequence[tuple[str, torch.Tensor]], width: int, height: int, **options
) -> tuple[tuple[str, torch.Tensor], ...]:
    """``(anchor, image)`` pairs in packed order → ``(anchor, latent [24, 1, h, w])`` pairs for
    ``ClipRequest(keyframes=...)``, on the CPU in fp32.

    As the released FL2VA step: the first keyframe given is stretched onto the ``width`` × ``height`` canvas,
    a second one cover-cropped (``fit_keyframes``); each is encoded as a single frame by the tiled spatial
    encoder, its posterior sampled under seed 42 and rounded to fp16. ``options`` go to ``encode_video``
    (e.g. ``check_cancel``)."""
    anchors = [anchor for anchor, _ in keyframes]
    for anchor in anchors:
        if anchor not in ("first", "last"):
            raise H3InputError(f"a keyframe anchor must be 'first' or 'last', got {anchor!r}")
    if len(set(anchors)) != len(anchors):
        raise H3InputError(f"each keyframe anchor may be used once, got {anchors}")
    fitted = fit_keyframes([image for _, image in keyframes], width, height)
    return tuple((anchor, _encode_pixels(vae, pixels[None], **options)) for anchor, pixels in zip(anchors, fitted))


def encode_keyframe(
    frame_idx: int,
    frames: int,
    width: int,
    height: int,
    *,
    images: torch.Tensor | None = None,
    waveform: torch.Tensor | None = None,
    sample_rate: int | None = None,
    vae=None,
    audio_vae=None,
    audio_overrides=None,
    **options,
) -> Keyframe:
    """One keyframe anywhere in a clip of ``frames`` frames on the ``width`` × ``height`` canvas, as ComfyUI's
    native guides are made (``h3_core.pipeline.keyframes``): ``images`` ``[F, H, W, 3]`` in [0, 1] (a still, or a
    clip cut to ``guide_frames(F)``) cover-cropped onto the canvas frame by frame and encoded as a condition;
    ``waveform`` ``[channels, samples]`` at ``sample_rate`` made stereo 32 kHz, encoded whole (posterior mean,
    the encoder attention as ``audio_overrides`` says) and cut to the audio left after the anchor frame.
    ``frame_idx`` counts from the start, or from the end when negative. ``options`` go to ``encode_video``."""
    if images is None and waveform is None:
        raise H3InputError("a keyframe needs images, audio or both; got neither")
    span = 1
    if images is not None:
        if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[0] == 0:
            shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
            raise H3InputError(f"the keyframe's images must be a batch [frames, height, width, 3], got {shape}")
        span = guide_frames(int(images.shape[0]))
    index = resolve_frame_index(frame_idx, frames, span)
    video = audio = None
    if images is not None:
        if vae is None:
            raise H3InputError("a keyframe's images need the video VAE; none was given")
        pixels = torch.stack([fit_keyframe(image, width, height, fit="cover") for image in images[:span]])
        video = _encode_pixels(vae, pixels, **options)
    if waveform is not None:
        room = guide_audio_latents(index, audio_latents(frames))
        if room < 1:
            raise H3InputError(f"frame_idx: {frame_idx} is past the end of the clip's audio; anchor the audio earlier")
        if audio_vae is None:
            raise H3InputError("a keyframe's audio needs the audio VAE; none was given")
        rate = _check_rate(sample_rate, "the sample rate of the keyframe's audio")
        # encoded whole and then cut, as native does (the frame count only bounds the samples kept)
        whole = math.ceil(waveform.shape[-1] / rate * FPS) + 1 if isinstance(waveform, torch.Tensor) else 1
        stereo = _normalize_soundtrack(waveform, rate, whole, "the keyframe's audio")
        audio = _encode_audio(audio_vae, stereo, audio_overrides)[..., :room].contiguous()
    return Keyframe(index, video=video, audio=audio)


def _encode_pixels(vae, frames: torch.Tensor, **options) -> torch.Tensor:
    """uint8 ``[F, H, W, 3]`` → model-space latents ``[24, T, h, w]`` on the CPU: bytes / 255, then the
    released conditioning encode."""
    return encode_video(vae, frames.to(torch.float32) / 255.0, **options).float().cpu()


# ---- references --------------------------------------------------------------------------------


@dataclass(frozen=True)
class NormalizedReference:
    """A Ref2VA reference on H3's own rates and sizes, ready to encode and to show Qwen3-VL.

    ``kind`` "image" (``pixels`` uint8 ``[H, W, 3]``), "video" (``pixels`` uint8 ``[F, H, W, 3]`` at 24 fps,
    ``audio`` its soundtrack or None) or "audio" (``audio`` only). ``audio`` is fp32 stereo ``[2, samples]``
    at 32 kHz. The pixels are what Qwen3-VL reads (all ``F`` frames of a video; the VAE encodes a
    ``17k + 5`` prefix of them)."""

    kind: str
    pixels: torch.Tensor | None = None
    audio: torch.Tensor | None = None

    @property
    def has_audio(self) -> bool:
        return self.audio is not None


def _check_aspect(width: int, height: int, name: str) -> None:
    if not MIN_ASPECT <= width / height <= MAX_ASPECT:
        raise H3InputError(
            f"{name} must have an aspect ratio from 1:4 to 4:1, got {width}x{height} "
            f"({width / height:.3g}:1); crop it first"
        )


def normalize_image_reference(
    image: torch.Tensor, *, short_edge: int = REFERENCE_IMAGE_SHORT_EDGE, device: torch.device | str = "cpu"
) -> NormalizedReference:
    """An image reference ``[H, W, 3]`` → its own canvas: the short edge scaled to ``short_edge`` (2048 for
    the released checkpoint, upscaling included and no area cap), each side rounded to 32, LANCZOS.

    An image reference never binds the generated geometry; it is encoded at this size whatever the target.
    The resize runs on ``device`` (exact on any device); the result is on the CPU."""
    pixels = quantize_pixels(image, "the image reference")
    height, width = pixels.shape[:2]
    _check_aspect(width, height, "the image reference")
    scale = short_edge / min(width, height)
    target_height = max(CANVAS_MULTIPLE, round(height * scale / CANVAS_MULTIPLE) * CANVAS_MULTIPLE)
    target_width = max(CANVAS_MULTIPLE, round(width * scale / CANVAS_MULTIPLE) * CANVAS_MULTIPLE)
    return NormalizedReference("image", lanczos_resize(pixels.to(device), target_width, target_height).cpu())


def _frames_at_24_fps(count: int, fps: float) -> torch.Tensor:
    """Which source frame each 24 fps frame shows, as ffmpeg's ``fps`` filter holds and drops whole frames:
    frame i lands on slot ``floor(i · 24 / fps + 0.5)`` and is held until the next frame's slot, the last
    one until the slot the clip's end rounds to (float64, the released arithmetic)."""
    source = torch.arange(count)
    if fps == FPS:
        return source
    scale = FPS / fps
    slots = torch.floor(torch.arange(count, dtype=torch.float64) * scale + 0.5).to(torch.int64)
    end = torch.tensor([math.floor(count * scale + 0.5)], dtype=torch.int64)
    return source.repeat_interleave(torch.diff(slots, append=end))


def normalize_video_reference(
    video: torch.Tensor,
    fps: float,
    *,
    frames: int,
    audio: torch.Tensor | None = None,
    sample_rate: int | None = None,
    short_edge: int = SHORT_EDGE,
    max_pixels: int = MAX_PIXELS,
    min_frames: int = MIN_VIDEO_REFERENCE_FRAMES,
    device: torch.device | str = "cpu",
) -> NormalizedReference:
    """A video reference ``[F, H, W, 3]`` at ``fps`` (and its soundtrack ``[channels, samples]`` at
    ``sample_rate``) → 24 fps, at most ``frames`` frames (the generated length, taken up to the next
    ``17k + 5`` as the released pipeline does), on the canvas of its own aspect ratio (``short_edge`` and
    ``max_pixels``: the target's rule, 768 and 768 × 1344 released), LANCZOS frame by frame.

    The order is the released one: frame-rate conversion first, truncation, then the resize. At least
    ``min_frames`` frames must remain at 24 fps (Qwen3-VL reads two of them, at 0 s and 0.5 s). The resize
    runs on ``device`` (exact on any device); the result is on the CPU."""
    if not _positive_finite(fps):
        raise H3InputError(f"the video reference's fps must be a positive number, got {fps!r}")
    frames = _clip_frames(frames)
    if isinstance(video, torch.Tensor) and video.dim() == 4 and video.shape[-1] == 3 and video.shape[0] > 0:
        shown = _frames_at_24_fps(video.shape[0], float(fps))[:frames]
        if shown.shape[0] < min_frames:
            raise H3InputError(
                f"the video reference is too short: {video.shape[0]} frames at {fps:g} fps give "
                f"{shown.shape[0]} at {FPS} fps, and it needs at least {min_frames} "
                f"({min_frames / FPS:.2f} s)"
            )
    else:
        shown = None  # quantize_pixels names what is wrong with it
    pixels = quantize_pixels(video, "the video reference", frames=True, select=shown)
    height, width = pixels.shape[1:3]
    _check_aspect(width, height, "the video reference")
    canvas_height, canvas_width = canvas_size(width, height, short_edge=short_edge, max_pixels=max_pixels)
    pixels = lanczos_resize(pixels.to(device), canvas_width, canvas_height).cpu()
    soundtrack = None
    if audio is not None:
        if sample_rate is None:
            raise H3InputError("the video reference's soundtrack needs its sample rate; got sample_rate=None")
        soundtrack = _normalize_soundtrack(audio, sample_rate, frames, "the video reference's soundtrack")
    return NormalizedReference("video", pixels, soundtrack)


def normalize_audio_reference(waveform: torch.Tensor, sample_rate: int, *, frames: int) -> NormalizedReference:
    """An audio reference ``[channels, samples]`` at ``sample_rate`` → stereo 32 kHz, no longer than the
    generated clip of ``frames`` frames (taken up to the next ``17k + 5``)."""
    frames = _clip_frames(frames)
    return NormalizedReference(
        "audio", audio=_normalize_soundtrack(waveform, sample_rate, frames, "the audio reference")
    )


def _clip_frames(frames: int) -> int:
    """The generated length a reference is truncated to, on the ``17k + 5`` grid (rounded up, as diffusers
    aligns the request's ``num_frames`` before normalising references against it)."""
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
        raise H3InputError(f"the generated length must be a whole number of frames >= 1, got {frames!r}")
    return snap_frames(frames)


def encode_reference(
    reference: NormalizedReference, vae=None, audio_vae=None, *, audio_overrides=None, **options
) -> ReferenceLatents:
    """A normalised reference → ``ReferenceLatents`` for ``generate_ref2va``, on the CPU in fp32.

    Pixels through the video VAE as a condition (sampled under seed 42, fp16-rounded): an image as one
    frame, a video as its largest ``17k + 5`` prefix, or all of it when it has fewer than 22 frames (the
    encoder then pads the clip with its last frame). Audio through the audio VAE's posterior mean, its
    attention as ``audio_overrides`` says (``h3_core.attention.vae``). ``options`` go to ``encode_video``."""
    if reference.kind not in ("image", "video", "audio"):
        raise H3InputError(f"a reference kind must be 'image', 'video' or 'audio', got {reference.kind!r}")
    video = None
    if reference.kind in ("image", "video"):
        if vae is None:
            raise H3InputError(f"an {reference.kind} reference needs the video VAE; none was given")
        pixels = reference.pixels if reference.kind == "video" else reference.pixels[None]
        video = _encode_pixels(vae, pixels[: _encodable_frames(vae, pixels.shape[0])], **options)
    audio = _encode_audio(audio_vae, reference.audio, audio_overrides) if reference.audio is not None else None
    return ReferenceLatents(reference.kind, video=video, audio=audio)


def _encodable_frames(vae, count: int) -> int:
    """The largest ``17k + 5`` frame count within ``count``, so the encoder pads nothing; 22 when ``count``
    is smaller, which keeps every frame (the released snap, which only ever shortens)."""
    clip, keep = vae.cfg.clip_length, math.ceil(vae.cfg.clip_length / vae.cfg.temporal_ratio)
    return max(1, (count - keep) // clip) * clip + keep
