"""The fp8 window softmax on a GPU: cuDNN's fp8 attention against the emulated kernel on the same e4m3 inputs, the
quantisation's Triton pass against its eager form, the decomposed fp8 plan against the per-frame reference, and the
exact path reproducible run to run (skipped without CUDA; the cuDNN checks without nvidia-cudnn-frontend)."""

import pytest
import torch

from h3_core.attention import SequenceLayout, WindowSpec, fp8_cudnn, window_softmax
from h3_core.attention import fp8 as fp8_mod
from h3_core.attention.convert import scale_convert, scale_convert_reference
from h3_core.attention.fp8 import Fp8Rows, fp8_attention, fp8_attention_reference, quantize_e4m3, resolve_fp8_kernel
from h3_core.attention.window_fp8 import window_softmax_fp8_ref
from h3_core.errors import H3BackendUnavailable

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = torch.device("cuda")


def cudnn_fp8_runs() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        return resolve_fp8_kernel(DEV, 128) == "cudnn_fp8"
    except H3BackendUnavailable:
        return False


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_the_triton_quantisation_is_the_eager_one():
    x = torch.randn(4099, 7, 128, device=DEV, dtype=torch.bfloat16) * 3
    scale = torch.tensor([448.0 / 11.0], device=DEV)  # some values saturate
    got, want = (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=DEV) for _ in range(2))
    scale_convert(x, got, scale, saturate=True)
    scale_convert_reference(x, want, scale, saturate=True)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert float(quantize_e4m3(x).values.float().abs().max()) == 448.0


@pytest.mark.skipif(not cudnn_fp8_runs(), reason="cuDNN's fp8 attention does not run here")
@pytest.mark.parametrize("rows", [(5040, 18586), (129, 1000), (3466, 20000)])
def test_cudnn_fp8_is_the_emulated_kernel(rows):
    gen = torch.Generator(device=DEV).manual_seed(0)
    tq, tk = rows
    q, k, v = (torch.randn(n, 8, 128, device=DEV, generator=gen, dtype=torch.bfloat16) for n in (tq, tk, tk))
    k[..., :4] *= 20
    q8, k8, v8 = (quantize_e4m3(x) for x in (q, k, v))
    heads = slice(2, 6)  # a head pass's strided views, as the window leg issues them
    view = [Fp8Rows(x.values[:, heads], x.descale) for x in (q8, k8, v8)]
    out = torch.zeros(tq, 8, 128, device=DEV, dtype=torch.bfloat16)
    fp8_attention(*view, out=out[:, heads], kernel="cudnn_fp8")
    out_fp8 = fp8_cudnn.writes_e4m3_output(out.device, out.dtype)
    want = fp8_attention_reference(*view, 128**-0.5, out_fp8)[0]
    assert rel(out[:, heads], want) < fp8_mod.TRIAL_TOLERANCE
    assert (out[:, :2] == 0).all() and (out[:, 6:] == 0).all()
    exact = torch.nn.functional.scaled_dot_product_attention(
        *(x[:, heads].transpose(0, 1).float() for x in (q, k, v))
    ).transpose(0, 1)
    # no less exact than the roundings it stands for (the e4m3 scores of the scaled channels cost most of both)
    assert rel(out[:, heads], exact) < 1.25 * rel(want, exact) + 0.01


@pytest.mark.skipif(not cudnn_fp8_runs(), reason="cuDNN's fp8 attention does not run here")
def test_the_fp8_window_softmax_is_the_per_frame_reference_and_reproducible():
    layout = SequenceLayout.packed(frames=21, frame_h=12, frame_w=14, text=300, audio=230)
    window = WindowSpec(radius=1, chunk=5, anchors="both")
    gen = torch.Generator(device=DEV).manual_seed(1)
    q, k, v = (torch.randn(layout.seq_len, 6, 128, device=DEV, generator=gen, dtype=torch.bfloat16) for _ in range(3))
    runs = []
    out = window_softmax(q, k, v, layout, window, precision="fp8", on_run=runs.append)
    assert (runs[0].backend, runs[0].kernel) == ("decomposed", "cudnn_fp8")
    out_fp8 = fp8_cudnn.writes_e4m3_output(out.device, out.dtype)
    ref = window_softmax_fp8_ref(q, k, v, layout, window, 128**-0.5, out_fp8)
    assert rel(out, ref) < fp8_mod.TRIAL_TOLERANCE
    assert torch.equal(out, window_softmax(q, k, v, layout, window, precision="fp8"))
    exact = window_softmax(q, k, v, layout, window, backend="decomposed")
    assert torch.equal(exact, window_softmax(q, k, v, layout, window, backend="decomposed"))
