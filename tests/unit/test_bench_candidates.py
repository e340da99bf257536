"""bench/candidate_kernels.py against the library's forms, under Triton's CPU interpreter."""

import textwrap

from triton_interpreter import run_interpreted

CHECK = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "bench")
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
