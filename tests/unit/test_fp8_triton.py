"""The Triton row quantisers (h3_core.models.fp8_triton) against quantize_rows_reference (after the softmax gate or
the FFN's product for the fused ones), under Triton's CPU interpreter. The interpreter's e4m3 cast is not the
GPU's, so here the kernel keeps its fp32 quotients and the cast itself is checked on the GPU
(tests/gpu/test_fp8_linear_cuda.py)."""

import textwrap

from triton_interpreter import run_interpreted

CHECK = textwrap.dedent(
    """
    import torch
    from h3_core.models.fp8_triton import quantize_rows_triton
    from h3_core.models.fp8_linear import E4M3_MAX, _SMALLEST_SCALE, quantize_rows_reference

    g = torch.Generator().manual_seed(3)
    wide = (torch.randn(37, 300, generator=g) * torch.logspace(-3, 3, 37)[:, None]).to(torch.bfloat16)
    wide[5] = 0  # a zero row keeps the smallest scale, no NaN
    cases = [wide, wide[:, 7:250], torch.randn(9, 64, generator=g), torch.randn(3, 5, generator=g).half()]
    launches = [(None, None), (32, 1), (64, 2), (512, 4)]  # chunks shorter than, across and beyond a row's end
    for x, (block_k, warps) in ((x, launch) for x in cases for launch in launches):
        quotients, scale = quantize_rows_triton(x, _SMALLEST_SCALE, torch.float32, block_k, warps)
        codes, ref_scale = quantize_rows_reference(x)
        assert quotients.shape == x.shape and quotients.is_contiguous() and scale.shape == (x.shape[0], 1)
        assert torch.equal(scale, ref_scale), "scales"
        want = x.float() / ref_scale  # the reference's division before its cast
        assert torch.equal(quotients, want), "quotients"
        assert quotients.abs().max() <= E4M3_MAX * (1 + 2**-22)  # rounds to 448 in the cast
        assert torch.equal(quotients.to(torch.float8_e4m3fn).view(torch.uint8), codes.view(torch.uint8)), "codes"
    print("OK", len(cases))
    """
)


def test_triton_quantiser_under_interpreter_matches_reference():
    assert run_interpreted(CHECK).split()[-2:] == ["OK", "4"]


SWIGLU_CHECK = textwrap.dedent(
    """
    import torch
    from h3_core.models.fp8_triton import swiglu_quantize_triton
    from h3_core.models.fp8_linear import _SMALLEST_SCALE, quantize_rows_reference
    from h3_core.models.block_fused import swiglu_

    # fp32 rows: the interpreter emulates bf16 rounding by truncation, so the bf16 case runs on the GPU only
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(19, 2 * 300, generator=g) * torch.logspace(-2, 2, 19)[:, None]
    gate_up[4] = 0
    quotients, scale = swiglu_quantize_triton(gate_up, _SMALLEST_SCALE, torch.float32)
    codes, ref_scale = quantize_rows_reference(swiglu_(gate_up.clone()))
    assert quotients.shape == (19, 300) and scale.shape == (19, 1)
    # x·sigmoid(x) here, x / (1 + exp(-x)) in the written function: a few fp32 roundings apart
    assert ((scale - ref_scale).abs() <= ref_scale * 1e-6).all()
    assert ((quotients - codes.float()).abs() <= 448 / 16).all()  # within one e4m3 step of the reference codes
    assert scale[4].item() == _SMALLEST_SCALE and not quotients[4].any()
    print("OK")
    """
)


def test_triton_swiglu_quantiser_under_interpreter_matches_the_two_step_path():
    assert run_interpreted(SWIGLU_CHECK).split()[-1] == "OK"


GATE_CHECK = textwrap.dedent(
    """
    import torch
    from h3_core.models.fp8_triton import gate_heads_quantize_triton
    from h3_core.models.fp8_linear import _SMALLEST_SCALE, quantize_rows_reference
    from h3_core.models.block_fused import gate_heads_

    g = torch.Generator().manual_seed(4)
    soft = torch.randn(19, 5, 24, generator=g) * torch.logspace(-2, 2, 19)[:, None, None]
    gate = torch.rand(19, 7, generator=g)[:, 1:6]  # a head group's columns of the gate: a row stride of 7
    gate[5] = 0  # a fully closed gate: a zero row keeps the smallest scale
    codes, ref_scales = quantize_rows_reference(gate_heads_(soft.clone(), gate).reshape(19, -1))
    for block_k in (None, 16, 64):  # chunks that split heads, and hold several
        quotients, scales = gate_heads_quantize_triton(soft, gate, _SMALLEST_SCALE, torch.float32, block_k)
        assert quotients.shape == (19, 120) and scales.shape == (19, 1)
        assert torch.equal(scales, ref_scales)  # fp32 rows: the same products, the same amax
        assert torch.equal(quotients, gate_heads_(soft.clone(), gate).reshape(19, -1) / ref_scales)
        assert scales[5].item() == _SMALLEST_SCALE and not quotients[5].any()
    print("OK")
    """
)


def test_triton_gate_quantiser_under_interpreter_matches_the_two_step_path():
    assert run_interpreted(GATE_CHECK).split()[-1] == "OK"
