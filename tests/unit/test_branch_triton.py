"""The linear branch's Triton kernels (h3_core.models.branch_triton) against the written functions of
branch_fused (the temporal conv + SiLU + L2 + √β, the readout, the scans, the gather) and the solve's leaf
inverse, under Triton's CPU interpreter."""

import textwrap

from triton_interpreter import run_interpreted

CHECK = textwrap.dedent(
    """
    import torch
    from h3_core.models.branch_triton import conv_features_triton
    from h3_core.models.branch_fused import conv_features

    g = torch.Generator().manual_seed(0)
    frames, tokens, heads, d = 6, 37, 3, 24  # tokens and d not multiples of the tiles
    y = torch.randn(frames, tokens, heads * d, generator=g)
    taps = torch.randn(heads * d, 1, 5, generator=g)
    beta = torch.sigmoid(torch.randn(frames, tokens, heads, generator=g))
    three = torch.randn(heads * d, 1, 3, generator=g)
    # five taps walked through the frames (the model's), the per-frame kernel, and three taps (per frame too)
    for w, rolling in ((taps, True), (taps, False), (three, True)):
        for normalize in (True, False):
            for b in (beta, None):
                got = conv_features_triton(y, w, heads, normalize, b, rolling=rolling, block_s=16)
                want = conv_features(y, w, heads, normalize, b)
                assert got.shape == (frames, heads, tokens, d) and got.is_contiguous()
                assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (w.shape, rolling, normalize, b is None)
    for short in (y[:1], y[:2]):  # fewer frames than taps
        b = beta[: len(short)]
        got, want = conv_features_triton(short, taps, heads, True, b), conv_features(short, taps, heads, True, b)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), len(short)
    half = y.to(torch.bfloat16)
    got, want = conv_features_triton(half, taps, heads, True, beta), conv_features(half, taps, heads, True, beta)
    got, want = got.float(), want.float()
    assert ((got - want).abs() <= want.abs() * 2**-7 + 1e-5 * want.abs().max()).all()
    print("OK")
    """
)


def test_triton_conv_features_under_interpreter_match_the_written_function():
    assert run_interpreted(CHECK).split()[-1] == "OK"


SPATIAL_CHECK = textwrap.dedent(
    """
    import torch
    from h3_core.models.branch_fused import spatial_conv
    from h3_core.models.branch_triton import spatial_conv_triton

    g = torch.Generator().manual_seed(0)
    # grids smaller than the taps, and channels not a multiple of the block
    for frames, grid, channels in ((3, (4, 6), 40), (2, (1, 2), 16), (2, (7, 3), 33)):
        x = torch.randn(frames, grid[0] * grid[1], channels, generator=g)
        w = torch.randn(channels, 1, 5, 5, generator=g)
        got = spatial_conv_triton(x, w, grid, block_c=16, warps=1)
        want = spatial_conv(x.double(), w.double(), grid)
        assert got.shape == x.shape and got.dtype == x.dtype
        assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max(), (frames, grid, channels)
    print("OK")
    """
)


def test_triton_spatial_conv_under_interpreter_matches_the_exact_convolution():
    assert run_interpreted(SPATIAL_CHECK).split()[-1] == "OK"


READOUT_CHECK = textwrap.dedent(
    """
    import torch
    from h3_core.models import branch_fused
    from h3_core.models.branch_triton import readout_triton

    g = torch.Generator().manual_seed(0)
    for heads, d in ((3, 16), (2, 24)):  # d a power of two, and not (masked to the tile)
        frames, tokens = 4, 37  # tokens not a multiple of the tile
        q_raw = torch.randn(frames, tokens, 3, heads, d, generator=g)[:, :, 0]  # q of a fused projection
        state = torch.randn(frames, heads, d, d, generator=g)
        weight, logits = torch.randn(d, generator=g), torch.randn(frames * tokens, heads * d, generator=g)
        want = branch_fused.readout(q_raw, state, weight, logits)
        got = readout_triton(q_raw, state, weight, logits, block_s=16)
        assert got.shape == want.shape == (frames * tokens, heads * d) and got.dtype == want.dtype
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), d
    print("OK")
    """
)


def test_triton_readout_under_interpreter_matches_the_written_function():
    assert run_interpreted(READOUT_CHECK).split()[-1] == "OK"


SCAN_CHECK = textwrap.dedent(
    """
    import torch
    from h3_core.models import branch_fused
    from h3_core.models.branch_triton import scan_triton
    from h3_core.models.branch_math import frame_statistics, scan_reference, solve

    g = torch.Generator().manual_seed(4)
    frames, tokens, heads, d = 7, 40, 3, 32
    k = torch.nn.functional.normalize(torch.randn(frames, tokens, heads, d, generator=g), dim=-1)
    v = torch.randn(frames, tokens, heads, d, generator=g)
    beta = torch.sigmoid(torch.randn(frames, tokens, heads, generator=g))
    alpha = torch.rand(frames, heads, d, generator=g) * 0.3 + 0.7
    T, J = solve(alpha, *frame_statistics(k, v, beta))
    seed = torch.randn(heads, d, d, generator=g) * 0.5
    P_ref, Q_ref = scan_reference(T, J, seed)
    for block_v in (16, 32):  # one and two row blocks per head
        P, Q = scan_triton(T, J, seed, block_v=block_v, warps=4)
        assert P.shape == Q.shape == J.shape and P.dtype == torch.float32
        for got, want in ((P, P_ref), (Q, Q_ref)):
            assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), block_v
    # off CUDA the fused mode runs the library's per-frame scan
    P, Q = branch_fused.scan("compiled", T, J, seed)
    assert (P.double() - P_ref).abs().max() <= 1e-5 * P_ref.abs().max()
    print("OK")
    """
)


def test_triton_scan_under_interpreter_matches_the_reference():
    assert run_interpreted(SCAN_CHECK).split()[-1] == "OK"


GATHER_CHECK = textwrap.dedent(
    """
    import torch
    from h3_core.attention.layout import window_bounds
    from h3_core.models.branch_triton import gather_triton
    from h3_core.models.branch_math import gather_reference

    g = torch.Generator().manual_seed(5)
    frames, heads, d = 9, 2, 16
    P, Q = torch.randn(frames, heads, d, d, generator=g), torch.randn(frames, heads, d, d, generator=g)
    seed = torch.randn(heads, d, d, generator=g)
    alpha = torch.rand(frames, heads, d, generator=g) * 0.3 + 0.7
    for radius, chunk in ((1, 3), (2, 0), (20, 0)):  # windows with both neighbours, and one covering all
        bounds = window_bounds(frames, radius, chunk)
        want = gather_reference(P, Q, alpha, bounds, seed)
        got = gather_triton(P, Q, alpha, bounds, seed, block_v=16)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), (radius, chunk)
        half = gather_triton(P, Q, alpha, bounds, seed, block_v=16, out_dtype=torch.float16)  # rounded as written
        assert half.dtype == torch.float16 and torch.equal(half, got.half()), (radius, chunk)
    print("OK")
    """
)


def test_triton_gather_under_interpreter_matches_the_reference():
    assert run_interpreted(GATHER_CHECK).split()[-1] == "OK"


SMALL_INVERSE_CHECK = textwrap.dedent(
    """
    import torch
    from h3_core.models import branch_fused
    from h3_core.models.branch_triton import small_inverse_triton
    from h3_core.models.branch_math import solve, solve_reference

    g = torch.Generator().manual_seed(6)
    def spd(*batch, n):  # I + Σ k kᵀ over more tokens than channels, as the solve's blocks are
        k = torch.nn.functional.normalize(torch.randn(*batch, 3 * n, n, generator=g, dtype=torch.float64), dim=-1)
        return torch.eye(n, dtype=torch.float64) + k.transpose(-1, -2) @ k
    # a frame × head batch of 16-row blocks (more than one program's worth), a block of 9 rows (padded
    # to 16), one row, and 32 rows
    for batch, n in (((5, 7), 16), ((3,), 9), ((4,), 1), ((2,), 32)):
        M = spd(*batch, n=n)
        whole = torch.full((*batch, n, n + 3), float("nan"))  # written through a view of a larger tensor
        got = small_inverse_triton(M.float(), whole[..., :n])
        assert got.data_ptr() == whole.data_ptr() and whole[..., n:].isnan().all()
        want = torch.linalg.inv(M)
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), (batch, n)
    # the solve with its leaves inverted by the kernel, against the fp64 reference and the library's leaves
    A = spd(6, 2, n=64).float() - torch.eye(64)
    B, alpha = torch.randn(6, 2, 64, 64, generator=g), torch.rand(6, 2, 64, generator=g) * 0.5 + 0.5
    leaf = branch_fused.small_inverse("compiled", "cpu")
    plain, want = solve(alpha, A, B), solve_reference(alpha, A, B)
    for base in (16, 32):
        for a, b, c in zip(solve(alpha, A, B, leaf, base), plain, want):
            assert (a.double() - c).abs().max() <= 1e-4 * c.abs().max(), base
            assert (a - b).abs().max() <= 1e-4 * b.abs().max(), base
    from h3_core.triton_forms import plain_path
    with plain_path():  # "compiled" with nothing compiled: the library's leaves
        assert branch_fused.small_inverse("compiled", "cpu") is None
    assert branch_fused.small_inverse(None, "cpu") is None
    print("OK")
    """
)


def test_triton_small_inverse_under_interpreter_inverts_the_solve_blocks():
    assert run_interpreted(SMALL_INVERSE_CHECK).split()[-1] == "OK"


SHIFTED_GRAM_CHECK = textwrap.dedent(
    """
    import torch
    from h3_core.models.branch_fused import shifted_gram
    from h3_core.models.branch_triton import shifted_gram_triton

    g = torch.Generator().manual_seed(2)
    for d, block in ((16, 16), (40, 16), (24, 32)):  # tiles that cover the matrix, split it, or overhang it
        A = torch.randn(3, 2, d, d, generator=g)
        got = shifted_gram_triton(A, block)
        assert got.shape == A.shape and torch.equal(got, shifted_gram(A)), (d, block)
    print("OK")
    """
)


def test_triton_shifted_gram_under_interpreter_equals_the_written_function():
    assert run_interpreted(SHIFTED_GRAM_CHECK).split()[-1] == "OK"
