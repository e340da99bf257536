"""bench/candidate_kernels.py against the library's forms, under Triton's CPU interpreter."""

import textwrap

from triton_interpreter import run_interpreted

CHECK = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "bench")
    import torch
    from candidate_kernels import spatial_conv_triton
    from h3_core.models.branch_fused import spatial_conv

    g = torch.Generator().manual_seed(0)
    k = torch.randn(4, 35, 3, 40, generator=g)[:, :, 1]  # k of a fused projection [F, S, 3, C]; a 5 x 7 grid
    weight = torch.randn(40, 1, 5, 5, generator=g)
    want = spatial_conv(k.contiguous(), weight, (5, 7))
    for block_c in (16, 64):  # channel tiles that do and do not divide C
        got = spatial_conv_triton(k, weight, (5, 7), block_c, 4)
        assert got.shape == (4, 35, 40) and got.is_contiguous()
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), block_c
    print("OK")
    """
)


def test_candidate_spatial_conv_under_interpreter_matches_the_library_form():
    assert run_interpreted(CHECK).split()[-1] == "OK"
