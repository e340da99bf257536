"""Scaled dtype conversion of rows (h3_core.attention.convert / _convert_triton)."""

import textwrap

import torch
from triton_interpreter import run_interpreted

from h3_core.attention.convert import scale_convert, scale_convert_reference


def test_reference_scales_in_float32_then_casts():
    src = torch.tensor([[[29952.0, -149504.0, 2.0]]], dtype=torch.bfloat16)  # exact in bf16
    dst = torch.empty(1, 1, 3, dtype=torch.float16)
    scale_convert_reference(src, dst, torch.tensor([0.25]))
    # 149504 * 0.25 fits fp16 although 1.5e5 does not: the product is taken before the cast.
    assert dst.tolist() == [[[7488.0, -37376.0, 0.5]]]


def test_reference_gates_each_row_and_head_before_the_cast():
    src = torch.tensor([[[3.0, 5.0], [7.0, 9.0]], [[1.0, 2.0], [4.0, 8.0]]], dtype=torch.bfloat16)
    gate = torch.tensor([[0.5, 2.0], [3.0, 0.25]], dtype=torch.bfloat16)
    dst = torch.empty(2, 2, 2, dtype=torch.float16)
    scale_convert_reference(src, dst, torch.tensor([2.0]), gate=gate)
    assert dst.tolist() == [[[3.0, 5.0], [28.0, 36.0]], [[6.0, 12.0], [2.0, 4.0]]]


def test_reference_saturates_only_when_asked():
    src = torch.tensor([[[1.0e5, -1.0e5, 1.0]]], dtype=torch.bfloat16)
    plain, clamped = torch.empty(1, 1, 3, dtype=torch.float16), torch.empty(1, 1, 3, dtype=torch.float16)
    scale_convert_reference(src, plain)
    scale_convert_reference(src, clamped, saturate=True)
    assert plain[0, 0, :2].isinf().all()
    assert clamped.tolist() == [[[65504.0, -65504.0, 1.0]]]


def test_dispatch_on_cpu_is_the_reference_and_writes_strided_views():
    g = torch.Generator().manual_seed(0)
    src = torch.randn(20, 6, 32, generator=g).to(torch.bfloat16)[3:17, 1:5, :24]
    out = torch.full((14, 8, 24), float("nan"), dtype=torch.float16)
    dst = out[:, 2:6]
    got = scale_convert(src, dst, torch.tensor([2.0]))
    assert got is dst
    assert torch.equal(dst, (src.float() * 2).half())
    assert out[:, :2].isnan().all() and out[:, 6:].isnan().all()


TRITON_CHECK = textwrap.dedent(
    """
    import itertools
    import torch
    from h3_core.attention.convert_triton import scale_convert_triton
    from h3_core.attention.convert import scale_convert_reference

    g = torch.Generator().manual_seed(1)
    src = (torch.randn(45, 7, 40, generator=g) * 3e4).to(torch.bfloat16)[:37, 2:5, :24]
    gates = (None, torch.rand(37, 5, generator=g).to(torch.bfloat16)[:, 1:4])
    worst = 0.0
    for scale, saturate, gate in itertools.product((None, torch.tensor([0.25])), (False, True), gates):
        fast = torch.full((37, 3, 24), float("nan"), dtype=torch.float16)
        ref = torch.empty(37, 3, 24, dtype=torch.float16)
        scale_convert_triton(src, fast, scale, saturate, gate)
        scale_convert_reference(src, ref, scale, saturate, gate)
        assert torch.equal(fast.isinf(), ref.isinf()) and not fast.isnan().any()
        finite = ~ref.isinf()
        worst = max(worst, (fast[finite].float() - ref[finite].float()).abs().max().item())
        assert saturate is False or not fast.isinf().any()
    print("MAXDIFF", worst)
    """
)


def test_triton_convert_under_interpreter_matches_reference():
    diff = float(run_interpreted(TRITON_CHECK).split("MAXDIFF")[-1])
    assert diff == 0.0
