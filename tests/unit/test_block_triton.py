"""The block's Triton norms (h3_core.models.block_triton) under Triton's CPU interpreter: q/k norm + RoPE
against block_fused.qk_norm_rope on a slice of a fused projection (row and head strides of the real one); the
block norm against norm_modulate, after gated_residual_, and quantised as quantize_rows_reference does; SiLU·up
written into fc1's output against swiglu_."""

import textwrap

from triton_interpreter import run_interpreted

CHECK = textwrap.dedent(
    """
    import torch
    from h3_core.models.block_triton import qk_norm_rope_triton
    from h3_core.models.block_fused import qk_norm_rope

    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 3, 5, 24, generator=g)[:, 1]  # k of a fused projection [T, 3, H, D]
    weight = torch.randn(24, generator=g)
    angles = torch.randn(37, 8, generator=g)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # 16 of 24 rotated
    for per_head in (False, True):  # a program per tile of rows through every head, or per tile and head
        for c, s in ((cos, sin), (None, None)):
            got = qk_norm_rope_triton(x, weight, c, s, 1e-6, per_head)
            want = qk_norm_rope(x, weight, c, s, 1e-6)
            assert got.shape == (37, 5, 24) and got.is_contiguous()
            assert (got - want).abs().max() <= 1e-6 * want.abs().max(), ("fp32", per_head)
    half = x.to(torch.bfloat16)
    got, want = qk_norm_rope_triton(half, weight, cos, sin, 1e-6), qk_norm_rope(half, weight, cos, sin, 1e-6)
    # both round one fp32 result: one bf16 step apart, or fp32 roundoff where the rotation's products cancel
    got, want = got.float(), want.float()
    assert ((got - want).abs() <= want.abs() * 2**-7 + 1e-5 * want.abs().max()).all()
    print("OK")
    """
)


def test_triton_qk_norm_rope_under_interpreter_matches_the_written_function():
    assert run_interpreted(CHECK).split()[-1] == "OK"


BLOCK_NORM_CHECK = textwrap.dedent(
    """
    import torch
    from h3_core.models.fp8_linear import _SMALLEST_SCALE, quantize_rows_reference
    from h3_core.models.block_triton import block_norm_triton
    from h3_core.models.block_fused import gated_residual_, norm_modulate

    # fp32 rows: the interpreter emulates bf16 rounding by truncation, so the bf16 case runs on the GPU only
    g = torch.Generator().manual_seed(3)
    x = torch.randn(23, 300, generator=g) * torch.logspace(-2, 2, 23)[:, None]
    y = torch.randn(23, 300, generator=g)
    weight, gate = torch.randn(300, generator=g), torch.randn(4, 300, generator=g)
    shift, scale = torch.randn(4, 300, generator=g), torch.randn(4, 300, generator=g)
    rows = torch.randint(0, 4, (23,), generator=g)
    residual = gated_residual_(x, y.clone(), gate, rows)
    for block_k in (None, 64, 512):  # chunks that split the row, and one holding it whole
        for with_residual in (False, True):
            normed = residual if with_residual else x
            want = norm_modulate(normed, weight, shift, scale, rows, 1e-6)
            codes, ref_scales = quantize_rows_reference(want)
            extra = (y.clone(), gate) if with_residual else ()
            got = block_norm_triton(x, weight, shift, scale, rows, 1e-6, *extra, block_k=block_k)
            assert got.shape == (23, 300) and got.dtype == x.dtype
            # the row's norm summed in another order: fp32 roundings apart
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (block_k, with_residual)
            if with_residual:  # the residual written into y's storage, as gated_residual_ writes it
                assert (extra[0] - residual).abs().max() <= 1e-6 * residual.abs().max(), block_k
            extra = (y.clone(), gate) if with_residual else ()
            quotients, scales = block_norm_triton(x, weight, shift, scale, rows, 1e-6, *extra,
                                                  smallest=_SMALLEST_SCALE, codes_dtype=torch.float32, block_k=block_k)
            assert quotients.shape == (23, 300) and scales.shape == (23, 1)
            assert ((scales - ref_scales).abs() <= ref_scales * 1e-5).all()
            assert ((quotients - codes.float()).abs() <= 448 / 16).all()  # within one e4m3 step of the reference
    print("OK")
    """
)


def test_triton_block_norm_under_interpreter_matches_the_written_functions():
    assert run_interpreted(BLOCK_NORM_CHECK).split()[-1] == "OK"


SWIGLU_CHECK = textwrap.dedent(
    """
    import torch
    from h3_core.models.block_triton import swiglu_triton
    from h3_core.models.block_fused import swiglu_

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        # 37 rows of an FFN 40 wide, in a larger buffer (a row stride of its own); tiles that split the rows
        # and the columns, or cover them
        whole = (torch.randn(37, 96, generator=g) * 4).to(dtype)
        want = swiglu_(whole[:, :80].clone())
        for block_r, block_c in ((4, 16), (1, 64), (64, 8)):
            buffer = whole.clone()
            got = swiglu_triton(buffer[:, :80], block_r, block_c)
            assert got.shape == (37, 40) and got.data_ptr() == buffer.data_ptr()
            assert torch.equal(buffer[:, 40:], whole[:, 40:])  # the up half and the rest of the row untouched
            step = 2**-7 if dtype == torch.bfloat16 else 1e-6
            assert ((got.float() - want.float()).abs() <= want.float().abs() * step + 1e-6).all(), (dtype, block_r)
    print("OK")
    """
)


def test_triton_swiglu_under_interpreter_matches_the_written_function():
    assert run_interpreted(SWIGLU_CHECK).split()[-1] == "OK"


GATED_RESIDUAL_CHECK = textwrap.dedent(
    """
    import torch
    from h3_core.models.block_triton import gate_heads_triton, gated_residual_triton
    from h3_core.models.block_fused import gate_heads_, gated_residual_

    # fp32 rows (the interpreter emulates bf16 by truncation; bf16 runs in the GPU test)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(29, 70, generator=g)[:, 3:53]  # a row stride of its own
    y = torch.randn(29, 50, generator=g)
    gate = torch.randn(6, 50, generator=g)
    rows = torch.randint(0, 6, (29,), generator=g)
    want = gated_residual_(x, y.clone(), gate, rows)
    for block_r, block_c in ((4, 16), (1, 64), (32, 8)):  # tiles splitting the rows and the columns, or not
        out = y.clone()
        got = gated_residual_triton(x, out, gate, rows, block_r, block_c)
        assert got.data_ptr() == out.data_ptr()  # written into y's storage
        assert (got - want).abs().max() <= 1e-6 * want.abs().max(), (block_r, block_c)
    # y strided too (a column slice of a wider buffer)
    wide = torch.randn(29, 64, generator=g)
    want = gated_residual_(x, wide[:, 7:57].clone(), gate, rows)
    got = gated_residual_triton(x, wide[:, 7:57], gate, rows)
    assert (wide[:, 7:57] - want).abs().max() <= 1e-6 * want.abs().max()

    soft = torch.randn(31, 5, 40, generator=g)
    head_gate = torch.rand(31, 5, generator=g)
    want = gate_heads_(soft.clone(), head_gate)
    for block_r in (1, 16, 64):
        out = soft.clone()
        got = gate_heads_triton(out, head_gate, block_r)
        assert got.data_ptr() == out.data_ptr()
        assert (got - want).abs().max() <= 1e-6 * want.abs().max(), block_r
    # heads of a fused projection (a head stride and a row stride of their own)
    fused = torch.randn(31, 3, 5, 40, generator=g)
    want = gate_heads_(fused[:, 2].clone(), head_gate)
    gate_heads_triton(fused[:, 2], head_gate)
    assert (fused[:, 2] - want).abs().max() <= 1e-6 * want.abs().max()
    print("OK")
    """
)


def test_triton_gated_residual_and_head_gate_under_interpreter_match_the_written_functions():
    assert run_interpreted(GATED_RESIDUAL_CHECK).split()[-1] == "OK"
