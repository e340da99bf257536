"""The VDN linear branch (h3_core.models.linear_branch): fast paths against fp64 references and closed forms."""

import pytest
import torch

from h3_core.attention.layout import window_bounds
from h3_core.models.branch_math import (
    featurize,
    frame_statistics,
    gather,
    gather_reference,
    scan,
    scan_reference,
    solve,
    solve_reference,
    solve_shifted,
    spd_inverse,
)
from h3_core.models.linear_branch import LinearBranch


def rnd(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def stats(F=6, S=5, H=2, d=4, seed=0):
    k = torch.nn.functional.normalize(rnd(F, S, H, d, seed=seed), dim=-1)
    v = rnd(F, S, H, d, seed=seed + 1)
    beta = torch.sigmoid(rnd(F, S, H, seed=seed + 2))
    alpha = torch.sigmoid(rnd(F, H, d, seed=seed + 3))
    return k, v, beta, alpha


def test_frame_statistics_are_the_sums():
    k, v, beta, _ = stats()
    A, B = frame_statistics(k, v, beta)
    f, h = 3, 1
    want_A = sum(beta[f, s, h] * torch.outer(k[f, s, h], k[f, s, h]) for s in range(5))
    want_B = sum(beta[f, s, h] * torch.outer(v[f, s, h], k[f, s, h]) for s in range(5))
    assert torch.allclose(A[f, h], want_A, atol=1e-12) and torch.allclose(B[f, h], want_B, atol=1e-12)
    assert torch.equal(A, A.transpose(-1, -2))


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_solve_matches_the_reference_and_the_implicit_delta_rule(dtype, tol):
    k, v, beta, alpha = stats()
    A, B = frame_statistics(k, v, beta)
    T, J = solve(alpha.to(dtype), A.to(dtype), B.to(dtype))
    T_ref, J_ref = solve_reference(alpha, A, B)
    assert (T.double() - T_ref).abs().max() <= tol and (J.double() - J_ref).abs().max() <= tol
    # S_f = S_{f-1} diag(α) + Σ β (v − S_f k) kᵀ holds for the solved state (the implicit reading)
    S_prev = rnd(2, 4, 4, seed=9)
    S = S_prev @ T_ref[0] + J_ref[0]
    residual = (
        S_prev @ torch.diag_embed(alpha[0])
        + torch.einsum("sh,shv,shk->hvk", beta[0], v[0] - torch.einsum("hvk,shk->shv", S, k[0]), k[0])
        - S
    )
    assert residual.abs().max() <= 1e-12
    # the same from I + A formed beforehand (the fused branch forms it in one pass with the symmetrisation)
    shifted = A.to(dtype) + torch.eye(A.shape[-1], dtype=dtype)
    assert all(torch.equal(a, b) for a, b in zip(solve_shifted(alpha.to(dtype), shifted, B.to(dtype)), (T, J)))


@pytest.mark.parametrize("n, base", [(4, 16), (16, 16), (17, 16), (37, 4), (128, 16), (128, 8)])
def test_spd_inverse_by_halves_is_the_inverse(n, base):
    # I + Σ β k kᵀ over more tokens than channels, as the branch builds it: eigenvalues from 1 to ≈ tokens
    k = torch.nn.functional.normalize(rnd(3, 4 * n, n, seed=n), dim=-1)
    M = torch.eye(n, dtype=torch.float64) + k.transpose(1, 2) @ k
    inv = spd_inverse(M, base)
    assert (inv - torch.linalg.inv(M)).abs().max() <= 1e-12 * torch.linalg.cond(M).max()
    assert (M @ inv - torch.eye(n, dtype=torch.float64)).abs().max() <= 1e-10
    inv32 = spd_inverse(M.float(), base)
    assert (inv32.double() - torch.linalg.inv(M)).abs().max() <= 1e-5


def test_spd_inverse_over_frame_and_head_batches_writes_into_a_view():
    # [frames, heads, n, n] as the branch solves it, and an ``out`` that is a view of a larger tensor
    k = torch.nn.functional.normalize(rnd(3, 2, 80, 30, seed=7), dim=-1)
    M = torch.eye(30, dtype=torch.float64) + k.transpose(-1, -2) @ k
    whole = torch.full((3, 2, 30, 40), float("nan"), dtype=torch.float64)
    inv = spd_inverse(M, 4, out=whole[..., :30])
    assert inv.data_ptr() == whole.data_ptr() and whole[..., 30:].isnan().all()
    assert (inv - torch.linalg.inv(M)).abs().max() <= 1e-12 * torch.linalg.cond(M).max()
    assert torch.equal(inv[..., 15:, :15], inv[..., :15, 15:].transpose(-1, -2))  # the lower block mirrored


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-4)])
def test_scans_match_the_reference(dtype, tol):
    k, v, beta, alpha = stats(F=9)
    T, J = solve_reference(alpha, *frame_statistics(k, v, beta))
    seed = rnd(2, 4, 4, seed=5) * 0.5
    P, Q = scan(T.to(dtype), J.to(dtype), seed.to(dtype))
    P_ref, Q_ref = scan_reference(T, J, seed)
    assert (P.double() - P_ref).abs().max() <= tol and (Q.double() - Q_ref).abs().max() <= tol
    # inclusive ends: P at the last frame and Q at the first both ran over every frame
    assert torch.allclose(P_ref[0], seed @ T[0] + J[0]) and torch.allclose(Q_ref[-1], seed @ T[-1] + J[-1])


@pytest.mark.parametrize("radius, chunk", [(0, 0), (1, 0), (1, 3), (2, 2), (5, 0)])
def test_gather_matches_the_reference(radius, chunk):
    k, v, beta, alpha = stats(F=11)
    T, J = solve_reference(alpha, *frame_statistics(k, v, beta))
    seed = rnd(2, 4, 4, seed=6)
    P, Q = scan_reference(T, J, seed)
    bounds = window_bounds(11, radius, chunk)
    assert (gather(P, Q, alpha, bounds, seed) - gather_reference(P, Q, alpha, bounds, seed)).abs().max() <= 1e-12


def test_featurize_normalises_q_and_k_and_convolves_only_k_and_v():
    q, k, v = rnd(3, 6, 2, 4, seed=1), rnd(3, 6, 2, 4, seed=2), rnd(3, 6, 2, 4, seed=3)
    channels = 8
    ident_sp = torch.zeros(channels, 1, 5, 5, dtype=torch.float64)
    ident_sp[:, :, 2, 2] = 1
    ident_tm = torch.zeros(channels, 1, 5, dtype=torch.float64)
    ident_tm[:, :, 2] = 1
    qf, kf, vf = featurize(q, k, v, (2, 3), (ident_sp, ident_tm, ident_sp, ident_tm))
    assert torch.allclose(qf.norm(dim=-1), torch.ones(3, 6, 2, dtype=torch.float64))
    assert torch.allclose(kf, torch.nn.functional.normalize(torch.nn.functional.silu(k), dim=-1))
    assert torch.allclose(vf, torch.nn.functional.silu(v))
    # a temporal tap of 1 at offset +1 shifts frames: frame t reads frame t+1, the last reads zero
    shift = torch.zeros(channels, 1, 5, dtype=torch.float64)
    shift[:, :, 3] = 1
    _, _, vs = featurize(q, k, v, (2, 3), (ident_sp, ident_tm, ident_sp, shift))
    assert torch.allclose(vs[:2], torch.nn.functional.silu(v[1:])) and torch.allclose(vs[2], torch.zeros_like(vs[2]))


def test_branch_runs_and_the_text_state_seeds_it():
    torch.manual_seed(0)
    branch = LinearBranch(hidden=12, heads=2, head_dim=4, bottleneck=3).double()
    with torch.no_grad():
        for p in branch.parameters():
            p.normal_(0, 0.3)
    F_, gh, gw = 7, 2, 3
    x = rnd(F_ * 6, 12, seed=1)
    q, k, v = (rnd(F_ * 6, 2, 4, seed=s) for s in (2, 3, 4))
    bounds = window_bounds(F_, 1, 0)
    with torch.no_grad():
        out = branch(x, q, k, v, (gh, gw), bounds)
        seed = branch.text_state(rnd(5, 12, seed=5), rnd(5, 2, 4, seed=6), rnd(5, 2, 4, seed=7))
        seeded = branch(x, q, k, v, (gh, gw), bounds, seed)
    assert out.shape == (F_ * 6, 8) and torch.isfinite(out).all()
    assert seed.shape == (2, 4, 4) and not torch.allclose(out, seeded)


def test_frame_statistics_in_chunks_of_frames_are_the_same_numbers():
    from h3_core.models.branch_math import frame_statistics

    g = torch.Generator().manual_seed(4)
    k = torch.randn(7, 6, 2, 4, generator=g, dtype=torch.float64)
    v = torch.randn(7, 6, 2, 4, generator=g, dtype=torch.float64)
    beta = torch.rand(7, 6, 2, generator=g, dtype=torch.float64)
    whole = frame_statistics(k, v, beta)
    for chunk in (1, 3, 7, 20):
        for a, b in zip(frame_statistics(k, v, beta, chunk), whole):
            assert torch.equal(a, b)
