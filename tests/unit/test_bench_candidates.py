"""bench/candidate_kernels.py against the library's forms, under Triton's CPU interpreter."""

import textwrap

from triton_interpreter import run_interpreted

CHECK = textwrap.dedent(
    """
    import torch
    from candidate_kernels import spatial_conv_slab
    from h3_core.models.branch_fused import spatial_conv

    g = torch.Generator().manual_seed(0)
    for grid in ((5, 7), (3, 4), (1, 6)):  # taller and shorter than the window
        tokens = grid[0] * grid[1]
        k = torch.randn(4, tokens, 3, 40, generator=g)[:, :, 1]  # a strided slice [F, S, C] of [F, S, 3, C]
        weight = torch.randn(40, 1, 5, 5, generator=g)
        want = spatial_conv(k.contiguous(), weight, grid)
        for block_s, block_c in ((16, 16), (64, 64), (8, 32)):  # tiles that split frames and channels, or not
            got = spatial_conv_slab(k, weight, grid, block_s, block_c)
            assert got.shape == (4, tokens, 40) and got.is_contiguous()
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (grid, block_s, block_c)
    print("OK")
    """
)


def test_candidate_spatial_conv_under_interpreter_matches_the_library_form():
    assert run_interpreted(CHECK).split()[-1] == "OK"
