"""bench/candidate_kernels.py against the library's forms, under Triton's CPU interpreter."""

import textwrap

from triton_interpreter import run_interpreted

CHECK = textwrap.dedent(
    """
    import torch
    from candidate_kernels import spatial_conv_rolling
    from h3_core.models.branch_fused import spatial_conv

    g = torch.Generator().manual_seed(0)
    grid, C = (5, 7), 40
    weight = torch.randn(C, 1, 5, 5, generator=g)
    # k as a strided slice of a stacked projection [F, S, 3, C]; tiles that split the columns and the channels
    # (partial last tiles) or cover them
    stacked = torch.randn(3, 35, 3, C, generator=g)
    x = stacked[:, :, 1]
    want = spatial_conv(x.contiguous(), weight, grid)
    for block_x, block_c, hoist in ((4, 16, True), (8, 64, False), (2, 8, True)):
        got = spatial_conv_rolling(x, weight, grid, block_x, block_c, hoist=hoist)
        assert got.shape == (3, 35, C) and got.is_contiguous()
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (block_x, block_c, hoist)
    half = x.to(torch.bfloat16)
    want = spatial_conv(half.contiguous(), weight, grid).float()
    for hoist in (True, False):
        got = spatial_conv_rolling(half, weight, grid, hoist=hoist).float()
        # both sum 25 products of bf16 values in fp32 and round once, in other orders: one bf16 step apart
        assert ((got - want).abs() <= want.abs() * 2**-7 + 1e-6 * want.abs().max()).all(), hoist
    print("OK")
    """
)


def test_candidate_spatial_conv_under_interpreter_matches_the_library_form():
    assert run_interpreted(CHECK).split()[-1] == "OK"
