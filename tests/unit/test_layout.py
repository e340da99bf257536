"""Packed-sequence geometry and the window bounds rule (h3_core.attention.layout)."""

import re

import pytest

from h3_core.attention.layout import (
    ANCHOR_MODES,
    SequenceLayout,
    Span,
    WindowSpec,
    anchor_frames,
    clamped_window,
    is_full_cover,
    window_bounds,
)
from h3_core.errors import H3InputError


def rule_bounds(num_frames, radius, chunk):
    """The window rule written out independently: inclusive, unclamped (lo, hi) per frame."""
    bounds = []
    for t in range(num_frames):
        if chunk == 0:
            lo, hi = t - radius, t + radius
        else:
            c = t // chunk
            lo, hi = (c - radius) * chunk, (c + radius + 1) * chunk - 1
        bounds.append((lo, hi))
    return tuple(bounds)


def test_h3_input_error_is_a_value_error():
    assert issubclass(H3InputError, ValueError)


# --- window_bounds --------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [0, 1, 2, 3, 5, 7], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("radius", [0, 1, 2, 3], ids=lambda r: f"r{r}")
@pytest.mark.parametrize("num_frames", [0, 1, 2, 5, 10, 12, 13, 31], ids=lambda f: f"F{f}")
def test_window_bounds_follow_the_rule(num_frames, radius, chunk):
    assert window_bounds(num_frames, radius, chunk) == rule_bounds(num_frames, radius, chunk)


def test_window_bounds_per_frame_explicit():
    assert window_bounds(5, 1, 0) == ((-1, 1), (0, 2), (1, 3), (2, 4), (3, 5))
    assert window_bounds(3, 0, 0) == ((0, 0), (1, 1), (2, 2))


def test_window_bounds_chunked_explicit():
    # chunk 3, radius 1, F=8 (last chunk short: frames 6, 7)
    assert window_bounds(8, 1, 3) == (
        (-3, 5),
        (-3, 5),
        (-3, 5),
        (0, 8),
        (0, 8),
        (0, 8),
        (3, 11),
        (3, 11),
    )


def test_release_window_c1_on_102_frames():
    bounds = window_bounds(102, 1, 5)
    assert len(bounds) == 102
    # chunk 0 (frames 0-4) sees frames 0-9 after clamping
    for t in range(5):
        assert bounds[t] == (-5, 9)
        assert clamped_window(bounds[t], 102) == (0, 9)
    # the last chunk, chunk 20, is short: frames 100-101, seeing 95-101 after clamping
    assert bounds[100] == bounds[101] == (95, 109)
    assert clamped_window(bounds[101], 102) == (95, 101)
    # a middle chunk: chunk 7 = frames 35-39 sees chunks 6..8 = frames 30-44
    assert all(bounds[t] == (30, 44) for t in range(35, 40))
    assert len(set(bounds)) == 21  # one window per chunk


@pytest.mark.parametrize("num_frames", range(1, 17), ids=lambda f: f"F{f}")
def test_full_cover_c1_iff_at_most_10_frames(num_frames):
    assert is_full_cover(window_bounds(num_frames, 1, 5), num_frames) == (num_frames <= 10)


@pytest.mark.parametrize("radius", [0, 1, 2, 3], ids=lambda r: f"r{r}")
@pytest.mark.parametrize("num_frames", range(1, 9), ids=lambda f: f"F{f}")
def test_full_cover_per_frame_window(num_frames, radius):
    # frame 0 sees up to frame r, so every window covers all frames iff F - 1 <= r
    assert is_full_cover(window_bounds(num_frames, radius, 0), num_frames) == (num_frames - 1 <= radius)


def test_full_cover_of_no_frames_is_vacuous():
    assert is_full_cover(window_bounds(0, 1, 5), 0)


def test_anchor_frames():
    assert anchor_frames(0) == ()
    assert anchor_frames(1) == (0,)
    assert anchor_frames(2) == (0, 1)
    assert anchor_frames(9) == (0, 8)


@pytest.mark.parametrize(
    "args, message",
    [
        ((-1, 1, 0), "num_frames must be an integer >= 0, got -1"),
        ((4, -2, 0), "window radius must be an integer >= 0, got -2"),
        ((4, 1, -5), "window chunk must be an integer >= 0, got -5"),
        ((4.0, 1, 0), "num_frames must be an integer >= 0, got 4.0"),
        ((4, 1.5, 0), "window radius must be an integer >= 0, got 1.5"),
        ((4, 1, True), "window chunk must be an integer >= 0, got True"),
    ],
    ids=["neg-frames", "neg-radius", "neg-chunk", "float-frames", "float-radius", "bool-chunk"],
)
def test_window_bounds_refuses(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        window_bounds(*args)


# --- WindowSpec -----------------------------------------------------------------------------------


@pytest.mark.parametrize("anchors", ANCHOR_MODES)
def test_window_spec_anchor_flags(anchors):
    w = WindowSpec(radius=1, chunk=5, anchors=anchors)
    assert w.anchor_rows == (anchors in ("rows", "both"))
    assert w.anchor_columns == (anchors in ("columns", "both"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(radius=1, anchors="diagonal"),
            "window anchors must be one of ['none', 'rows', 'columns', 'both'], got 'diagonal'",
        ),
        (dict(radius=1, anchors="Both"), "got 'Both'"),
        (dict(radius=-1), "window radius must be an integer >= 0, got -1"),
        (dict(radius=1, chunk=-3), "window chunk must be an integer >= 0, got -3"),
        (dict(radius=1, chunk=2.0), "window chunk must be an integer >= 0, got 2.0"),
        (dict(radius="1"), "window radius must be an integer >= 0, got '1'"),
    ],
    ids=["bad-anchors", "anchors-case", "neg-radius", "neg-chunk", "float-chunk", "str-radius"],
)
def test_window_spec_refuses(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        WindowSpec(**kwargs)


# --- SequenceLayout.packed ------------------------------------------------------------------------


def test_packed_spans_in_h3_order():
    lay = SequenceLayout.packed(frames=3, frame_h=2, frame_w=3, text=4, conditioning=2, references=(5, 3), audio=6)
    expect = {
        "text": (0, 4),
        "conditioning": (4, 6),
        "reference_0": (6, 11),
        "reference_1": (11, 14),
        "audio": (14, 20),
        "video": (20, 38),
    }
    for name, (a, b) in expect.items():
        s = lay.span(name)
        assert (s.start, s.stop) == (a, b), name
    assert lay.seq_len == 38
    assert lay.num_frames == 3 and lay.tokens_per_frame == 6
    assert (lay.frame_h, lay.frame_w) == (2, 3)
    assert (lay.video_start, lay.video_stop) == (20, 38)
    assert lay.num_global_rows == 20
    assert [lay.frame_rows(f) for f in range(3)] == [(20, 26), (26, 32), (32, 38)]
    assert lay.global_ranges() == ((0, 20),)
    assert [s.name for s in lay.global_spans] == ["text", "conditioning", "reference_0", "reference_1", "audio"]
    with pytest.raises(KeyError):
        lay.span("reference_2")


def test_packed_video_only():
    lay = SequenceLayout.packed(frames=4, frame_h=1, frame_w=2)
    assert lay.seq_len == 8
    assert (lay.video_start, lay.video_stop) == (0, 8)
    assert lay.num_global_rows == 0
    assert lay.global_ranges() == ()


def test_packed_globals_only():
    lay = SequenceLayout.packed(frames=0, frame_h=2, frame_w=2, text=5, audio=3)
    assert lay.seq_len == 8
    assert lay.video.length == 0
    assert lay.num_global_rows == 8
    assert lay.global_ranges() == ((0, 8),)


def test_packed_skips_empty_spans():
    lay = SequenceLayout.packed(frames=2, frame_h=1, frame_w=1, text=0, conditioning=3, audio=0)
    assert (lay.span("conditioning").start, lay.span("conditioning").stop) == (0, 3)
    assert lay.span("text").length == 0 and lay.span("audio").length == 0
    assert (lay.video_start, lay.seq_len) == (3, 5)


def test_direct_layout_with_globals_after_video():
    lay = SequenceLayout(
        seq_len=20,
        video=Span("video", 4, 12),
        num_frames=3,
        tokens_per_frame=4,
        frame_h=2,
        frame_w=2,
        global_spans=(Span("text", 0, 4), Span("audio", 16, 4)),
    )
    assert lay.global_ranges() == ((0, 4), (16, 20))
    assert lay.num_global_rows == 8
    assert lay.frame_rows(2) == (12, 16)


def test_layout_is_hashable_and_compares_by_value():
    a = SequenceLayout.packed(frames=3, frame_h=2, frame_w=2, text=4)
    b = SequenceLayout.packed(frames=3, frame_h=2, frame_w=2, text=4)
    assert a == b and hash(a) == hash(b)
    assert a != SequenceLayout.packed(frames=3, frame_h=2, frame_w=2, text=5)


# --- SequenceLayout refusals ----------------------------------------------------------------------


def _layout(**overrides):
    """A valid direct layout ([text 0:4 | video 4:10], 3 frames of 1x2), with overrides."""
    kwargs = dict(
        seq_len=10,
        video=Span("video", 4, 6),
        num_frames=3,
        tokens_per_frame=2,
        frame_h=1,
        frame_w=2,
        global_spans=(Span("text", 0, 4),),
    )
    kwargs.update(overrides)
    return SequenceLayout(**kwargs)


def test_base_layout_is_valid():
    assert _layout().seq_len == 10


REFUSALS = [
    (
        "overlap",
        dict(global_spans=(Span("text", 0, 5),)),
        "spans 'text' [0, 5) and 'video' [4, 10) overlap",
    ),
    (
        "overlap-globals",
        dict(
            seq_len=13,
            video=Span("video", 7, 6),
            global_spans=(Span("text", 0, 4), Span("audio", 3, 4)),
        ),
        "spans 'text' [0, 4) and 'audio' [3, 7) overlap",
    ),
    (
        "gap-inside",
        dict(global_spans=(Span("text", 0, 3),)),
        "rows [3, 4) of seq_len=10 belong to no span (next span: 'video' starts at 4)",
    ),
    (
        "gap-at-start",
        dict(global_spans=(Span("text", 1, 3),)),
        "rows [0, 1) of seq_len=10 belong to no span (next span: 'text' starts at 1)",
    ),
    (
        "gap-at-end",
        dict(seq_len=12),
        "rows [10, 12) of seq_len=12 belong to no span",
    ),
    (
        "nothing-covers",
        dict(seq_len=5, video=Span("video", 0, 0), num_frames=0, global_spans=()),
        "rows [0, 5) of seq_len=5 belong to no span",
    ),
    (
        "past-seq-len",
        dict(seq_len=8),
        "span 'video' ends at row 10, past seq_len=8",
    ),
    (
        "video-length",
        dict(seq_len=11, video=Span("video", 4, 7)),
        "video span 'video' has 7 rows but num_frames × tokens_per_frame = 3 × 2 = 6",
    ),
    (
        "video-length-frames",
        dict(num_frames=4),
        "video span 'video' has 6 rows but num_frames × tokens_per_frame = 4 × 2 = 8",
    ),
    (
        "tokens-per-frame",
        dict(tokens_per_frame=4, frame_h=1, frame_w=2),
        "tokens_per_frame=4 does not match the frame grid frame_h × frame_w = 1 × 2 = 2",
    ),
    (
        "tokens-per-frame-grid",
        dict(frame_h=2, frame_w=2),
        "tokens_per_frame=2 does not match the frame grid frame_h × frame_w = 2 × 2 = 4",
    ),
    ("neg-seq-len", dict(seq_len=-1), "seq_len must be an integer >= 0, got -1"),
    ("float-seq-len", dict(seq_len=10.0), "seq_len must be an integer >= 0, got 10.0"),
    ("neg-frames", dict(num_frames=-3), "num_frames must be an integer >= 0, got -3"),
    ("bool-frames", dict(num_frames=True), "num_frames must be an integer >= 0, got True"),
    ("zero-frame-h", dict(frame_h=0), "frame_h must be an integer >= 1, got 0"),
    ("str-frame-w", dict(frame_w="2"), "frame_w must be an integer >= 1, got '2'"),
    ("zero-tokens", dict(tokens_per_frame=0), "tokens_per_frame must be an integer >= 1, got 0"),
    ("video-not-span", dict(video=(4, 6)), "video must be a Span, got tuple"),
    (
        "duplicate-global",
        dict(global_spans=(Span("text", 0, 2), Span("text", 2, 2))),
        "span names must be unique; repeated: ['text']",
    ),
    (
        "duplicate-video-name",
        dict(global_spans=(Span("video", 0, 4),)),
        "span names must be unique; repeated: ['video']",
    ),
]


@pytest.mark.parametrize("overrides, message", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_layout_refuses(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        _layout(**overrides)
    assert isinstance(info.value, H3InputError)


@pytest.mark.parametrize(
    "args, message",
    [
        (("text", -1, 3), "span 'text' start must be an integer >= 0, got -1"),
        (("text", 0, -3), "span 'text' length must be an integer >= 0, got -3"),
        (("text", 0, 2.5), "span 'text' length must be an integer >= 0, got 2.5"),
        (("text", "0", 2), "span 'text' start must be an integer >= 0, got '0'"),
        (("", 0, 2), "span name must be a non-empty string, got ''"),
        ((None, 0, 2), "span name must be a non-empty string, got None"),
    ],
    ids=["neg-start", "neg-length", "float-length", "str-start", "empty-name", "none-name"],
)
def test_span_refuses(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Span(*args)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(frames=-2, frame_h=1, frame_w=1), "frames must be an integer >= 0, got -2"),
        (dict(frames=2, frame_h=0, frame_w=1), "frame_h must be an integer >= 1, got 0"),
        (dict(frames=2, frame_h=1, frame_w=1.5), "frame_w must be an integer >= 1, got 1.5"),
        (dict(frames=2, frame_h=1, frame_w=1, text=-4), "span 'text' length must be an integer >= 0, got -4"),
        (dict(frames=2, frame_h=1, frame_w=1, audio=-1), "span 'audio' length must be an integer >= 0, got -1"),
        (
            dict(frames=2, frame_h=1, frame_w=1, references=(3, -1)),
            "span 'reference_1' length must be an integer >= 0, got -1",
        ),
    ],
    ids=["neg-frames", "zero-frame-h", "float-frame-w", "neg-text", "neg-audio", "neg-reference"],
)
def test_packed_refuses(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SequenceLayout.packed(**kwargs)


def test_empty_spans_anywhere_are_ignored():
    lay = _layout(global_spans=(Span("text", 0, 4), Span("audio", 99, 0)))
    assert lay.seq_len == 10
