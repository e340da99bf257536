"""The VDN-H3 window softmax (h3_core.attention.window_softmax) on CPU: every backend against ``ref`` and
``ref`` against a brute-force masked softmax built from the rule written out independently here."""

import re
import zlib
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from h3_core.attention import (
    ANCHOR_MODES,
    BACKENDS,
    SequenceLayout,
    Span,
    WindowRun,
    WindowSpec,
    force_window_backend,
    resolve_window_backend,
    window_softmax,
)
from h3_core.attention.window_decomposed import (
    WindowBatch,
    _stage_slots,
    plan_decomposed,
    window_softmax_decomposed,
)
from h3_core.errors import H3InputError

COMPARED = ("decomposed", "flex", "auto")
TOL64 = 1e-10


# --- the rule, independently ----------------------------------------------------------------------


def brute_keep(layout, window):
    """Dense [T, T] keep-mask of the window rule."""
    T, F, S = layout.seq_len, layout.num_frames, layout.tokens_per_frame
    r, K = window.radius, window.chunk
    row_frame = torch.full((T,), -1, dtype=torch.long)
    v0 = layout.video.start
    for f in range(F):
        row_frame[v0 + f * S : v0 + (f + 1) * S] = f
    anchors = {0, F - 1} if F else set()
    col_anchor = window.anchors in ("columns", "both")
    row_anchor = window.anchors in ("rows", "both")
    keep = torch.ones(T, T, dtype=torch.bool)
    for qrow in range(T):
        t = int(row_frame[qrow])
        if t < 0:  # global query: dense
            continue
        if row_anchor and t in anchors:  # anchor frame as query: dense
            continue
        if K == 0:
            lo, hi = t - r, t + r
        else:
            c = t // K
            lo, hi = (c - r) * K, (c + r + 1) * K - 1
        lo, hi = max(lo, 0), min(hi, F - 1)
        allowed = [lo <= f <= hi or (col_anchor and f in anchors) for f in range(F)]
        for krow in range(v0, v0 + F * S):
            keep[qrow, krow] = allowed[int(row_frame[krow])]
    return keep


def brute_attention(q, k, v, keep, scale):
    """Masked softmax attention in float64, [T, H, D] token-major."""
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v.double())


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def qkv(T, H, D, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(T, H, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))


# --- geometries -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    layout: SequenceLayout
    window: WindowSpec
    H: int = 2
    D: int = 8

    @property
    def seed(self):
        return zlib.crc32(self.id.encode())


def packed(**kw):
    return SequenceLayout.packed(**kw)


def _cases():
    cases = []
    # grid: radius x chunk x anchors on 12 frames (12 = 2*5 + 2: chunk 5's last chunk is short)
    base = packed(frames=12, frame_h=2, frame_w=2, text=5, audio=3)
    for radius in (0, 1, 2):
        for chunk in (0, 1, 3, 5):
            for anchors in ANCHOR_MODES:
                cases.append(Case(f"F12-r{radius}-c{chunk}-{anchors}", base, WindowSpec(radius, chunk, anchors)))
    # 13 frames in chunks of 3: last chunk is one frame
    f13 = packed(frames=13, frame_h=1, frame_w=3, text=4, audio=2)
    for anchors in ANCHOR_MODES:
        cases.append(Case(f"F13-r1-c3-{anchors}", f13, WindowSpec(1, 3, anchors)))
    # no global rows at all
    video_only = packed(frames=9, frame_h=2, frame_w=3)
    for anchors in ANCHOR_MODES:
        cases.append(Case(f"no-globals-r1-c0-{anchors}", video_only, WindowSpec(1, 0, anchors)))
    cases.append(Case("no-globals-r1-c3-columns", video_only, WindowSpec(1, 3, "columns")))
    cases.append(Case("no-globals-r0-c2-rows", video_only, WindowSpec(0, 2, "rows")))
    # only global rows
    only_globals = packed(frames=0, frame_h=2, frame_w=2, text=7, audio=4)
    cases.append(Case("only-globals-r1-c5-both", only_globals, WindowSpec(1, 5, "both")))
    cases.append(Case("only-globals-r0-c0-none", only_globals, WindowSpec(0, 0, "none")))
    # full cover: every window spans every frame
    cases.append(
        Case("full-cover-F4-r1-c5-both", packed(frames=4, frame_h=2, frame_w=2, text=3), WindowSpec(1, 5, "both"))
    )
    cases.append(
        Case("full-cover-F4-r1-c5-none", packed(frames=4, frame_h=2, frame_w=2, text=3), WindowSpec(1, 5, "none"))
    )
    cases.append(
        Case(
            "full-cover-F10-r1-c5-both",
            packed(frames=10, frame_h=1, frame_w=2, text=3, audio=2),
            WindowSpec(1, 5, "both"),
        )
    )
    cases.append(
        Case("F11-r1-c5-both", packed(frames=11, frame_h=1, frame_w=2, text=3, audio=2), WindowSpec(1, 5, "both"))
    )
    # a single frame
    one = packed(frames=1, frame_h=2, frame_w=3, text=4)
    cases.append(Case("single-frame-r0-none", one, WindowSpec(0, 0, "none")))
    cases.append(Case("single-frame-r0-both", one, WindowSpec(0, 0, "both")))
    cases.append(Case("single-frame-no-globals", packed(frames=1, frame_h=2, frame_w=2), WindowSpec(0, 0, "columns")))
    # two / three frames with column anchors: some windows are nothing but anchors
    cases.append(Case("F2-r0-columns", packed(frames=2, frame_h=2, frame_w=2, text=3), WindowSpec(0, 0, "columns")))
    cases.append(Case("F3-r0-columns", packed(frames=3, frame_h=2, frame_w=2, text=3), WindowSpec(0, 0, "columns")))
    cases.append(Case("F3-r0-rows", packed(frames=3, frame_h=2, frame_w=2, text=3), WindowSpec(0, 0, "rows")))
    # H3-like packings
    t2va = packed(frames=11, frame_h=3, frame_w=3, text=12, audio=6)
    cases.append(Case("T2VA-r1-c5-both", t2va, WindowSpec(1, 5, "both"), H=3, D=16))
    cases.append(Case("T2VA-r2-c0-columns", t2va, WindowSpec(2, 0, "columns"), H=3, D=16))
    i2va = packed(frames=7, frame_h=2, frame_w=2, text=6, conditioning=4, audio=3)
    cases.append(Case("I2VA-r0-c0-rows", i2va, WindowSpec(0, 0, "rows")))
    ref2va = packed(frames=8, frame_h=2, frame_w=3, text=9, references=(6, 4, 6), audio=5)
    cases.append(Case("Ref2VA-r1-c3-both", ref2va, WindowSpec(1, 3, "both"), H=3, D=16))
    cases.append(Case("Ref2VA-r1-c3-columns", ref2va, WindowSpec(1, 3, "columns")))
    cases.append(Case("Ref2VA-r2-c0-rows", ref2va, WindowSpec(2, 0, "rows")))
    cases.append(Case("Ref2VA-r0-c1-none", ref2va, WindowSpec(0, 1, "none")))
    # global rows after the video span
    F, S = 9, 4
    around = SequenceLayout(
        seq_len=5 + F * S + 7,
        video=Span("video", 5, F * S),
        num_frames=F,
        tokens_per_frame=S,
        frame_h=2,
        frame_w=2,
        global_spans=(Span("text", 0, 5), Span("audio", 5 + F * S, 7)),
    )
    after = SequenceLayout(
        seq_len=F * S + 6,
        video=Span("video", 0, F * S),
        num_frames=F,
        tokens_per_frame=S,
        frame_h=2,
        frame_w=2,
        global_spans=(Span("audio", F * S, 4), Span("text", F * S + 4, 2)),
    )
    for anchors in ANCHOR_MODES:
        cases.append(Case(f"globals-around-video-r1-c2-{anchors}", around, WindowSpec(1, 2, anchors)))
    cases.append(Case("globals-after-video-r1-c0-none", after, WindowSpec(1, 0, "none")))
    cases.append(Case("globals-after-video-r0-c3-both", after, WindowSpec(0, 3, "both")))
    # a few hundred rows
    big = packed(frames=20, frame_h=3, frame_w=4, text=16, audio=8)
    cases.append(Case("T264-r1-c5-both", big, WindowSpec(1, 5, "both"), H=3, D=16))
    cases.append(Case("T264-r1-c0-none", big, WindowSpec(1, 0, "none"), H=3, D=16))
    return cases


CASES = _cases()
CASE_IDS = [c.id for c in CASES]
assert len(set(CASE_IDS)) == len(CASE_IDS)


def _inputs(case, dtype=torch.float64):
    return qkv(case.layout.seq_len, case.H, case.D, case.seed, dtype)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_ref_matches_brute_force(case):
    q, k, v = _inputs(case)
    out = window_softmax(q, k, v, case.layout, case.window, backend="ref")
    assert out.shape == q.shape and out.dtype == torch.float64
    want = brute_attention(q, k, v, brute_keep(case.layout, case.window), case.D**-0.5)
    assert rel_err(out, want) <= TOL64


@pytest.mark.parametrize("backend", COMPARED)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_backend_matches_ref(case, backend):
    q, k, v = _inputs(case)
    ref = window_softmax(q, k, v, case.layout, case.window, backend="ref")
    out = window_softmax(q, k, v, case.layout, case.window, backend=backend)
    assert out.shape == q.shape and out.dtype == torch.float64
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL64


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_decomposed_matches_ref(case):
    q, k, v = _inputs(case)
    ref = window_softmax(q, k, v, case.layout, case.window, backend="ref")
    out = window_softmax_decomposed(q, k, v, case.layout, case.window, case.D**-0.5)
    assert out.shape == q.shape and out.dtype == torch.float64
    assert rel_err(out, ref) <= TOL64


def test_brute_keep_mask_spot_checks():
    """The test's own rule on a tiny case, written out by hand."""
    lay = packed(frames=4, frame_h=1, frame_w=1, text=1)  # row 0 text, rows 1..4 = frames 0..3
    keep = brute_keep(lay, WindowSpec(0, 0, "none"))
    assert keep[0].all() and keep[:, 0].all()
    assert keep[1:, 1:].equal(torch.eye(4, dtype=torch.bool))
    keep = brute_keep(lay, WindowSpec(0, 0, "columns"))
    assert keep[2, 1:].tolist() == [True, True, False, True]
    keep = brute_keep(lay, WindowSpec(0, 0, "rows"))
    assert keep[1].all() and keep[4].all() and keep[2, 1:].tolist() == [False, True, False, False]
    keep = brute_keep(lay, WindowSpec(0, 2, "none"))  # chunks {0,1}, {2,3}
    assert keep[1:, 1:].tolist() == [[True, True, False, False]] * 2 + [[False, False, True, True]] * 2


# --- property test over random geometries ---------------------------------------------------------


@st.composite
def geometries(draw):
    frames = draw(st.integers(0, 14))
    frame_h, frame_w = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    n_global = draw(st.integers(0, 12))
    text = draw(st.integers(0, n_global))
    conditioning = draw(st.integers(0, n_global - text))
    audio = n_global - text - conditioning
    assume(frames > 0 or n_global > 0)  # a zero-row sequence is not a use case
    layout = SequenceLayout.packed(
        frames=frames, frame_h=frame_h, frame_w=frame_w, text=text, conditioning=conditioning, audio=audio
    )
    window = WindowSpec(
        radius=draw(st.integers(0, 3)), chunk=draw(st.integers(0, 6)), anchors=draw(st.sampled_from(ANCHOR_MODES))
    )
    heads = draw(st.sampled_from([2, 3]))
    seed = draw(st.integers(0, 2**31 - 1))
    return layout, window, heads, seed


@pytest.mark.parametrize("backend", ["decomposed", "flex"])
@given(geometry=geometries())
@example(geometry=(packed(frames=5, frame_h=1, frame_w=2), WindowSpec(1, 0, "none"), 2, 0))
@example(geometry=(packed(frames=6, frame_h=2, frame_w=1, audio=3), WindowSpec(0, 2, "columns"), 2, 1))
@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_geometries_match_ref(backend, geometry):
    layout, window, heads, seed = geometry
    q, k, v = qkv(layout.seq_len, heads, 8, seed)
    ref = window_softmax(q, k, v, layout, window, backend="ref")
    out = window_softmax(q, k, v, layout, window, backend=backend)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL64


# --- what ran -------------------------------------------------------------------------------------

WINDOWED = Case("windowed", packed(frames=12, frame_h=2, frame_w=2, text=5, audio=3), WindowSpec(1, 3, "both"))
FULL = Case("full", packed(frames=4, frame_h=2, frame_w=2, text=3), WindowSpec(1, 5, "both"))


def test_backend_names():
    assert BACKENDS == ("auto", "decomposed", "flex", "ref")


def test_auto_resolves_to_ref_on_cpu():
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        assert resolve_window_backend("auto", torch.device("cpu"), dtype, 8) == "ref"
    for name in ("ref", "flex", "decomposed"):
        assert resolve_window_backend(name, torch.device("cpu"), torch.float32, 8) == name


@pytest.mark.parametrize(
    "backend, resolved",
    [("auto", "ref"), ("ref", "ref"), ("flex", "flex"), ("decomposed", "decomposed")],
)
def test_each_call_reports_what_ran(backend, resolved):
    q, k, v = _inputs(WINDOWED)
    runs = []
    window_softmax(q, k, v, WINDOWED.layout, WINDOWED.window, backend=backend, on_run=runs.append)
    (run,) = runs
    assert isinstance(run, WindowRun)
    assert (run.requested, run.backend) == (backend, resolved)
    if resolved == "flex":
        assert run.kernel == "eager"
    if resolved == "decomposed":
        assert run.kernel == "math"


def test_full_cover_runs_one_dense_call():
    q, k, v = _inputs(FULL)
    runs = []
    window_softmax(q, k, v, FULL.layout, FULL.window, backend="flex", on_run=runs.append)
    assert runs == [WindowRun("flex", "flex", "math")]


def test_force_window_backend_steers_auto():
    q, k, v = _inputs(WINDOWED)
    runs = []

    def run(backend="auto"):
        return window_softmax(q, k, v, WINDOWED.layout, WINDOWED.window, backend=backend, on_run=runs.append)

    ref = run("ref")
    with force_window_backend("decomposed"):
        assert resolve_window_backend("auto", torch.device("cpu"), torch.float64, 8) == "decomposed"
        out = run()
        assert runs[-1] == WindowRun("auto", "decomposed", "math")
        assert rel_err(out, ref) <= TOL64
        # an explicit backend is not overridden
        run("flex")
        assert runs[-1].backend == "flex"
    with force_window_backend("flex"):
        run("auto")
        assert runs[-1] == WindowRun("auto", "flex", "eager")
    run("auto")
    assert runs[-1].backend == "ref"


def test_force_window_backend_refuses_unknown_names():
    with pytest.raises(ValueError, match=r"unknown window softmax backend 'fastest'"):
        with force_window_backend("fastest"):
            pass


# --- dtypes, strides, scale -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["ref", "decomposed"])
def test_bf16_close_to_float32_ref(backend):
    case = Case("bf16", packed(frames=10, frame_h=2, frame_w=3, text=6, audio=4), WindowSpec(1, 3, "both"), H=2, D=16)
    q, k, v = _inputs(case, torch.bfloat16)
    ref32 = window_softmax(q.float(), k.float(), v.float(), case.layout, case.window, backend="ref")
    out = window_softmax(q, k, v, case.layout, case.window, backend=backend)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert torch.isfinite(out).all()
    assert rel_err(out, ref32) < 1e-2


def test_float32_backends_agree():
    case = WINDOWED
    q, k, v = _inputs(case, torch.float32)
    ref = window_softmax(q, k, v, case.layout, case.window, backend="ref")
    for backend in ("decomposed", "flex"):
        out = window_softmax(q, k, v, case.layout, case.window, backend=backend)
        assert out.dtype == torch.float32
        assert rel_err(out, ref) < 1e-5


STRIDED = [
    Case("strided-F12-r1-c0-none", packed(frames=12, frame_h=2, frame_w=2, text=5, audio=3), WindowSpec(1, 0, "none")),
    Case("strided-F12-r1-c3-both", packed(frames=12, frame_h=2, frame_w=2, text=5, audio=3), WindowSpec(1, 3, "both")),
    Case(
        "strided-Ref2VA",
        packed(frames=8, frame_h=2, frame_w=3, text=9, references=(6, 4), audio=5),
        WindowSpec(1, 0, "columns"),
        H=3,
        D=16,
    ),
]


@pytest.mark.parametrize("backend", ["decomposed", "flex", "ref"])
@pytest.mark.parametrize("case", STRIDED, ids=[c.id for c in STRIDED])
def test_fused_qkv_views_match_contiguous(case, backend):
    T, H, D = case.layout.seq_len, case.H, case.D
    g = torch.Generator().manual_seed(case.seed)
    fused = torch.randn(T, 3, H, D, generator=g, dtype=torch.float64)
    q, k, v = fused.unbind(1)
    assert q.stride() == (3 * H * D, D, 1)
    before = fused.clone()
    out = window_softmax(q, k, v, case.layout, case.window, backend=backend)
    dense = window_softmax(q.contiguous(), k.contiguous(), v.contiguous(), case.layout, case.window, backend=backend)
    assert rel_err(out, dense) <= 1e-12
    want = brute_attention(q, k, v, brute_keep(case.layout, case.window), D**-0.5)
    assert rel_err(out, want) <= TOL64
    assert torch.equal(fused, before)  # inputs untouched


@pytest.mark.parametrize("backend", ["ref", "decomposed", "flex", "auto"])
def test_scale_is_honoured(backend):
    case = WINDOWED
    q, k, v = _inputs(case)
    out = window_softmax(q, k, v, case.layout, case.window, backend=backend, scale=0.9)
    want = brute_attention(q, k, v, brute_keep(case.layout, case.window), 0.9)
    assert rel_err(out, want) <= TOL64
    default = window_softmax(q, k, v, case.layout, case.window, backend=backend)
    assert rel_err(default, out) > 1e-3


# --- decomposed: staged head passes, fp16 staging -----------------------------------------------------

SLAB_CASES = [
    Case("slab-F12-r1-c0-none", packed(frames=12, frame_h=2, frame_w=2, text=5, audio=3), WindowSpec(1, 0, "none")),
    Case("slab-F16-r1-c2-both", packed(frames=16, frame_h=1, frame_w=3, text=4, audio=2), WindowSpec(1, 2, "both")),
    Case(
        "slab-T264-r1-c5-columns",
        packed(frames=20, frame_h=3, frame_w=4, text=16, audio=8),
        WindowSpec(1, 5, "columns"),
        H=3,
        D=16,
    ),
]


def test_slab_cases_batch_several_groups():
    for case in SLAB_CASES:
        plan = plan_decomposed(case.layout, case.window)
        assert any(b.groups > 1 for b in plan.batches), case.id


@pytest.mark.parametrize("stage_bytes", [1, 4000, 2**30], ids=lambda b: f"stage{b}")
@pytest.mark.parametrize("case", SLAB_CASES, ids=[c.id for c in SLAB_CASES])
def test_decomposed_staged_head_passes_match_ref(case, stage_bytes):
    q, k, v = _inputs(case)
    out = window_softmax_decomposed(q, k, v, case.layout, case.window, case.D**-0.5, stage_bytes=stage_bytes)
    ref = window_softmax(q, k, v, case.layout, case.window, backend="ref")
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL64


@pytest.mark.parametrize(
    "q_mul, k_mul, v_mul",
    [(1.0, 1.0, 1.0), (2.0**13, 2.0**-13, 2.0**20), (2.0**-3, 2.0**12, 2.0**-10)],
    ids=["ordinary", "large-q-and-v", "large-k-tiny-v"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize(
    "options",
    [dict(), dict(stage_bytes=1)],
    ids=["staged", "staged-head-passes"],
)
def test_decomposed_fp16_staging(options, dtype, q_mul, k_mul, v_mul):
    """Window calls staged in fp16 (the CUDA default for bf16), including magnitudes beyond fp16's range."""
    case = SLAB_CASES[2]  # three heads: stage_bytes=1 splits them into passes
    q, k, v = _inputs(case, torch.float32)
    q, k, v = (q * q_mul).to(dtype), (k * k_mul).to(dtype), (v * v_mul).to(dtype)
    ref32 = window_softmax(q.float(), k.float(), v.float(), case.layout, case.window, backend="ref")
    out = window_softmax_decomposed(
        q, k, v, case.layout, case.window, case.D**-0.5, stage_dtype=torch.float16, **options
    )
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref32) < 1e-2


def _gate(case, dtype=torch.float64):
    g = torch.Generator().manual_seed(case.seed + 7)
    return torch.rand(case.layout.seq_len, case.H, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("backend", ["ref", "decomposed", "flex", "auto"])
def test_gate_multiplies_each_row_and_head(backend):
    case = SLAB_CASES[1]
    q, k, v = _inputs(case)
    gate = _gate(case)
    plain = window_softmax(q, k, v, case.layout, case.window, backend=backend)
    gated = window_softmax(q, k, v, case.layout, case.window, backend=backend, gate=gate)
    assert rel_err(gated, plain * gate[..., None]) <= 1e-14


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize(
    "options",
    [dict(), dict(stage_bytes=1)],
    ids=["staged", "staged-head-passes"],
)
def test_decomposed_gate_on_converted_windows_and_the_other_rows(options, dtype):
    """Staged in fp16 the windows are gated as their output is converted back, the dense rows after: every
    row ends up gated once, within one rounding of the ungated output times the gate."""
    case = SLAB_CASES[2]
    q, k, v = (t.to(dtype) for t in _inputs(case, torch.float32))
    gate = _gate(case, dtype)
    run = dict(stage_dtype=torch.float16, **options)
    plain = window_softmax_decomposed(q, k, v, case.layout, case.window, case.D**-0.5, **run)
    gated = window_softmax_decomposed(q, k, v, case.layout, case.window, case.D**-0.5, gate=gate, **run)
    want = plain.double() * gate.double()[..., None]
    step = torch.finfo(dtype).eps
    assert ((gated.double() - want).abs() <= 2 * step * want.abs() + 1e-30).all()
    assert not torch.equal(gated, plain)


def test_gate_of_the_wrong_shape_is_refused():
    case = SLAB_CASES[0]
    q, k, v = _inputs(case)
    bad = torch.ones(case.layout.seq_len, case.H + 1, dtype=torch.float64)
    with pytest.raises(ValueError, match=re.escape(f"gate must be [T, H] = {[case.layout.seq_len, case.H]}")):
        window_softmax(q, k, v, case.layout, case.window, gate=bad)


@pytest.mark.parametrize(
    "batch",
    [
        WindowBatch(q_start=0, q_rows=4, k_start=10, k_rows=12, k_step=4, groups=6),  # 3 slots
        WindowBatch(q_start=0, q_rows=4, k_start=3, k_rows=4, k_step=4, groups=5),  # 1 slot
        WindowBatch(q_start=0, q_rows=2, k_start=0, k_rows=10, k_step=4, groups=4),  # step does not divide
        WindowBatch(q_start=0, q_rows=2, k_start=5, k_rows=6, k_step=0, groups=3),  # one shared window
        WindowBatch(q_start=0, q_rows=2, k_start=7, k_rows=9, k_step=0, groups=1),
    ],
    ids=["slots3", "slots1", "no-divide", "step0", "one-group"],
)
def test_stage_slots_hold_exactly_each_window(batch):
    """Replaying the staged loads group by group leaves exactly group g's window rows in the stage."""
    stage = [None] * batch.k_rows
    for g in range(batch.groups):
        for src, dst, n in _stage_slots(batch, g):
            assert 0 <= dst and dst + n <= batch.k_rows
            stage[dst : dst + n] = range(src, src + n)
        first = batch.k_start + g * batch.k_step
        assert sorted(stage) == list(range(first, first + batch.k_rows)), f"group {g}"


# --- every output row is written ------------------------------------------------------------------

WRITTEN = [
    Case(
        "written-globals-around-rows",
        CASES[CASE_IDS.index("globals-around-video-r1-c2-rows")].layout,
        WindowSpec(1, 2, "rows"),
    ),
    Case("written-Ref2VA-both", CASES[CASE_IDS.index("Ref2VA-r1-c3-both")].layout, WindowSpec(1, 3, "both")),
    Case("written-F3-columns", packed(frames=3, frame_h=2, frame_w=2, text=3), WindowSpec(0, 0, "columns")),
    Case("written-only-globals", packed(frames=0, frame_h=2, frame_w=2, text=7, audio=4), WindowSpec(1, 5, "both")),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("backend", ["ref", "decomposed", "flex", "auto"])
@pytest.mark.parametrize("case", WRITTEN, ids=[c.id for c in WRITTEN])
def test_every_row_is_written(case, backend, dtype):
    # conftest poisons torch.empty / empty_like with NaN: a row no code path wrote stays NaN
    assert torch.isnan(torch.empty(2, dtype=dtype)).all()
    q, k, v = _inputs(case, dtype)
    out = window_softmax(q, k, v, case.layout, case.window, backend=backend)
    assert torch.isfinite(out).all()


# --- refusals -------------------------------------------------------------------------------------

ERR_LAYOUT = packed(frames=3, frame_h=2, frame_w=2, text=4)  # T = 16
ERR_WINDOW = WindowSpec(1, 0, "none")


def _err_qkv(T=16, H=2, D=8, dtype=torch.float32):
    return tuple(torch.zeros(T, H, D, dtype=dtype) for _ in range(3))


def test_unknown_backend_lists_valid_ones():
    q, k, v = _err_qkv()
    with pytest.raises(
        ValueError,
        match=re.escape("unknown window softmax backend 'fast'; valid backends: ['auto', 'decomposed', 'flex', 'ref']"),
    ):
        window_softmax(q, k, v, ERR_LAYOUT, ERR_WINDOW, backend="fast")


def test_wrong_number_of_rows():
    q, k, v = _err_qkv(T=14)
    with pytest.raises(ValueError, match=re.escape("q has 14 rows but layout.seq_len is 16")):
        window_softmax(q, k, v, ERR_LAYOUT, ERR_WINDOW)


@pytest.mark.parametrize(
    "which, shape",
    [("k", (16, 3, 8)), ("v", (16, 2, 16)), ("k", (15, 2, 8))],
    ids=["k-heads", "v-head-dim", "k-rows"],
)
def test_qkv_shape_mismatch(which, shape):
    q, k, v = _err_qkv()
    tensors = dict(q=q, k=k, v=v)
    tensors[which] = torch.zeros(shape)
    got = ", ".join(str(tuple(tensors[n].shape)) for n in "qkv")
    with pytest.raises(ValueError, match=re.escape(f"q, k, v must have the same [T, H, D] shape, got {got}")):
        window_softmax(tensors["q"], tensors["k"], tensors["v"], ERR_LAYOUT, ERR_WINDOW)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_two_dimensional_input(which):
    tensors = dict(zip("qkv", _err_qkv()))
    tensors[which] = torch.zeros(16, 8)
    with pytest.raises(ValueError, match=re.escape(f"{which} must be a token-major [T, H, D] tensor, got (16, 8)")):
        window_softmax(tensors["q"], tensors["k"], tensors["v"], ERR_LAYOUT, ERR_WINDOW)


def test_four_dimensional_input():
    q = torch.zeros(1, 16, 2, 8)
    with pytest.raises(ValueError, match=re.escape("q must be a token-major [T, H, D] tensor, got (1, 16, 2, 8)")):
        window_softmax(q, q, q, ERR_LAYOUT, ERR_WINDOW)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool], ids=str)
def test_integer_dtype(dtype):
    q, k, v = _err_qkv()
    with pytest.raises(ValueError, match=re.escape(f"q must be a floating-point tensor, got {dtype}")):
        window_softmax(q.to(dtype), k, v, ERR_LAYOUT, ERR_WINDOW)


def test_non_tensor_input():
    q, k, v = _err_qkv()
    with pytest.raises(ValueError, match=re.escape("k must be a token-major [T, H, D] tensor, got list")):
        window_softmax(q, [[0.0]], v, ERR_LAYOUT, ERR_WINDOW)


def test_mixed_dtypes():
    q, k, v = _err_qkv()
    with pytest.raises(ValueError, match=r"q, k, v must share dtype and device, got torch\.float32/torch\.float64"):
        window_softmax(q, k.double(), v, ERR_LAYOUT, ERR_WINDOW)


def test_non_contiguous_last_dim():
    q, k, v = _err_qkv()
    q_t = torch.zeros(16, 8, 2).transpose(1, 2)
    with pytest.raises(ValueError, match=r"q must have a contiguous last dim"):
        window_softmax(q_t, k, v, ERR_LAYOUT, ERR_WINDOW)


def test_layout_and_window_types():
    q, k, v = _err_qkv()
    with pytest.raises(H3InputError, match="layout must be a SequenceLayout, got dict"):
        window_softmax(q, k, v, {"seq_len": 16}, ERR_WINDOW)
    with pytest.raises(H3InputError, match="window must be a WindowSpec, got int"):
        window_softmax(q, k, v, ERR_LAYOUT, 1)
