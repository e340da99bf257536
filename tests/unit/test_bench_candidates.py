"""bench/candidate_kernels.py against the library's forms, under Triton's CPU interpreter."""

import textwrap

from triton_interpreter import run_interpreted

CHECK = textwrap.dedent(
    """
    import torch
    from candidate_kernels import spatial_conv_rows
    from h3_core.models.branch_fused import spatial_conv

    g = torch.Generator().manual_seed(0)
    for grid in ((5, 7), (3, 4), (1, 6)):  # taller and shorter than the window
        tokens = grid[0] * grid[1]
        k = torch.randn(4, tokens, 3, 40, generator=g)[:, :, 1]  # k of a fused projection [F, S, 3, C]
        weight = torch.randn(40, 1, 5, 5, generator=g)
        want = spatial_conv(k.contiguous(), weight, grid)
        for block_c in (16, 64):  # channel tiles that do and do not divide C
            got = spatial_conv_rows(k, weight, grid, block_c)
            assert got.shape == (4, tokens, 40) and got.is_contiguous()
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (grid, block_c)
    print("OK")
    """
)


def test_candidate_spatial_conv_under_interpreter_matches_the_library_form():
    assert run_interpreted(CHECK).split()[-1] == "OK"


NORM_CHECK = textwrap.dedent(
    """
    import torch
    from candidate_kernels import norm_modulate_quantize
    from h3_core.fp8_linear import _SMALLEST_SCALE, quantize_rows_reference
    from h3_core.models.block_fused import norm_modulate

    # fp32 rows: the interpreter emulates bf16 rounding by truncation, so the bf16 case runs on the GPU only
    g = torch.Generator().manual_seed(3)
    x = torch.randn(23, 300, generator=g) * torch.logspace(-2, 2, 23)[:, None]
    weight = torch.randn(300, generator=g)
    shift, scale = torch.randn(4, 300, generator=g), torch.randn(4, 300, generator=g)
    rows = torch.randint(0, 4, (23,), generator=g)
    quotients, scales = norm_modulate_quantize(x, weight, shift, scale, rows, 1e-6, _SMALLEST_SCALE, torch.float32)
    codes, ref_scales = quantize_rows_reference(norm_modulate(x, weight, shift, scale, rows, 1e-6))
    assert quotients.shape == (23, 300) and scales.shape == (23, 1)
    assert ((scales - ref_scales).abs() <= ref_scales * 1e-5).all()
    assert ((quotients - codes.float()).abs() <= 448 / 16).all()  # within one e4m3 step of the reference codes
    print("OK")
    """
)


def test_candidate_norm_modulate_quantiser_under_interpreter_matches_the_two_step_path():
    assert run_interpreted(NORM_CHECK).split()[-1] == "OK"


GATE_CHECK = textwrap.dedent(
    """
    import torch
    from candidate_kernels import gate_heads_quantize
    from h3_core.fp8_linear import _SMALLEST_SCALE, quantize_rows_reference
    from h3_core.models.block_fused import gate_heads_

    g = torch.Generator().manual_seed(4)
    soft = torch.randn(19, 3, 24, generator=g) * torch.logspace(-2, 2, 19)[:, None, None]
    gate = torch.rand(19, 3, generator=g)
    gate[5] = 0  # a fully closed gate: a zero row keeps the smallest scale
    quotients, scales = gate_heads_quantize(soft, gate, _SMALLEST_SCALE, torch.float32)
    codes, ref_scales = quantize_rows_reference(gate_heads_(soft.clone(), gate).reshape(19, -1))
    assert quotients.shape == (19, 72) and scales.shape == (19, 1)
    assert torch.equal(scales, ref_scales)  # fp32 rows: the same products, the same amax
    assert ((quotients - codes.float()).abs() <= 448 / 16).all()
    assert scales[5].item() == _SMALLEST_SCALE and not quotients[5].any()
    print("OK")
    """
)


def test_candidate_gate_quantiser_under_interpreter_matches_the_two_step_path():
    assert run_interpreted(GATE_CHECK).split()[-1] == "OK"


CHUNKED_CHECK = textwrap.dedent(
    """
    import torch
    from candidate_kernels import quantize_rows_chunked
    from h3_core.fp8_linear import _SMALLEST_SCALE, quantize_rows_reference

    g = torch.Generator().manual_seed(5)
    wide = (torch.randn(13, 300, generator=g) * torch.logspace(-3, 3, 13)[:, None]).to(torch.bfloat16)
    wide[4] = 0
    for x, block_k in ((wide, 64), (wide, 512), (wide[:, 5:260], 32), (torch.randn(5, 64, generator=g), 64)):
        quotients, scale = quantize_rows_chunked(x, _SMALLEST_SCALE, torch.float32, block_k)
        codes, ref_scale = quantize_rows_reference(x)
        assert torch.equal(scale, ref_scale), block_k
        assert torch.equal(quotients, x.float() / ref_scale), block_k  # the reference's division, before its cast
    from candidate_kernels import swiglu_quantize_chunked
    from h3_core._fp8_triton import swiglu_quantize_triton

    gate_up = torch.randn(7, 2 * 300, generator=g) * torch.logspace(-2, 2, 7)[:, None]
    whole = swiglu_quantize_triton(gate_up, _SMALLEST_SCALE, torch.float32)
    for block_k in (64, 512):
        chunked = swiglu_quantize_chunked(gate_up, _SMALLEST_SCALE, torch.float32, block_k)
        assert torch.equal(chunked[1], whole[1]) and torch.equal(chunked[0], whole[0]), block_k
    print("OK")
    """
)


def test_candidate_chunked_quantiser_under_interpreter_matches_the_reference():
    assert run_interpreted(CHUNKED_CHECK).split()[-1] == "OK"
