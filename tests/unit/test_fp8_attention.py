"""The opt-in fp8 window softmax: e4m3 quantisation against ml_dtypes' own e4m3, the emulated kernel against a
float64 NumPy rendering of the same arithmetic, the decomposed fp8 plan against the per-frame fp8 reference, its
error against exact attention, and what is refused."""

import ml_dtypes
import numpy as np
import pytest
import torch

from h3_core.attention import SequenceLayout, WindowSpec, fp8_cudnn, window_softmax
from h3_core.attention import fp8 as fp8_mod
from h3_core.attention.fp8 import (
    E4M3,
    P_SCALE,
    Fp8Rows,
    fp8_attention,
    fp8_attention_reference,
    quantize_e4m3,
    resolve_fp8_kernel,
)
from h3_core.attention.kernels import DeviceFacts
from h3_core.attention.window_fp8 import window_softmax_fp8, window_softmax_fp8_ref
from h3_core.errors import H3BackendUnavailable, H3InputError


def e4m3_codes(x: torch.Tensor) -> np.ndarray:
    return x.view(torch.uint8).numpy()


def decoded(rows: Fp8Rows) -> np.ndarray:
    """The values an Fp8Rows stands for, read through ml_dtypes (float64)."""
    codes = e4m3_codes(rows.values.contiguous())
    return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * float(rows.descale)


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 37.0, 5e3])
def test_quantize_rounds_as_ml_dtypes_and_maps_the_largest_magnitude_onto_448(magnitude):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(33, 3, 16, generator=gen) * magnitude
    x[5, 1, 2] = -6 * magnitude  # the largest magnitude, negative
    rows = quantize_e4m3(x)
    assert rows.values.dtype == E4M3 and rows.descale.shape == (1,) and rows.descale.dtype == torch.float32
    scale = np.float32(448.0) / np.float32(6 * magnitude)
    scaled = (x.numpy().astype(np.float32) * scale).astype(np.float64)
    expected = np.clip(scaled, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(e4m3_codes(rows.values), expected.view(np.uint8))
    assert float(rows.values[5, 1, 2].float()) == -448.0
    assert float(rows.descale) == pytest.approx(6 * magnitude / 448.0, rel=1e-6)


def test_quantize_takes_bf16_and_batched_rows_and_all_zeros():
    x = torch.randn(2, 9, 2, 16).bfloat16()
    rows = quantize_e4m3(x)
    assert rows.values.shape == x.shape
    assert np.allclose(decoded(rows), x.double().numpy(), rtol=2**-3, atol=float(rows.descale) * 2**-9)
    zeros = quantize_e4m3(torch.zeros(4, 1, 16))
    assert torch.equal(zeros.values.float(), torch.zeros(4, 1, 16))


def numpy_fp8_attention(q: Fp8Rows, k: Fp8Rows, v: Fp8Rows, scale: float) -> np.ndarray:
    """The fp8 kernels' arithmetic in float64 with ml_dtypes' e4m3 rounding of the probabilities ([T, H, D])."""
    qd, kd, vd = decoded(q), decoded(k), decoded(v)
    scores = np.einsum("thd,shd->hts", qd, kd) * scale
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    sums = probs.sum(-1, keepdims=True)
    rounded = (probs * P_SCALE).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) / P_SCALE
    return np.einsum("hts,shd->thd", rounded, vd) / sums.transpose(1, 0, 2)


def test_the_emulated_kernel_is_the_numpy_rendering():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(rows, 3, 32, generator=gen) for rows in (21, 50, 50))
    k[..., :2] *= 30  # outlier channels
    q8, k8, v8 = (quantize_e4m3(x) for x in (q, k, v))
    got = fp8_attention(q8, k8, v8, scale=32**-0.5, out_dtype=torch.float32, kernel="emulated")
    want = numpy_fp8_attention(q8, k8, v8, 32**-0.5)
    # float32 scores put a few probabilities on the other side of an e4m3 rounding boundary than float64 does
    assert np.abs(got.numpy() - want).max() <= 2e-2 * np.abs(want).max()
    assert np.linalg.norm(got.numpy() - want) <= 1e-3 * np.linalg.norm(want)


def test_the_emulated_kernel_writes_into_a_strided_output_and_batches():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, rows, 4, 16, generator=gen) for rows in (7, 12, 12))
    q8, k8, v8 = (quantize_e4m3(x) for x in (q, k, v))
    heads = slice(1, 3)
    view = [Fp8Rows(x.values[:, :, heads], x.descale) for x in (q8, k8, v8)]
    out = torch.zeros(2, 7, 4, 16, dtype=torch.bfloat16)
    result = fp8_attention(*view, out=out[:, :, heads], out_dtype=torch.bfloat16, kernel="emulated")
    assert result.data_ptr() == out[:, :, heads].data_ptr()
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    ref = fp8_attention_reference(*view, 16**-0.5)
    assert torch.equal(out[:, :, heads], ref.bfloat16())
    one = fp8_attention(*(Fp8Rows(x.values[0], x.descale) for x in view), out_dtype=torch.float32, kernel="emulated")
    assert torch.allclose(one, ref[0], rtol=0, atol=1e-6)


GEOMETRIES = [
    (dict(frames=12, frame_h=4, frame_w=5, text=7, audio=9), WindowSpec(radius=1, chunk=2, anchors="both")),
    (dict(frames=11, frame_h=2, frame_w=3, text=5, audio=4), WindowSpec(radius=1, chunk=3, anchors="rows")),
    (dict(frames=9, frame_h=3, frame_w=2, text=4, audio=0), WindowSpec(radius=2, chunk=1, anchors="columns")),
    (dict(frames=6, frame_h=2, frame_w=2, text=3, audio=2), WindowSpec(radius=3, chunk=5, anchors="none")),
]


def qkv(layout, heads=3, dim=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(layout.seq_len, heads, dim, generator=gen) for _ in range(3))
    q[..., :2] *= 8  # large channels, as normed and rotated q/k carry
    return q, k, v


@pytest.mark.parametrize("geometry", range(len(GEOMETRIES)))
def test_the_decomposed_fp8_plan_is_the_per_frame_reference(geometry):
    sizes, window = GEOMETRIES[geometry]
    layout = SequenceLayout.packed(**sizes)
    q, k, v = qkv(layout, seed=geometry)
    scale = 32**-0.5
    ref = window_softmax_fp8_ref(q, k, v, layout, window, scale)
    out, kernel = window_softmax_fp8(q, k, v, layout, window, scale)
    assert kernel == "emulated" and out.dtype == q.dtype
    # the same quantised inputs and the same kept keys per query, grouped differently
    assert (out - ref).norm() <= 1e-6 * ref.norm()
    # staging in several head passes changes nothing
    narrow, _ = window_softmax_fp8(q, k, v, layout, window, scale, stage_bytes=1)
    assert torch.equal(narrow, out)


def test_fp8_through_window_softmax_is_close_to_exact_attention_and_bf16_is_untouched():
    sizes, window = GEOMETRIES[0]
    layout = SequenceLayout.packed(**sizes)
    q, k, v = qkv(layout)
    exact = window_softmax(q.double(), k.double(), v.double(), layout, window, backend="ref")
    runs = []
    fp8 = window_softmax(q, k, v, layout, window, backend="auto", precision="fp8", on_run=runs.append)
    ref_fp8 = window_softmax(q, k, v, layout, window, backend="ref", precision="fp8", on_run=runs.append)
    assert [(r.backend, r.kernel) for r in runs] == [("decomposed", "emulated"), ("ref", "emulated")]
    error = ((fp8.double() - exact).norm() / exact.norm()).item()
    assert 1e-3 < error < 0.1, error  # e4m3 keeps 3 mantissa bits: a few per cent, not exact, not garbage
    assert (fp8 - ref_fp8).norm() <= 1e-6 * ref_fp8.norm()
    bf16 = window_softmax(q, k, v, layout, window, backend="decomposed")
    assert torch.equal(bf16, window_softmax(q, k, v, layout, window, backend="decomposed", precision="bf16"))
    assert ((bf16.double() - exact).norm() / exact.norm()).item() < 1e-5
    as_bf16 = window_softmax(q.bfloat16(), k.bfloat16(), v.bfloat16(), layout, window, precision="fp8")
    assert as_bf16.dtype == torch.bfloat16


def test_what_is_refused():
    sizes, window = GEOMETRIES[0]
    layout = SequenceLayout.packed(**sizes)
    q, k, v = qkv(layout)
    with pytest.raises(H3InputError, match="attention_precision: 'fp8' runs on window_backend 'auto' or"):
        window_softmax(q, k, v, layout, window, backend="flex", precision="fp8")
    with pytest.raises(H3InputError, match=r"attention_precision: must be one of \['bf16', 'fp8'\], got 'int8'"):
        window_softmax(q, k, v, layout, window, precision="int8")
    with pytest.raises(H3InputError, match="must be Fp8Rows"):
        fp8_attention(q, k, v)
    with pytest.raises(H3InputError, match="unknown fp8 attention kernel 'fa3'"):
        resolve_fp8_kernel("cpu", 32, "fa3")


def test_a_gpu_without_an_fp8_kernel_is_an_error_that_says_why(monkeypatch):
    monkeypatch.setattr(fp8_mod, "device_facts", lambda device: DeviceFacts("cuda", (9, 0)))
    monkeypatch.setattr(fp8_cudnn, "_optional_module", lambda name: None)
    with pytest.raises(H3BackendUnavailable) as caught:
        resolve_fp8_kernel("cuda:7", 128)
    message = str(caught.value)
    assert "cudnn_fp8: 'cudnn' is not importable (install nvidia-cudnn-frontend)" in message
    assert "emulated: has none of the fp8 kernels' speed off the CPU" in message
    assert "Set attention_precision bf16" in message
    monkeypatch.setattr(fp8_mod, "device_facts", lambda device: DeviceFacts("cuda", (8, 9)))
    with pytest.raises(H3BackendUnavailable, match="needs compute capability >= 9.0, device has"):
        resolve_fp8_kernel("cuda:6", 128)
