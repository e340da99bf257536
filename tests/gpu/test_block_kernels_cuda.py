"""The block's hand-written Triton kernels on a CUDA GPU (skipped without one) against the written functions
of h3_core.models.block_fused, at the model's head size."""

import fused_eager
import pytest
import torch
from quantized_rows import assert_codes_within_a_step

from h3_core.models import block_fused
from h3_core.models.branch_fused import triton_kernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary", [96, None])
def test_triton_qk_norm_rope_matches_the_written_function(dtype, rotary):
    if triton_kernel("qk_norm_rope", "cuda") is None:
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(1500, 3, 8, 128, generator=g) * 3).to(DEV, dtype)
    weight = torch.randn(128, generator=g).to(DEV, dtype)
    cos = sin = None
    if rotary:
        angles = torch.randn(1500, rotary // 2, generator=g).repeat(1, 2)
        cos, sin = angles.cos().to(DEV), angles.sin().to(DEV)
    from h3_core.models.block_triton import qk_norm_rope_triton

    for x, per_head in ((qkv[:, 0], False), (qkv[:, 1], False), (qkv[:, 1], True)):
        got = (
            block_fused.run("compiled", "qk_norm_rope", x, weight, cos, sin, 1e-6)
            if not per_head
            else qk_norm_rope_triton(x, weight, cos, sin, 1e-6, per_head=True)
        )
        want = fused_eager.written(block_fused.run, "qk_norm_rope", x, weight, cos, sin, 1e-6)
        assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
        if dtype == torch.float32:
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        else:  # one fp32 result rounded once by both: one bf16 step apart, or fp32 roundoff where the
            # rotation's two products cancel
            got, want = got.float(), want.float()
            assert ((got - want).abs() <= want.abs() * 2**-7 + 1e-5 * want.abs().max()).all()


@pytest.mark.parametrize("hidden, dtype", [(5376, torch.bfloat16), (5376, torch.float16), (40, torch.bfloat16)])
def test_triton_block_norm_matches_the_written_functions(hidden, dtype):
    """The block's norm + modulation in one Triton pass, alone (the attention's input) and after the gated
    residual (the FFN's), written and quantised, against the written functions run as written: the row's
    norm is summed in another order, so a value on a rounding boundary may round the other way — each result
    within a step of the rows' dtype, the scales too, at most one code in a thousand one e4m3 step apart."""
    from h3_core.models.block_fused import block_triton
    from h3_core.models.block_triton import block_norm_triton
    from h3_core.models.fp8_linear import quantize_input
    from h3_core.triton_forms import triton_form

    if triton_form(block_triton, "block_norm_triton", "cuda") is None:
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(300, hidden, generator=g) * torch.logspace(-3, 3, 300)[:, None]).to(DEV, dtype)
    y = (torch.randn(300, hidden, generator=g) * 4).to(DEV, dtype)
    weight = torch.randn(hidden, generator=g).to(DEV, dtype)
    gate, shift, scale = (torch.randn(6, hidden, generator=g).to(DEV, dtype) for _ in range(3))
    rows = torch.randint(0, 6, (300,), generator=g).to(DEV)
    step = 2**-7 if dtype == torch.bfloat16 else 2**-10
    residual = fused_eager.written(block_fused.run, "gated_residual_", x, y.clone(), gate, rows)

    def close(got, want):
        got, want = got.float(), want.float()
        return ((got - want).abs() <= want.abs() * step + 1e-6 * want.abs().max()).all()

    norm = (weight, shift, scale, rows, 1e-6)
    assert close(block_norm_triton(x, *norm), fused_eager.written(block_fused.run, "norm_modulate", x, *norm))
    assert close(
        block_fused.run("compiled", "norm_modulate", x, *norm),  # the attention input's, by name
        fused_eager.written(block_fused.run, "norm_modulate", x, *norm),
    )
    assert_codes_within_a_step(
        block_fused.norm_modulate_quantized("compiled", x, *norm),
        quantize_input(fused_eager.written(block_fused.run, "norm_modulate", x, *norm)),
        step,
    )
    for quantized in (False, True):
        written = y.clone()
        got_x, got_h = block_fused.residual_norm(
            "compiled", x, written, gate, rows, weight, shift, scale, 1e-6, quantized
        )
        want_x, want_h = fused_eager.written(
            block_fused.residual_norm, x, y.clone(), gate, rows, weight, shift, scale, 1e-6, quantized
        )
        assert got_x.data_ptr() == written.data_ptr() and close(got_x, residual) and close(want_x, residual)
        if quantized:
            assert_codes_within_a_step(got_h, want_h, step)
        else:
            assert got_h.shape == (300, hidden) and got_h.dtype == dtype and close(got_h, want_h)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_swiglu_matches_the_written_function(dtype):
    """SiLU·up written into fc1's output by the Triton pass (the bf16 FFN's, by name) against the written
    function: one fp32 product rounded once by both, the up half untouched; more rows than one grid axis of
    a launch with a row a program holds (65,535)."""
    if triton_kernel("swiglu_", "cuda") is None:
        pytest.skip("needs Triton")
    from h3_core.models.block_triton import swiglu_triton

    g = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(70_000, 2 * 96, generator=g) * 4).to(DEV, dtype)
    want = fused_eager.written(block_fused.run, "swiglu_", gate_up.clone())
    step = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-6}[dtype]
    for got_from in (lambda t: block_fused.run("compiled", "swiglu_", t), lambda t: swiglu_triton(t, 1, 128, 4)):
        written = gate_up.clone()
        got = got_from(written)
        assert got.data_ptr() == written.data_ptr() and got.shape == (70_000, 96)
        assert torch.equal(written[:, 96:], gate_up[:, 96:])
        assert ((got.float() - want.float()).abs() <= want.float().abs() * step + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_gated_residual_and_head_gate_match_the_written_functions(dtype):
    """The block's last residual and the softmax's head gate, as ``"compiled"`` runs them on CUDA (by name:
    the Triton passes, no dynamo) against the written functions: one fp32 result rounded once by both, at the
    model's width and head size, over more rows than one grid axis holds."""
    if triton_kernel("gated_residual_", "cuda") is None or triton_kernel("gate_heads_", "cuda") is None:
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(6)
    rows, hidden = 70_000, 5120
    x, y = (torch.randn(rows, hidden, generator=g).to(DEV, dtype) for _ in range(2))
    gate = torch.randn(12, hidden, generator=g).to(DEV, dtype)
    table_rows = torch.randint(0, 12, (rows,), generator=g).to(DEV)
    step = {torch.bfloat16: 2**-7, torch.float32: 1e-6}[dtype]

    def close(got, want):
        return ((got.float() - want.float()).abs() <= want.float().abs() * step + 1e-5).all()

    want = fused_eager.written(block_fused.run, "gated_residual_", x, y.clone(), gate, table_rows)
    written = y.clone()
    got = block_fused.run("compiled", "gated_residual_", x, written, gate, table_rows)
    assert got.data_ptr() == written.data_ptr() and close(got, want)
    soft = torch.randn(rows, 40, 128, generator=g).to(DEV, dtype)
    head_gate = torch.rand(rows, 40, generator=g).to(DEV, dtype)
    want = fused_eager.written(block_fused.run, "gate_heads_", soft.clone(), head_gate)
    written = soft.clone()
    got = block_fused.run("compiled", "gate_heads_", written, head_gate)
    assert got.data_ptr() == written.data_ptr() and close(got, want)


@pytest.mark.parametrize("normalize, with_beta", [(True, True), (False, True), (True, False)])
def test_triton_conv_features_match_the_written_function(normalize, with_beta):
    from h3_core.models import branch_fused

    if triton_kernel("conv_features", "cuda") is None:
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(2)
    frames, grid, heads = 9, (6, 8), 4
    # k of a fused projection [F, S, 3, C], as the branch gets it
    raw = torch.randn(frames, grid[0] * grid[1], 3, heads * 128, generator=g).to(DEV, torch.bfloat16)[:, :, 1]
    spatial = (torch.randn(heads * 128, 1, 5, 5, generator=g) / 5).to(DEV, torch.bfloat16)
    taps = (torch.randn(heads * 128, 1, 5, generator=g) / 2).to(DEV, torch.bfloat16)
    beta = torch.sigmoid(torch.randn(frames, grid[0] * grid[1], heads, generator=g)).to(DEV, torch.bfloat16)
    y = branch_fused.spatial_conv(raw, spatial, grid)
    from h3_core.models.branch_triton import conv_features_triton

    args = (y, taps, heads, normalize, beta if with_beta else None)
    want = fused_eager.written(branch_fused.run, "conv_features", *args).float()
    # the library's launch (five taps walked through the frames), and a program per frame and tile
    for got in (branch_fused.run("compiled", "conv_features", *args), conv_features_triton(*args, rolling=False)):
        assert got.shape == (frames, heads, grid[0] * grid[1], 128) and got.dtype == torch.bfloat16
        got = got.float()
        assert ((got - want).abs() <= want.abs() * 2**-7 + 1e-5 * want.abs().max()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grid, channels", [((24, 42), 512), ((7, 3), 200), ((1, 2), 128)])
def test_triton_spatial_conv_is_one_rounding_of_the_exact_convolution(grid, channels, dtype):
    from h3_core.models import branch_fused

    if triton_kernel("spatial_conv", "cuda") is None:
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(5)
    frames = 3
    # v of a fused projection [F, S, 3, C] (a strided view), and the model's 5×5 taps
    x = torch.randn(frames, grid[0] * grid[1], 3, channels, generator=g).to(DEV, dtype)[:, :, 2]
    weight = (torch.randn(channels, 1, 5, 5, generator=g) / 5).to(DEV, dtype)
    exact = branch_fused.spatial_conv(x.double(), weight.double(), grid)
    got = branch_fused.spatial("compiled", x, weight, grid)
    cudnn = fused_eager.written(branch_fused.spatial, x, weight, grid)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    step = 2**-8 if dtype == torch.bfloat16 else 2**-20  # one rounding of the exact sum, and fp32 sums' error
    bound = exact.abs() * step + 1e-6 * exact.abs().max()
    assert ((got.double() - exact).abs() <= bound).all()
    assert ((cudnn.double() - exact).abs() <= bound).all()  # cuDNN's, the library's form, by the same measure


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_readout_matches_the_written_function(dtype):
    from h3_core.models import branch_fused

    if triton_kernel("readout", "cuda") is None:
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(3)
    frames, tokens, heads = 5, 150, 4  # tokens not a multiple of the tile
    q_raw = torch.randn(frames, tokens, 3, heads, 128, generator=g).to(DEV, dtype)[:, :, 0]  # the projection's q
    state = (torch.randn(frames, heads, 128, 128, generator=g) / 8).to(DEV)
    weight = torch.randn(128, generator=g).to(DEV, dtype)
    logits = torch.randn(frames * tokens, heads * 128, generator=g).to(DEV, dtype)
    got = branch_fused.run("compiled", "readout", q_raw, state, weight, logits)
    want = fused_eager.written(branch_fused.run, "readout", q_raw, state, weight, logits)
    assert got.shape == want.shape == (frames * tokens, heads * 128) and got.dtype == dtype
    got, want = got.float(), want.float()
    if dtype == torch.float32:
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    else:  # the product's sums in another order can round it one bf16 step apart before the norm
        assert ((got - want).abs() <= want.abs() * 2**-6 + 1e-2 * want.abs().max()).all()


@pytest.mark.parametrize("frames", [1, 100])
def test_triton_scan_matches_the_fp64_reference(frames):
    from h3_core.models import branch_fused
    from h3_core.models.branch_math import frame_statistics, scan, scan_reference, solve

    if triton_kernel("scan", "cuda") is None:
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(5)
    heads, d = 6, 128
    k = torch.nn.functional.normalize(torch.randn(frames, 300, heads, d, generator=g), dim=-1)
    v = torch.randn(frames, 300, heads, d, generator=g)
    beta = torch.sigmoid(torch.randn(frames, 300, heads, generator=g))
    alpha = torch.rand(frames, heads, d, generator=g) * 0.3 + 0.7  # trained-like decays: state carried far
    T, J = (t.to(DEV) for t in solve(alpha, *frame_statistics(k, v, beta)))
    seed = (torch.randn(heads, d, d, generator=g) * 0.5).to(DEV)
    P_ref, Q_ref = scan_reference(T.cpu(), J.cpu(), seed.cpu())
    fused = branch_fused.scan("compiled", T, J, seed)
    library = scan(T, J, seed)
    for got, lib, want in zip(fused, library, (P_ref, Q_ref)):
        # three TF32 passes per product: as close to fp64 as the per-frame fp32 GEMMs
        err, lib_err = ((t.cpu().double() - want).abs().max() for t in (got, lib))
        assert err <= max(4 * lib_err, 1e-6 * want.abs().max()), (err, lib_err)


def test_triton_gather_matches_the_fp64_reference():
    from h3_core.attention.layout import window_bounds
    from h3_core.models import branch_fused
    from h3_core.models.branch_math import gather_reference

    if triton_kernel("gather", "cuda") is None:
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(6)
    frames, heads, d = 100, 4, 128
    P, Q = (torch.randn(frames, heads, d, d, generator=g) for _ in range(2))
    seed = torch.randn(heads, d, d, generator=g)
    alpha = torch.rand(frames, heads, d, generator=g) * 0.3 + 0.7
    bounds = [(lo - 1, hi - 1) for lo, hi in window_bounds(frames + 2, 1, 5)[1 : frames + 1]]  # the release's
    got = branch_fused.gather("compiled", P.to(DEV), Q.to(DEV), alpha.to(DEV), bounds, seed.to(DEV))
    want = gather_reference(P, Q, alpha, bounds, seed)
    assert (got.cpu().double() - want).abs().max() <= 1e-5 * want.abs().max()
    # gathered straight into the rows' dtype, as the fused readout takes it: the fp32 states rounded once
    rounded = branch_fused.gather("compiled", P.to(DEV), Q.to(DEV), alpha.to(DEV), bounds, seed.to(DEV), torch.bfloat16)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, got.to(torch.bfloat16))


def test_triton_leaf_inverse_solves_as_the_library_does():
    """The solve at the model's head size with its 16-row leaves inverted by the Triton kernel, against the
    fp64 reference, no further from it than the library's leaves (LU with pivoting) are."""
    from h3_core.models import branch_fused
    from h3_core.models.branch_math import frame_statistics, solve, solve_reference

    leaf = branch_fused.small_inverse("compiled", "cuda")
    if leaf is None:
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(8)
    frames, heads, d = 12, 5, 128
    k = torch.nn.functional.normalize(torch.randn(frames, 1008, heads, d, generator=g), dim=-1)
    v = torch.randn(frames, 1008, heads, d, generator=g)
    beta = torch.sigmoid(torch.randn(frames, 1008, heads, generator=g))
    A, B = (t.to(DEV) for t in frame_statistics(k, v, beta))
    alpha = (torch.rand(frames, heads, d, generator=g) * 0.3 + 0.7).to(DEV)
    want = solve_reference(alpha.cpu(), A.cpu(), B.cpu())
    for got, lib, ref in zip(solve(alpha, A, B, leaf), solve(alpha, A, B), want):
        err, lib_err = ((t.cpu().double() - ref).abs().max() for t in (got, lib))
        assert err <= max(2 * lib_err, 1e-6 * ref.abs().max()), (err, lib_err)


def test_triton_shifted_gram_equals_the_written_function():
    """I + ½(A + Aᵀ) for the release size's Gram products (56 heads of 128 channels, a few frames) as
    ``"compiled"`` runs it on CUDA, bit for bit the written function's."""
    if triton_kernel("shifted_gram", "cuda") is None:
        pytest.skip("needs Triton")
    from h3_core.models import branch_fused

    A = torch.randn(5, 56, 128, 128, generator=torch.Generator().manual_seed(7)).to(DEV)
    k, v = A[..., :96].contiguous(), A[..., 32:].contiguous()  # [F, h, S, d]: 128 tokens of 96 channels
    got, _ = branch_fused.shifted_statistics("compiled", k, v)
    want, _ = fused_eager.written(branch_fused.shifted_statistics, k, v)
    assert torch.equal(got, want)
