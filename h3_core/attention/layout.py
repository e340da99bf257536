"""Packed-sequence geometry and the VDN-H3 window rule.

A packed H3 sequence is one padless batch of ``T`` rows: global rows (text, keyframe conditioning,
references, audio) and one contiguous video span of ``F`` frames × ``S`` tokens, t-major. The window
rule keeps a (query, key) pair unless BOTH rows are video rows and the key's frame lies outside the
query frame's window; anchors add frames 0 and F-1 as keys for every video query ("columns"), as
queries over every key ("rows"), or both.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import H3InputError

__all__ = [
    "ANCHOR_MODES",
    "Span",
    "SequenceLayout",
    "WindowSpec",
    "window_bounds",
    "is_full_cover",
    "anchor_frames",
    "clamped_window",
]

ANCHOR_MODES = ("none", "rows", "columns", "both")


def _check_count(field: str, value, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise H3InputError(f"{field} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class Span:
    """A named run of packed rows ``[start, start + length)``."""

    name: str
    start: int
    length: int

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise H3InputError(f"span name must be a non-empty string, got {self.name!r}")
        _check_count(f"span '{self.name}' start", self.start)
        _check_count(f"span '{self.name}' length", self.length)

    @property
    def stop(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class SequenceLayout:
    """Where the global rows and the video frames sit in a packed sequence.

    Args:
        seq_len: total rows ``T``.
        video: the video span; its length must be ``num_frames * tokens_per_frame``.
        num_frames: latent frames ``F`` in the video span (0 when there is no video).
        tokens_per_frame: rows per frame ``S``; must equal ``frame_h * frame_w``.
        frame_h, frame_w: the token grid of one frame.
        global_spans: every other run of rows (text, conditioning, references, audio), dense both ways.

    The spans together must cover ``[0, T)`` exactly once; empty spans are allowed and ignored.
    """

    seq_len: int
    video: Span
    num_frames: int
    tokens_per_frame: int
    frame_h: int
    frame_w: int
    global_spans: tuple[Span, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "global_spans", tuple(self.global_spans))
        _check_count("seq_len", self.seq_len)
        _check_count("num_frames", self.num_frames)
        _check_count("frame_h", self.frame_h, 1)
        _check_count("frame_w", self.frame_w, 1)
        _check_count("tokens_per_frame", self.tokens_per_frame, 1)
        if not isinstance(self.video, Span):
            raise H3InputError(f"video must be a Span, got {type(self.video).__name__}")
        if self.frame_h * self.frame_w != self.tokens_per_frame:
            raise H3InputError(
                f"tokens_per_frame={self.tokens_per_frame} does not match the frame grid "
                f"frame_h × frame_w = {self.frame_h} × {self.frame_w} = {self.frame_h * self.frame_w}"
            )
        expected = self.num_frames * self.tokens_per_frame
        if self.video.length != expected:
            raise H3InputError(
                f"video span '{self.video.name}' has {self.video.length} rows but num_frames × "
                f"tokens_per_frame = {self.num_frames} × {self.tokens_per_frame} = {expected}"
            )
        names = [s.name for s in self.global_spans] + [self.video.name]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise H3InputError(f"span names must be unique; repeated: {repeated}")
        self._check_cover()

    def _check_cover(self) -> None:
        spans = sorted((s for s in (*self.global_spans, self.video) if s.length), key=lambda s: s.start)
        cursor, previous = 0, None
        for span in spans:
            if span.start < cursor:
                raise H3InputError(
                    f"spans '{previous.name}' [{previous.start}, {previous.stop}) and "
                    f"'{span.name}' [{span.start}, {span.stop}) overlap"
                )
            if span.start > cursor:
                raise H3InputError(
                    f"rows [{cursor}, {span.start}) of seq_len={self.seq_len} belong to no span "
                    f"(next span: '{span.name}' starts at {span.start})"
                )
            cursor, previous = span.stop, span
        if cursor != self.seq_len:
            if cursor > self.seq_len:
                raise H3InputError(f"span '{previous.name}' ends at row {cursor}, past seq_len={self.seq_len}")
            raise H3InputError(f"rows [{cursor}, {self.seq_len}) of seq_len={self.seq_len} belong to no span")

    @classmethod
    def packed(
        cls,
        *,
        frames: int,
        frame_h: int,
        frame_w: int,
        text: int = 0,
        conditioning: int = 0,
        references: tuple[int, ...] = (),
        audio: int = 0,
    ) -> "SequenceLayout":
        """The H3 packing ``[text | conditioning | reference_i ... | audio | video]``."""
        spans, cursor = [], 0
        for name, length in (
            ("text", text),
            ("conditioning", conditioning),
            *((f"reference_{i}", n) for i, n in enumerate(references)),
            ("audio", audio),
        ):
            spans.append(Span(name, cursor, length))
            cursor += length
        _check_count("frames", frames)
        _check_count("frame_h", frame_h, 1)
        _check_count("frame_w", frame_w, 1)
        video_rows = frames * frame_h * frame_w
        return cls(
            seq_len=cursor + video_rows,
            video=Span("video", cursor, video_rows),
            num_frames=frames,
            tokens_per_frame=frame_h * frame_w,
            frame_h=frame_h,
            frame_w=frame_w,
            global_spans=tuple(spans),
        )

    @property
    def video_start(self) -> int:
        return self.video.start

    @property
    def video_stop(self) -> int:
        return self.video.stop

    @property
    def num_global_rows(self) -> int:
        return self.seq_len - self.video.length

    def span(self, name: str) -> Span:
        for s in (*self.global_spans, self.video):
            if s.name == name:
                return s
        raise KeyError(name)

    def frame_rows(self, frame: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of video frame ``frame``."""
        start = self.video.start + frame * self.tokens_per_frame
        return start, start + self.tokens_per_frame

    def global_ranges(self) -> tuple[tuple[int, int], ...]:
        """The global rows as maximal contiguous ``[start, stop)`` runs, in order."""
        runs: list[tuple[int, int]] = []
        if self.video.start > 0:
            runs.append((0, self.video.start))
        if self.video.stop < self.seq_len:
            runs.append((self.video.stop, self.seq_len))
        return tuple(runs)


@dataclass(frozen=True)
class WindowSpec:
    """The softmax window of the hybrid block.

    Args:
        radius: chunks (or frames, when ``chunk == 0``) seen on each side.
        chunk: frames per chunk; 0 means per-frame windows ``[t - radius, t + radius]``.
        anchors: ``none | rows | columns | both`` — frames 0 and F-1 as extra keys and/or dense queries.
    """

    radius: int
    chunk: int = 0
    anchors: str = "none"

    def __post_init__(self):
        _check_count("window radius", self.radius)
        _check_count("window chunk", self.chunk)
        if self.anchors not in ANCHOR_MODES:
            raise H3InputError(f"window anchors must be one of {list(ANCHOR_MODES)}, got {self.anchors!r}")

    @property
    def anchor_rows(self) -> bool:
        return self.anchors in ("rows", "both")

    @property
    def anchor_columns(self) -> bool:
        return self.anchors in ("columns", "both")


def window_bounds(num_frames: int, radius: int, chunk: int) -> tuple[tuple[int, int], ...]:
    """Each frame's window ``(lo, hi)``, inclusive and unclamped.

    ``chunk == 0``: frame t sees ``[t - radius, t + radius]``. ``chunk == K``: every frame of chunk
    ``c = t // K`` sees ``[(c - radius) * K, (c + radius + 1) * K - 1]``; the last chunk may be short.
    """
    _check_count("num_frames", num_frames)
    _check_count("window radius", radius)
    _check_count("window chunk", chunk)
    if chunk == 0:
        return tuple((t - radius, t + radius) for t in range(num_frames))
    return tuple(((t // chunk - radius) * chunk, (t // chunk + radius + 1) * chunk - 1) for t in range(num_frames))


def is_full_cover(bounds: tuple[tuple[int, int], ...], num_frames: int) -> bool:
    """True when every frame's window spans all frames, so the window rule keeps every pair."""
    return all(lo <= 0 and hi >= num_frames - 1 for lo, hi in bounds)


def anchor_frames(num_frames: int) -> tuple[int, ...]:
    """The anchor frames 0 and F-1 (one frame when F == 1, none when F == 0)."""
    return tuple(sorted({0, num_frames - 1})) if num_frames else ()


def clamped_window(bounds: tuple[int, int], num_frames: int) -> tuple[int, int]:
    lo, hi = bounds
    return max(lo, 0), min(hi, num_frames - 1)
