"""Log-sum-exp merge of two partial attention results (h3_core.attention.merge / _merge_triton)."""

import textwrap

import pytest
import torch
from triton_interpreter import run_interpreted

from h3_core.attention.kernels import dense_attention
from h3_core.attention.merge import merge_partials, merge_partials_reference


def randn(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def direct_attention(q, k, v, scale):
    """Token-major [..., T, H, D] softmax attention in float64 (no kernels involved)."""
    scores = torch.einsum("...qhd,...khd->...hqk", q, k) * scale
    return torch.einsum("...hqk,...khd->...qhd", torch.softmax(scores, dim=-1), v)


def test_two_halves_merge_to_full_attention_3d():
    N, M, H, D = 13, 30, 3, 8
    q, k, v = randn(N, H, D, seed=1), randn(M, H, D, seed=2), randn(M, H, D, seed=3)
    perm = torch.randperm(M, generator=torch.Generator().manual_seed(4))
    a, b = perm[:11], perm[11:]  # disjoint, interleaved key sets
    part_a = dense_attention(q, k[a], v[a], kernel="math")
    part_b = dense_attention(q, k[b], v[b], kernel="math")
    assert not part_a.lse.is_contiguous()  # [N, H] view of a head-major buffer
    out = torch.empty(N, H, D, dtype=torch.float64)
    got = merge_partials_reference(part_a.out, part_a.lse, part_b.out, part_b.lse, out)
    assert got is out
    full = dense_attention(q, k, v, kernel="math").out
    assert (out - full).abs().max() <= 1e-12
    assert (out - direct_attention(q, k, v, D**-0.5)).abs().max() <= 1e-12


def test_two_halves_merge_to_full_attention_grouped_4d():
    G, L, M, H, D = 3, 7, 16, 2, 8
    q, k, v = randn(G, L, H, D, seed=5), randn(G, M, H, D, seed=6), randn(G, M, H, D, seed=7)
    part_a = dense_attention(q, k[:, :5], v[:, :5], kernel="math")
    part_b = dense_attention(q, k[:, 5:], v[:, 5:], kernel="math")
    # transposed lse: [G, L, H] views of [G, H, L] buffers
    lse_a = part_a.lse.permute(0, 2, 1).contiguous().transpose(1, 2)
    lse_b = part_b.lse.permute(0, 2, 1).contiguous().transpose(1, 2)
    assert lse_a.stride() == (H * L, 1, L)
    out = torch.empty(G, L, H, D, dtype=torch.float64)
    merge_partials_reference(part_a.out, lse_a, part_b.out, lse_b, out)
    full = dense_attention(q, k, v, kernel="math").out
    assert (out - full).abs().max() <= 1e-12
    assert (out - direct_attention(q, k, v, D**-0.5)).abs().max() <= 1e-12


def test_merge_into_a_strided_output_view():
    N, M, H, D = 9, 12, 2, 8
    q, k, v = randn(N, H, D, seed=8), randn(M, H, D, seed=9), randn(M, H, D, seed=10)
    part_a = dense_attention(q, k[:4], v[:4], kernel="math")
    part_b = dense_attention(q, k[4:], v[4:], kernel="math")
    fused = torch.zeros(N, 3, H, D, dtype=torch.float64)
    out = fused[:, 1]  # row stride 3*H*D
    merge_partials_reference(part_a.out, part_a.lse, part_b.out, part_b.lse, out)
    assert (fused[:, 1] - dense_attention(q, k, v, kernel="math").out).abs().max() <= 1e-12
    assert fused[:, 0].abs().max() == 0 and fused[:, 2].abs().max() == 0


def test_merge_is_stable_for_far_apart_lse():
    N, H, D = 4, 2, 8
    o_a, o_b = randn(N, H, D, seed=11), randn(N, H, D, seed=12)
    lse_a = torch.full((N, H), 900.0, dtype=torch.float64)
    lse_b = torch.full((N, H), -900.0, dtype=torch.float64)
    out = torch.empty(N, H, D, dtype=torch.float64)
    merge_partials_reference(o_a, lse_a, o_b, lse_b, out)
    assert torch.isfinite(out).all()
    assert (out - o_a).abs().max() <= 1e-15  # o_b + 1 * (o_a - o_b): exact up to rounding
    merge_partials_reference(o_a, lse_b, o_b, lse_a, out)
    assert torch.equal(out, o_b)


def test_equal_lse_averages():
    o_a, o_b = randn(5, 2, 8, seed=13), randn(5, 2, 8, seed=14)
    lse = randn(5, 2, seed=15)
    out = torch.empty(5, 2, 8, dtype=torch.float64)
    merge_partials_reference(o_a, lse, o_b, lse, out)
    assert (out - (o_a + o_b) / 2).abs().max() <= 1e-15


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["f64", "f32", "bf16"])
def test_dispatcher_on_cpu_matches_reference(dtype):
    G, L, H, D = 2, 5, 2, 8
    o_a, o_b = randn(G, L, H, D, dtype=dtype, seed=16), randn(G, L, H, D, dtype=dtype, seed=17)
    lse_a, lse_b = randn(G, L, H, dtype=torch.float32, seed=18), randn(G, L, H, dtype=torch.float32, seed=19)
    out = torch.empty(G, L, H, D, dtype=dtype)
    want = torch.empty(G, L, H, D, dtype=dtype)
    merge_partials(o_a, lse_a, o_b, lse_b, out)
    merge_partials_reference(o_a, lse_a, o_b, lse_b, want)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    assert torch.equal(out, want)


TRITON_SCRIPT = textwrap.dedent(
    """
    import os
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch
    from h3_core.attention.merge_triton import merge_partials_triton
    from h3_core.attention.merge import merge_partials_reference

    g = torch.Generator().manual_seed(0)
    worst = 0.0
    finite = True

    def check(o_a, lse_a, o_b, lse_b, shape):
        global worst, finite
        out = torch.full(shape, float("nan"))
        want = torch.zeros(shape)
        res = merge_partials_triton(o_a, lse_a, o_b, lse_b, out)
        assert res is out
        merge_partials_reference(o_a, lse_a, o_b, lse_b, want)
        finite = finite and bool(torch.isfinite(out).all())
        worst = max(worst, (out - want).abs().max().item())

    # grouped [G, L, H, D], odd sizes, every operand strided
    G, L, H, D = 3, 37, 3, 24
    o_a = torch.randn(G, L, H, D + 5, generator=g)[..., :D]          # padded rows
    o_b = torch.randn(G, H, L, D, generator=g).transpose(1, 2)        # head-major buffer
    lse_a = (torch.randn(G, H, L, generator=g) * 3).transpose(1, 2)   # transposed lse
    lse_b = (torch.randn(L, G, H, generator=g) * 3).transpose(0, 1)
    check(o_a, lse_a, o_b, lse_b, (G, L, H, D))

    # overlapping-batch style: a [G, L, H, D] view of one [T, H, D] buffer
    buf = torch.randn(G * L, H, D, generator=g)
    o_c = buf.view(G, L, H, D)
    check(o_c, lse_a, o_a, lse_b, (G, L, H, D))

    # plain [N, H, D] with a transposed [N, H] lse
    N = 53
    o_a3 = torch.randn(N, 2, H, D, generator=g)[:, 1]
    o_b3 = torch.randn(N, H, D, generator=g)
    lse_a3 = torch.randn(H, N, generator=g).t() * 4
    lse_b3 = torch.randn(H, N, generator=g).t() * 4
    check(o_a3, lse_a3, o_b3, lse_b3, (N, H, D))

    # head dim that is already a power of two, one row per group
    o_a4, o_b4 = torch.randn(5, 1, 2, 16, generator=g), torch.randn(5, 1, 2, 16, generator=g)
    la4, lb4 = torch.randn(5, 1, 2, generator=g), torch.randn(5, 1, 2, generator=g)
    check(o_a4, la4, o_b4, lb4, (5, 1, 2, 16))

    print(f"FINITE {finite}")
    print(f"MAXDIFF {worst:.6e}")
    """
)


def test_triton_merge_under_interpreter_matches_reference():
    stdout = run_interpreted(TRITON_SCRIPT)
    lines = dict(line.split(" ", 1) for line in stdout.splitlines() if line.startswith(("FINITE", "MAXDIFF")))
    assert lines.get("FINITE") == "True", stdout
    assert float(lines["MAXDIFF"]) < 1e-5, stdout
