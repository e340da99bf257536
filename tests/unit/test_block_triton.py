"""The Triton q/k norm + RoPE (h3_core.models._block_triton) against block_fused.qk_norm_rope, under Triton's
CPU interpreter, on a slice of a fused projection (row and head strides of the real one)."""

import textwrap

from triton_interpreter import run_interpreted

CHECK = textwrap.dedent(
    """
    import torch
    from h3_core.models._block_triton import qk_norm_rope_triton
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
