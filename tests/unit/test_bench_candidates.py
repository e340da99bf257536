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


def test_candidate_in_place_inverse_by_halves_matches_the_library_form():
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from candidate_kernels import spd_inverse_in_place

    from h3_core.models.linear_branch import spd_inverse

    g = torch.Generator().manual_seed(1)
    # a frame × head batch at the model's size, a 3-d batch, and sizes whose halves stop at odd widths
    for shape in ((3, 2, 128, 20), (5, 64, 30), (4, 40, 10)):
        k = torch.randn(*shape, generator=g, dtype=torch.float64)
        M = k @ k.transpose(-1, -2) / shape[-1] + torch.eye(shape[-2], dtype=torch.float64)
        got = spd_inverse_in_place(M)
        assert got.shape == M.shape and got.is_contiguous()
        assert (got - spd_inverse(M)).abs().max() <= 1e-12, shape
        assert (got @ M - torch.eye(shape[-2], dtype=torch.float64)).abs().max() <= 1e-12, shape
