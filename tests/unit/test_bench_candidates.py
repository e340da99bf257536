"""bench/candidate_kernels.py against the library's forms, under Triton's CPU interpreter."""

import textwrap

from triton_interpreter import run_interpreted

CHECK = textwrap.dedent(
    """
    import torch
    from candidate_kernels import swiglu_in_place
    from h3_core.models.block_fused import swiglu_

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        # 37 rows of an FFN 40 wide, in a larger buffer (a row stride of its own); tiles that split the rows
        # and the columns, or cover them
        whole = (torch.randn(37, 96, generator=g) * 4).to(dtype)
        want = swiglu_(whole[:, :80].clone())
        for block_r, block_c in ((4, 16), (1, 64), (64, 8)):
            buffer = whole.clone()
            got = swiglu_in_place(buffer[:, :80], block_r, block_c)
            assert got.shape == (37, 40) and got.data_ptr() == buffer.data_ptr()
            assert torch.equal(buffer[:, 40:], whole[:, 40:])  # the up half and the rest of the row untouched
            step = 2**-7 if dtype == torch.bfloat16 else 1e-6
            assert ((got.float() - want.float()).abs() <= want.float().abs() * step + 1e-6).all(), (dtype, block_r)
    print("OK")
    """
)


def test_candidate_swiglu_in_place_under_interpreter_matches_the_library_form():
    assert run_interpreted(CHECK).split()[-1] == "OK"
