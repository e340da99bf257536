"""Writing a generated clip as an mp4 (H.264 yuv420p video + AAC stereo audio) and reading audio files,
with PyAV (no torchaudio).

``Mp4Writer`` takes the frames a range at a time (``write_mp4`` all at once); both write to a temporary name
beside the target and rename it when the file is complete, so a failed or cancelled write never leaves a
half-written file under the final name.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path
from typing import Callable

import torch

from ..errors import H3InputError
from .encoder_open import fails_to_open, fails_to_open_elsewhere

__all__ = [
    "Mp4Writer",
    "Mp4Worker",
    "write_mp4",
    "video_encoder",
    "read_audio",
    "VIDEO_CODEC",
    "AUDIO_CODEC",
    "HARDWARE_ENCODERS",
    "ENCODERS",
    "PRESETS",
    "DEFAULT_PRESET",
    "ENCODER_NICENESS",
    "lower_this_threads_priority",
]

VIDEO_CODEC = "libx264"
# Hardware H.264 encoders tried first, in order, where they open: NVENC on NVIDIA cards that have a video encoder
# (consumer and workstation cards; data-centre Hopper has none). PyAV lists them wherever FFmpeg was built with
# them, so only opening one tells.
HARDWARE_ENCODERS = ("h264_nvenc",)
ENCODERS = ("auto", VIDEO_CODEC, *HARDWARE_ENCODERS)
PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow")
# The shortest tail after the decode within 0.5 dB (PSNR) of libx264's own default, medium, at crf 18, for a larger
# file (bench/results/mp4_presets.md)
DEFAULT_PRESET = "superfast"
AUDIO_CODEC = "aac"
_AUDIO_CHUNK = 1024  # AAC frame size
# How much lower than the rest of the process the encoder's threads are scheduled (Linux nice, added): the thread
# that feeds the GPU the next window's work goes first when every core is busy; the encoder still takes every
# cycle that thread leaves idle
ENCODER_NICENESS = 10


def _frames_uint8(frames: torch.Tensor) -> torch.Tensor:
    if not isinstance(frames, torch.Tensor) or frames.dim() != 4 or frames.shape[-1] != 3:
        shape = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
        raise H3InputError(f"frames must be RGB images [frames, height, width, 3], got {shape}")
    if frames.shape[0] == 0:
        raise H3InputError("frames: there are no frames to write")
    if frames.shape[1] % 2 or frames.shape[2] % 2:
        raise H3InputError(
            f"frames: H.264 yuv420p needs an even width and height, got {frames.shape[2]}x{frames.shape[1]}"
        )
    if frames.dtype == torch.uint8:
        return frames.cpu()
    if not frames.is_floating_point():
        raise H3InputError(f"frames must be floats in [0, 1] or uint8, got {frames.dtype}")
    return pixels_uint8(frames.detach()).cpu()


def pixels_uint8(frames: torch.Tensor) -> torch.Tensor:
    """Floats in [0, 1] as the 8-bit values the mp4 stores (clamped, × 255, rounded), on ``frames``' device:
    the same bytes wherever it runs."""
    return (frames.float().clamp(0, 1) * 255).round().to(torch.uint8)


def _check_audio(waveform, sample_rate) -> torch.Tensor:
    if not isinstance(waveform, torch.Tensor) or waveform.dim() != 2 or waveform.shape[0] not in (1, 2):
        shape = tuple(waveform.shape) if isinstance(waveform, torch.Tensor) else type(waveform).__name__
        raise H3InputError(f"audio must be a waveform [channels (1 or 2), samples], got {shape}")
    if not isinstance(sample_rate, int) or sample_rate <= 0:
        raise H3InputError(f"audio sample rate must be a positive whole number of Hz, got {sample_rate!r}")
    return waveform.detach().float().clamp(-1, 1).cpu()


_log = logging.getLogger(__name__)
_said: set[tuple[str, str]] = set()  # the encoder choices already logged
_opened: dict[tuple[str, int, int], str | None] = {}  # (encoder, width, height) -> why it failed to open, or None


# the size hardware encoders are probed at ahead of a clip (``probe_hardware_encoders``) and when a node names one;
# every encoder takes it, so one that fails there fails at any size
PROBE_SIZE = (256, 256)


def _fails_to_open(name: str, width: int, height: int, fps: int) -> str | None:
    """Why ``name`` cannot encode ``width``×``height`` yuv420p here (``encoder_open.fails_to_open``), or None when it
    can. Asked once per process and size; an encoder that already failed at ``PROBE_SIZE`` is not opened again."""
    key = (name, width, height)
    small = _opened.get((name, *PROBE_SIZE))
    if key not in _opened and small is not None:
        _opened[key] = small
    if key not in _opened:
        _opened[key] = fails_to_open(name, width, height, fps)
    return _opened[key]


def probe_hardware_encoders(fps: int = 24) -> dict[str, str | None]:
    """Each hardware encoder opened at ``PROBE_SIZE`` now, in a child process (``encoder_open``: in this one, the
    open would hold every other thread for as long as FFmpeg takes to load the driver), so that the first clip's
    ``video_encoder`` finds the answer: why each fails, or None for one that opens. ``ImportError`` without
    PyAV."""
    answers = fails_to_open_elsewhere(HARDWARE_ENCODERS, *PROBE_SIZE, fps)
    for name, why in answers.items():
        _opened[(name, *PROBE_SIZE)] = why
    return answers


def video_encoder(
    width: int, height: int, fps: int = 24, choice: str = "auto", candidates: tuple[str, ...] | None = None
) -> tuple[str, str]:
    """The H.264 encoder a clip is written with, and why: for ``choice="auto"`` the first of ``candidates``
    (default ``HARDWARE_ENCODERS``) that opens here (``_fails_to_open``), else libx264; any other ``choice``
    (``ENCODERS``) as named, refused when it does not open."""
    if choice not in ENCODERS:
        raise H3InputError(f"encoder: got {choice!r}; allowed: {', '.join(ENCODERS)}")
    if choice == VIDEO_CODEC:
        return VIDEO_CODEC, "chosen"
    if choice != "auto":
        failed = _fails_to_open(choice, width, height, fps)
        if failed:
            raise H3InputError(
                f"encoder: {choice} does not open on this machine ({failed}); pick auto or {VIDEO_CODEC}"
            )
        return choice, "chosen"
    reasons = []
    for name in HARDWARE_ENCODERS if candidates is None else candidates:
        failed = _fails_to_open(name, width, height, fps)
        if failed is None:
            return name, f"{name} opened"
        reasons.append(f"{name}: {failed}")
    return VIDEO_CODEC, "no hardware encoder opened (" + "; ".join(reasons) + ")" if reasons else "chosen"


class Mp4Writer:
    """An mp4 written a frame range at a time: H.264 yuv420p video at ``fps`` (libx264 at ``crf`` with ``preset``
    and ``threads``; 0 lets libx264 choose) and, when ``waveform`` ``[channels, samples]`` in [-1, 1] is given,
    AAC audio at ``sample_rate``, encoded before the first frame (``write_audio``; ``audio_written`` says whether it
    is in). ``metadata`` (text by key) goes into the container's tags, custom keys kept
    (``movflags=use_metadata_tags``). Everything is written to a temporary name beside ``path``: ``close`` finishes
    the file and renames it, ``abort`` (or leaving a ``with`` block by an exception) removes it, so a failed or
    cancelled write never leaves a file under the final name. ``encoder`` (``video_encoder``): "auto" writes with a
    hardware encoder where one opens (NVENC at constant quality ``crf`` + 1 with its preset p5; its quality against
    libx264's is not measured here), else libx264; ``encoder_used`` and ``encoder_reason`` say which and why."""

    def __init__(
        self,
        path: str | Path,
        width: int,
        height: int,
        *,
        fps: int = 24,
        crf: int = 18,
        preset: str = DEFAULT_PRESET,
        threads: int = 0,
        waveform: torch.Tensor | None = None,
        sample_rate: int = 32000,
        metadata: dict[str, str] | None = None,
        encoder: str = VIDEO_CODEC,
    ):
        import av

        if width % 2 or height % 2 or width <= 0 or height <= 0:
            raise H3InputError(f"frames: H.264 yuv420p needs an even width and height, got {width}x{height}")
        if preset not in PRESETS:
            raise H3InputError(f"preset: got {preset!r}; allowed: {', '.join(PRESETS)}")
        if not isinstance(threads, int) or threads < 0:
            raise H3InputError(f"threads: got {threads!r}; allowed: 0 (libx264 chooses) or a positive count")
        self.audio = None if waveform is None else _check_audio(waveform, sample_rate)
        tags = dict(metadata or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in tags.items()):
            raise H3InputError(f"metadata must map text keys to text values, got {sorted(map(repr, tags))[:4]}")
        self.encoder_used, self.encoder_reason = video_encoder(width, height, fps, encoder)
        if encoder == "auto" and (self.encoder_used, self.encoder_reason) not in _said:
            _said.add((self.encoder_used, self.encoder_reason))
            _log.info("writing H.264 with %s: %s", self.encoder_used, self.encoder_reason)
        self.path, self.fps, self.sample_rate = Path(path), fps, sample_rate
        self.size = (height, width)
        self.partial = self.path.with_name(f".{self.path.stem}.partial{self.path.suffix}")
        self.frames = 0
        self._container = av.open(str(self.partial), mode="w", format="mp4", options={"movflags": "use_metadata_tags"})
        try:
            for key, value in tags.items():
                self._container.metadata[key] = value
            self._video = self._container.add_stream(self.encoder_used, rate=fps)
            self._video.width, self._video.height = width, height
            self._video.pix_fmt = "yuv420p"
            if self.encoder_used == VIDEO_CODEC:
                self._video.options = {"crf": str(crf), "preset": preset, "threads": str(threads)}
                # PyAV asks for slice threads, which make libx264 split each frame; its own frame threads give the
                # same picture faster (bench/mp4_presets.py)
                self._video.codec_context.thread_type = "FRAME"
            else:
                self._video.options = {"rc": "vbr", "cq": str(crf + 1), "preset": "p5", "b": "0"}
            self._sound, self.audio_written = None, False
            if self.audio is not None:
                self._sound = self._container.add_stream(AUDIO_CODEC, rate=sample_rate)
                self._sound.layout = "stereo" if self.audio.shape[0] == 2 else "mono"
        except BaseException:
            self.abort()
            raise

    def write(self, frames: torch.Tensor, check_cancel: Callable[[], None] | None = None) -> None:
        """Encode ``frames`` ``[f, H, W, 3]`` (floats in [0, 1] or uint8), the next ones of the clip; ``check_cancel``
        is called between frames."""
        import av

        pixels = _frames_uint8(frames)
        if tuple(pixels.shape[1:3]) != self.size:
            raise H3InputError(
                f"frames: got {pixels.shape[2]}x{pixels.shape[1]}, the clip is {self.size[1]}x{self.size[0]}"
            )
        self.write_audio()
        for image in pixels:
            if check_cancel is not None:
                check_cancel()
            frame = av.VideoFrame.from_ndarray(image.numpy(), format="rgb24")
            frame.pts = self.frames
            frame.time_base = Fraction(1, self.fps)
            self._container.mux(self._video.encode(frame))
            self.frames += 1

    def write_audio(self) -> None:
        """Encode the soundtrack (nothing without one, or when already done). It always goes into the file before
        the first frame, whoever calls this (``write`` does; ``Mp4Worker`` does it as soon as it starts, while the
        frames are still being made), so every path writes the same bytes and the end of the file is video only."""
        import av

        if self._sound is None or self.audio_written:
            return
        self.audio_written = True
        planar = self.audio.numpy()
        for start in range(0, planar.shape[1], _AUDIO_CHUNK):
            chunk = av.AudioFrame.from_ndarray(
                planar[:, start : start + _AUDIO_CHUNK].copy(), format="fltp", layout=self._sound.layout.name
            )
            chunk.sample_rate = self.sample_rate
            chunk.pts = start
            chunk.time_base = Fraction(1, self.sample_rate)
            self._container.mux(self._sound.encode(chunk))
        self._container.mux(self._sound.encode())

    def close(self) -> Path:
        """Finish the video, close the file and give it its name; returns the path."""
        if self.frames == 0:
            self.abort()
            raise H3InputError("frames: there are no frames to write")
        try:
            self._container.mux(self._video.encode())
            self._container.close()
            os.replace(self.partial, self.path)
        finally:
            self.abort()
        return self.path

    def abort(self) -> None:
        """Stop writing and remove the temporary file (nothing once ``close`` has renamed it)."""
        try:
            self._container.close()
        except Exception:  # a container that failed mid-write (a full disk) may fail to close too
            pass
        self.partial.unlink(missing_ok=True)

    def __enter__(self) -> "Mp4Writer":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            self.abort()


def _threads_have_nice_values() -> bool:
    """Whether ``os.setpriority`` takes a thread's id and changes that thread alone: it must exist (none on
    Windows, whose threads also take no priority from the thread that starts them), and the kernel must be
    Linux's, where a thread id is a scheduling entity of its own. No call can tell the latter: on macOS and the
    BSDs ``setpriority`` takes process ids, and a thread's id there might name another process."""
    return hasattr(os, "setpriority") and hasattr(os, "getpriority") and sys.platform.startswith("linux")


def lower_this_threads_priority(niceness: int) -> int | None:
    """Add ``niceness`` to the calling thread's nice value where threads have their own (Linux: the threads it
    starts afterwards inherit it); returns the new value, or None where nothing changed (elsewhere the encoder
    runs at the process's priority)."""
    if niceness == 0 or not _threads_have_nice_values():
        return None
    thread = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(current + niceness, 19))
        return os.getpriority(os.PRIO_PROCESS, thread)
    except OSError:
        return None


class Mp4Worker:
    """An ``Mp4Writer`` fed by a thread of its own, so the clip is encoded while its next frames are made: ``put``
    hands over frames (which must not change afterwards) and returns at once; the soundtrack is encoded first,
    before any frame; ``close`` waits for the frames handed over (cancellable), finishes the file and returns its
    path (``tail_s``: how long that took, ``frames_behind``: how many frames handed over were not yet encoded
    when it was called);
    ``abort`` (or leaving a ``with`` block by an exception) stops and removes the file. A failure in the thread is
    raised by the next ``put`` or ``close``. On Linux the thread lowers its own scheduling priority by
    ``niceness`` before it opens the encoders, whose threads (libx264's) inherit it; 0 leaves it as it is."""

    def __init__(self, writer: Mp4Writer, niceness: int = ENCODER_NICENESS):
        if not isinstance(niceness, int) or niceness < 0:
            raise H3InputError(f"niceness: got {niceness!r}; allowed: 0 (as the process) or a positive increment")
        self.writer, self.niceness = writer, niceness
        self.tail_s: float | None = None
        self.frames_behind: int | None = None
        self._handed = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="h3-mp4-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        lower_this_threads_priority(self.niceness)
        try:
            self.writer.write_audio()
        except BaseException as exc:  # handed to the caller by the next put or close
            self._error = exc
        while (frames := self._queue.get()) is not None:
            if self._error is None and not self._stopping:
                try:
                    self.writer.write(frames, self._check_stopping)
                except BaseException as exc:
                    self._error = exc

    def _check_stopping(self) -> None:
        if self._stopping:
            raise InterruptedError("the mp4 was aborted")

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def put(self, frames: torch.Tensor) -> None:
        self._raise()
        self._handed += int(frames.shape[0])
        self._queue.put(frames)

    def close(self, check_cancel: Callable[[], None] | None = None) -> Path:
        """``check_cancel`` is called while the thread still encodes; whatever it raises stops and removes the
        file."""
        started = time.perf_counter()
        self.frames_behind = self._handed - self.writer.frames
        self._queue.put(None)
        while self._thread.is_alive():
            if check_cancel is not None:
                try:
                    check_cancel()
                except BaseException:
                    self.abort()
                    raise
            self._thread.join(0.05)
        try:
            self._raise()
        except BaseException:
            self.writer.abort()
            raise
        path = self.writer.close()
        self.tail_s = time.perf_counter() - started
        return path

    def abort(self) -> None:
        self._stopping = True
        self._queue.put(None)
        self._thread.join()
        self.writer.abort()

    def __enter__(self) -> "Mp4Worker":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            self.abort()


def write_mp4(
    path: str | Path,
    frames: torch.Tensor,
    waveform: torch.Tensor | None = None,
    sample_rate: int = 32000,
    *,
    fps: int = 24,
    crf: int = 18,
    preset: str = DEFAULT_PRESET,
    threads: int = 0,
    check_cancel: Callable[[], None] | None = None,
    metadata: dict[str, str] | None = None,
    encoder: str = VIDEO_CODEC,
) -> Path:
    """Write ``frames`` ``[F, H, W, 3]`` (floats in [0, 1] or uint8) and, when given, ``waveform`` as one mp4
    (``Mp4Writer``, whose arguments these are). ``check_cancel`` is called between frames; whatever it raises
    stops the write and removes the partial file, as does any failure (a full disk)."""
    pixels = _frames_uint8(frames)
    with Mp4Writer(
        path,
        int(pixels.shape[2]),
        int(pixels.shape[1]),
        fps=fps,
        crf=crf,
        preset=preset,
        threads=threads,
        waveform=waveform,
        sample_rate=sample_rate,
        metadata=metadata,
        encoder=encoder,
    ) as writer:
        writer.write(pixels, check_cancel)
        return writer.close()


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
