"""The fused linear-branch path (h3_core.models.branch_fused) equals the plain branch, piece by piece and
through the whole model."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from fused_eager import fused_written, written
from runs_given import runs_given
from tiny_dit import CFG, model, request

from h3_core.attention import WindowSpec
from h3_core.attention.layout import window_bounds
from h3_core.errors import H3InputError
from h3_core.models import branch_fused
from h3_core.models.branch_math import featurize, frame_statistics
from h3_core.models.hybrid import HybridContext
from h3_core.models.linear_branch import LinearBranch
from h3_core.models.low_memory import LowMemory
from h3_core.models.run_options import RunOptions, check_run_options


def rnd(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# An irregular geometry: 7 frames of a 3×5 grid, 3 heads of 4 channels.
FR, GRID, H, D = 7, (3, 5), 3, 4
S = GRID[0] * GRID[1]


def conv_weights(seed=10):
    return rnd(H * D, 1, 5, 5, seed=seed), rnd(H * D, 1, 5, seed=seed + 1)


@pytest.mark.parametrize("normalize", [True, False])
def test_conv_features_equal_the_plain_features(normalize):
    raw = rnd(FR, S, H, D, seed=1)
    spatial, temporal = conv_weights()
    conv = (spatial, temporal, spatial, temporal)
    _, k_plain, v_plain = featurize(raw, raw, raw, GRID, conv)
    y = branch_fused.spatial_conv(raw.view(FR, S, -1), spatial, GRID)
    fused = branch_fused.conv_features(y, temporal, H, normalize)
    assert fused.shape == (FR, H, S, D) and fused.is_contiguous()
    want = (k_plain if normalize else v_plain).permute(0, 2, 1, 3)
    assert (fused - want).abs().max() <= 1e-12


def test_conv_features_in_half_precision_are_no_worse_than_the_plain_features():
    bf = torch.bfloat16
    raw = rnd(FR, S, H, D, seed=2).to(bf)
    spatial, temporal = (w.to(bf) for w in conv_weights())
    conv = (spatial, temporal, spatial, temporal)
    exact = featurize(*(raw.double(),) * 3, GRID, tuple(w.double() for w in conv))[1].permute(0, 2, 1, 3)
    plain = featurize(raw, raw, raw, GRID, conv)[1].permute(0, 2, 1, 3)
    fused = branch_fused.conv_features(branch_fused.spatial_conv(raw.view(FR, S, -1), spatial, GRID), temporal, H, True)
    assert fused.dtype == bf
    fused_error, plain_error = ((t.double() - exact).abs().max() for t in (fused, plain))
    # Both paths round the spatial conv's output to bf16 (the largest error here: its taps' sums cancel in
    # the temporal conv); the plain path also rounds the temporal conv, SiLU and the norm, the fused one not.
    assert fused_error <= 1.1 * plain_error


def test_conv_features_with_beta_are_scaled_by_its_square_root():
    y = rnd(FR, S, H * D, seed=18)
    temporal = conv_weights()[1]
    beta = torch.sigmoid(rnd(FR, S, H, seed=19))
    scaled = branch_fused.conv_features(y, temporal, H, True, beta)
    plain = branch_fused.conv_features(y, temporal, H, True)
    assert (scaled - plain * beta.sqrt().permute(0, 2, 1)[..., None]).abs().max() <= 1e-12


def test_gram_statistics_of_scaled_features_are_the_frame_statistics():
    k, v = rnd(FR, S, H, D, seed=20), rnd(FR, S, H, D, seed=21)
    beta = torch.sigmoid(rnd(FR, S, H, seed=22))
    root = beta.sqrt()[..., None]
    A, B = branch_fused.gram_statistics((k * root).transpose(1, 2), (v * root).transpose(1, 2))
    A_want, B_want = frame_statistics(k, v, beta)
    assert A.shape == B.shape == (FR, H, D, D) and A.dtype == B.dtype == torch.float64
    assert (A - A_want).abs().max() <= 1e-12 * A_want.abs().max()
    assert (B - B_want).abs().max() <= 1e-12 * B_want.abs().max()
    assert torch.equal(A, A.transpose(-1, -2))


def test_gram_statistics_of_half_precision_features_sum_in_fp32():
    k = rnd(FR, H, S, D, seed=23, dtype=torch.bfloat16)
    A, B = branch_fused.gram_statistics(k, k)
    assert A.dtype == B.dtype == torch.float32
    wide = k.double()
    assert (A.double() - wide.transpose(-1, -2) @ wide).abs().max() <= 1e-5 * A.abs().max()


def test_shifted_statistics_are_identity_plus_the_gram_statistics():
    k, v = rnd(FR, H, S, D, seed=24), rnd(FR, H, S, D, seed=25)
    A, B = branch_fused.gram_statistics(k, v)
    shifted, B_shifted = written(branch_fused.shifted_statistics, k, v)
    assert torch.equal(B_shifted, B)
    assert torch.equal(shifted, A + torch.eye(D, dtype=A.dtype))
    # from a product that the GEMM left slightly asymmetric, the one pass symmetrises it first
    lopsided = A + 1e-3 * rnd(FR, H, D, D, seed=26)
    symmetrised = 0.5 * (lopsided + lopsided.transpose(-1, -2))
    assert torch.equal(branch_fused.shifted_gram(lopsided), symmetrised + torch.eye(D))


def test_query_features_equal_the_plain_features():
    q = rnd(FR, S, H, D, seed=3)
    q_plain, _, _ = featurize(q, q, q, GRID, None)
    assert (branch_fused.query_features(q) - q_plain.permute(0, 2, 1, 3)).abs().max() <= 1e-12


def test_readout_finish_equals_norm_then_gate():
    o = rnd(FR, H, S, D, seed=4)
    weight = rnd(D, seed=5)
    logits = rnd(FR * S, H * D, seed=6)
    want = F.rms_norm(o, (D,), weight, 1e-6).permute(0, 2, 1, 3).reshape(FR * S, -1) * torch.sigmoid(logits)
    assert (branch_fused.readout_finish(o, weight, logits) - want).abs().max() <= 1e-12


def branch(seed=0):
    torch.manual_seed(seed)
    m = LinearBranch(hidden=10, heads=H, head_dim=D, bottleneck=6).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.4)
    return m


@pytest.mark.parametrize("heads, frames_per_chunk", [(None, None), (slice(1, 3), None), (slice(0, 1), 3)])
def test_the_fused_branch_equals_the_plain_branch(heads, frames_per_chunk):
    m = branch()
    n = H if heads is None else heads.stop - heads.start
    x = rnd(FR * S, 10, seed=7)
    q, k, v = (rnd(FR * S, n, D, seed=s) for s in (8, 9, 10))
    bounds = window_bounds(FR, 1, 2)
    seed = rnd(n, D, D, seed=11) * 0.1
    run = RunOptions(branch_frames=frames_per_chunk)
    with torch.no_grad():
        plain = m(x, q, k, v, GRID, bounds, seed, heads, run=run)
        with fused_written(run, blocks=False) as fused_run:
            fused = m(x, q, k, v, GRID, bounds, seed, heads, run=fused_run)
    assert fused.shape == plain.shape == (FR * S, n * D)
    assert (fused - plain).abs().max() <= 1e-12 * plain.abs().max()


@pytest.mark.parametrize("options", [LowMemory(), LowMemory(head_groups=3, branch_frames=4)])
def test_a_model_with_fused_branches_equals_the_plain_model(options):
    m = model(True)
    packed, args = request()
    ctx = HybridContext(packed.layout, WindowSpec(1, 3, "both"), "ref", (0, 4))
    run = RunOptions().with_low_memory(options)
    branches = [b.attn.linear_attention for b in m.blocks]
    with torch.no_grad():
        plain = m(*args, hybrid=ctx, run=run)
        with fused_written(run, blocks=False) as fused_run, runs_given(branches) as branch_runs:
            fused = m(*args, hybrid=ctx, run=fused_run)
        assert {b for b, _ in branch_runs} == set(branches)
        assert all(
            r.branches_fused == "compiled" and r.blocks_fused is None and r.low_memory == options
            for _, r in branch_runs
        )
        with runs_given(branches) as branch_runs:
            again = m(*args, hybrid=ctx, run=run)
        assert {b for b, _ in branch_runs} == set(branches) and len(branches) == CFG.layers
        assert all(r.branches_fused is None for _, r in branch_runs)
    for a, b in zip(fused, plain):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max()
    for a, b in zip(again, plain):
        assert torch.equal(a, b)


def test_the_compiled_functions_equal_the_written_ones():
    # torch.compile on the CPU (C++ kernels): the same graphs the GPU compiles to Triton trace without breaks
    y, taps = rnd(FR, S, H * D, seed=12, dtype=torch.float32), rnd(H * D, 1, 5, seed=13, dtype=torch.float32)
    q = rnd(FR, S, H, D, seed=14, dtype=torch.float32)
    o, weight, logits = rnd(FR, H, S, D, seed=15), rnd(D, seed=16), rnd(FR * S, H * D, seed=17)
    beta = torch.sigmoid(rnd(FR, S, H, seed=24, dtype=torch.float32))
    for name, args in (
        ("conv_features", (y, taps, H, True)),
        ("conv_features", (y, taps, H, False, beta)),
        ("query_features", (q,)),
        ("readout_finish", (o.float(), weight.float(), logits.float())),
    ):
        compiled = branch_fused.run("compiled", name, *args)
        as_written = written(branch_fused.run, name, *args)
        assert (compiled - as_written).abs().max() <= 1e-5 * as_written.abs().max(), name


def test_a_bad_mode_is_named():
    with pytest.raises(H3InputError, match=r"branches_fused: got 'fast'; allowed: \(None, 'compiled'\)"):
        check_run_options(replace(RunOptions(), branches_fused="fast"), model(True))


def test_compiled_needs_cuda():
    assert not branch_fused.compiled_branch_available("cpu")
