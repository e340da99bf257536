"""Writing a generated clip as an mp4 (H.264 yuv420p video + AAC stereo audio) and reading audio files,
with PyAV (no torchaudio).

``write_mp4`` writes to a temporary name beside the target and renames it when the file is complete, so a
failed or cancelled write never leaves a half-written file under the final name.
"""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path
from typing import Callable

import torch

from .errors import H3InputError

__all__ = ["write_mp4", "read_audio", "VIDEO_CODEC", "AUDIO_CODEC"]

VIDEO_CODEC = "libx264"
AUDIO_CODEC = "aac"
_AUDIO_CHUNK = 1024  # AAC frame size


def _frames_uint8(frames: torch.Tensor) -> torch.Tensor:
    if not isinstance(frames, torch.Tensor) or frames.dim() != 4 or frames.shape[-1] != 3:
        shape = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
        raise H3InputError(f"frames must be RGB images [frames, height, width, 3], got {shape}")
    if frames.shape[0] == 0:
        raise H3InputError("frames: there are no frames to write")
    if frames.shape[1] % 2 or frames.shape[2] % 2:
        raise H3InputError(f"frames: H.264 yuv420p needs an even width and height, got "
                           f"{frames.shape[2]}x{frames.shape[1]}")
    if frames.dtype == torch.uint8:
        return frames.cpu()
    if not frames.is_floating_point():
        raise H3InputError(f"frames must be floats in [0, 1] or uint8, got {frames.dtype}")
    return (frames.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def _check_audio(waveform, sample_rate) -> torch.Tensor:
    if not isinstance(waveform, torch.Tensor) or waveform.dim() != 2 or waveform.shape[0] not in (1, 2):
        shape = tuple(waveform.shape) if isinstance(waveform, torch.Tensor) else type(waveform).__name__
        raise H3InputError(f"audio must be a waveform [channels (1 or 2), samples], got {shape}")
    if not isinstance(sample_rate, int) or sample_rate <= 0:
        raise H3InputError(f"audio sample rate must be a positive whole number of Hz, got {sample_rate!r}")
    return waveform.detach().float().clamp(-1, 1).cpu()


def write_mp4(path: str | Path, frames: torch.Tensor, waveform: torch.Tensor | None = None, sample_rate: int = 32000,
              *, fps: int = 24, crf: int = 18, check_cancel: Callable[[], None] | None = None,
              metadata: dict[str, str] | None = None) -> Path:
    """Write ``frames`` ``[F, H, W, 3]`` (floats in [0, 1] or uint8) at ``fps`` and, when given, ``waveform``
    ``[channels, samples]`` in [-1, 1] at ``sample_rate`` as AAC, into ``path``. ``metadata`` (text by key) goes
    into the container's tags, custom keys kept (``movflags=use_metadata_tags``): where a host stores the
    workflow that made the clip. ``check_cancel`` is called between frames; whatever it raises stops the write
    and removes the partial file, as does any failure (a full disk)."""
    import av

    path = Path(path)
    pixels = _frames_uint8(frames)
    audio = None if waveform is None else _check_audio(waveform, sample_rate)
    tags = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in tags.items()):
        raise H3InputError(f"metadata must map text keys to text values, got {sorted(map(repr, tags))[:4]}")
    partial = path.with_name(f".{path.stem}.partial{path.suffix}")
    try:
        with av.open(str(partial), mode="w", format="mp4", options={"movflags": "use_metadata_tags"}) as container:
            for key, value in tags.items():
                container.metadata[key] = value
            video = container.add_stream(VIDEO_CODEC, rate=fps)
            video.width, video.height = int(pixels.shape[2]), int(pixels.shape[1])
            video.pix_fmt = "yuv420p"
            video.options = {"crf": str(crf)}
            sound = None
            if audio is not None:
                sound = container.add_stream(AUDIO_CODEC, rate=sample_rate)
                sound.layout = "stereo" if audio.shape[0] == 2 else "mono"
            for index in range(pixels.shape[0]):
                if check_cancel is not None:
                    check_cancel()
                frame = av.VideoFrame.from_ndarray(pixels[index].numpy(), format="rgb24")
                frame.pts = index
                frame.time_base = Fraction(1, fps)
                container.mux(video.encode(frame))
            container.mux(video.encode())
            if sound is not None:
                planar = audio.numpy()
                for start in range(0, planar.shape[1], _AUDIO_CHUNK):
                    chunk = av.AudioFrame.from_ndarray(planar[:, start : start + _AUDIO_CHUNK].copy(), format="fltp",
                                                       layout=sound.layout.name)
                    chunk.sample_rate = sample_rate
                    chunk.pts = start
                    chunk.time_base = Fraction(1, sample_rate)
                    container.mux(sound.encode(chunk))
                container.mux(sound.encode())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def read_audio(path: str | Path) -> tuple[torch.Tensor, int]:
    """Every audio sample of the first audio stream of ``path`` (any container PyAV reads): ``([channels,
    samples] fp32 in [-1, 1], sample rate)``."""
    import av

    path = Path(path)
    try:
        container = av.open(str(path))
    except (av.error.FFmpegError, OSError) as exc:
        raise H3InputError(f"{path}: cannot be read as an audio or video file ({exc})") from None
    with container:
        if not container.streams.audio:
            raise H3InputError(f"{path}: has no audio stream")
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="fltp")
        chunks, rate = [], stream.rate
        for frame in container.decode(stream):
            for converted in resampler.resample(frame):
                chunks.append(torch.from_numpy(converted.to_ndarray().copy()))
        for converted in resampler.resample(None):
            chunks.append(torch.from_numpy(converted.to_ndarray().copy()))
    if not chunks:
        raise H3InputError(f"{path}: the audio stream holds no samples")
    return torch.cat(chunks, dim=1).float(), int(rate)
