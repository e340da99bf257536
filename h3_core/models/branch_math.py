"""The VDN-H3 linear branch's math in its plain form (the equations in ``h3_core.models.linear_branch``):
feature convolutions, frame statistics, the exact solve, the scans and the gather, with fp64 references
(``*_reference``). The fused forms (``branch_fused``, ``branch_triton``) are tested against these."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..triton_forms import runs_here

__all__ = [
    "accumulation",
    "featurize",
    "featurize_queries",
    "featurize_keys_values",
    "frame_statistics",
    "solve",
    "solve_shifted",
    "spd_inverse",
    "solve_reference",
    "scan",
    "scan_reference",
    "gather",
    "gather_plan",
    "gather_reference",
    "EPS",
]


EPS = 1e-6


def _short_conv(x, spatial, temporal, grid):
    """Depthwise 5×5 over each frame's grid, then 5 taps across frames, zero padded: ``[F, S, C]`` → same."""
    frames, tokens, channels = x.shape
    gh, gw = grid
    y = x.reshape(frames, gh, gw, channels).permute(0, 3, 1, 2)
    y = F.conv2d(y, spatial.to(x.dtype), padding=spatial.shape[-1] // 2, groups=channels)
    y = y.permute(2, 3, 1, 0).reshape(gh * gw, channels, frames)  # frames last, for the temporal conv
    y = F.conv1d(y, temporal.to(x.dtype), padding=temporal.shape[-1] // 2, groups=channels)
    return y.permute(2, 0, 1)


def featurize(q, k, v, grid, conv=None):
    """q̃, k̃, ṽ ``[F, S, H, d]`` from raw ``[F, S, H, d]``; ``conv`` = (k_sp, k_tm, v_sp, v_tm) or None (text)."""
    return (featurize_queries(q), *featurize_keys_values(k, v, grid, conv))


def featurize_queries(q):
    """q̃ = L2-normalised SiLU(q) over the head dimension (no convolution)."""
    return F.normalize(F.silu(q), dim=-1, eps=EPS)


def featurize_keys_values(k, v, grid, conv=None):
    """k̃, ṽ ``[F, S, H, d]``: each through its short convolution (``conv``, None for the text rows), then k
    L2-normalised after SiLU and v through SiLU."""
    shape = k.shape
    if conv is not None:
        k_sp, k_tm, v_sp, v_tm = conv
        k = _short_conv(k.reshape(shape[0], shape[1], -1), k_sp, k_tm, grid).reshape(shape)
        v = _short_conv(v.reshape(shape[0], shape[1], -1), v_sp, v_tm, grid).reshape(shape)
    return F.normalize(F.silu(k), dim=-1, eps=EPS), F.silu(v)


def frame_statistics(k, v, beta, frames_per_chunk: int | None = None):
    """A ``[F, H, d, d]`` (symmetrised) and B ``[F, H, d_v, d_k]`` from k̃, ṽ ``[F, S, H, d]`` and β ``[F, S, H]``.

    ``frames_per_chunk`` forms them that many frames at a time, so the fp32 copies of k̃, ṽ and β·k̃ exist
    for those frames only; every frame's sums are its own, so the numbers are the same."""
    frames = k.shape[0]
    if frames_per_chunk is None or frames_per_chunk >= frames:
        return _frame_statistics(k, v, beta)
    parts = [
        _frame_statistics(k[f : f + frames_per_chunk], v[f : f + frames_per_chunk], beta[f : f + frames_per_chunk])
        for f in range(0, frames, frames_per_chunk)
    ]
    return torch.cat([A for A, _ in parts]), torch.cat([B for _, B in parts])


def _frame_statistics(k, v, beta):
    acc = accumulation(k.dtype)
    kf = k.to(acc).permute(0, 2, 1, 3)  # [F, H, S, d]
    vf = v.to(acc).permute(0, 2, 1, 3)
    bk = kf * beta.to(acc).permute(0, 2, 1)[..., None]
    A = bk.transpose(-1, -2) @ kf
    return 0.5 * (A + A.transpose(-1, -2)), vf.transpose(-1, -2) @ bk


def spd_inverse(M: torch.Tensor, base: int = 16, out: torch.Tensor | None = None, leaf=None) -> torch.Tensor:
    """The inverse of symmetric positive definite ``M`` ``[..., n, n]`` by halves: with M = [[P, R], [Rᵀ, C]],
    X = P⁻¹R, the Schur complement S = C − RᵀX (positive definite again) and Y = X S⁻¹,
    M⁻¹ = [[P⁻¹ + Y Xᵀ, −Y], [−Yᵀ, S⁻¹]]; blocks of ``base`` rows or fewer go to the library's inverse.

    Every level is a few batched GEMMs over all matrices at once, where a Cholesky factor and a triangular
    inverse run as long chains of small per-column kernels (half the time for 5,600 matrices of 128). Each
    level writes where its result belongs in ``out`` (a new tensor, or a view whose batch dimensions
    flatten without a copy, as the recursion passes its diagonal blocks): the half inverses straight into
    the diagonal blocks, −Y by a GEMM with the sign in its α, and the top-left update and the Schur
    complement by GEMMs that accumulate, so no level runs separate adds, negations or block copies.
    ``leaf(block, out)``, where given (``branch_fused.small_inverse``), inverts the fp32 blocks of ``base``
    rows or fewer on the devices its kernel runs on instead of the library's inverse."""
    n = M.shape[-1]
    if out is None:
        out = torch.empty(M.shape, dtype=M.dtype, device=M.device)
    if n <= base:
        if leaf is not None and M.dtype == torch.float32 and runs_here(M):
            return leaf(M, out)
        return out.copy_(torch.linalg.inv_ex(M)[0])
    h = n // 2

    def batched(t):  # [..., a, b] as [B, a, b]; .view, so what is written through it lands in ``out``
        return t.view(-1, *t.shape[-2:])

    def flat(t):  # the same for what is only read (a copy where the batch dimensions do not flatten)
        return t.reshape(-1, *t.shape[-2:])

    P, R, C = M[..., :h, :h], M[..., :h, h:], M[..., h:, h:]
    top_left, top_right = out[..., :h, :h], out[..., :h, h:]
    X = batched(spd_inverse(P, base, top_left, leaf)) @ flat(R)
    S = torch.baddbmm(flat(C), flat(R).transpose(1, 2), X, alpha=-1)
    S_inv = spd_inverse(S.view(C.shape), base, out[..., h:, h:], leaf)
    neg_y = batched(top_right)
    torch.baddbmm(neg_y, X, batched(S_inv), beta=0, alpha=-1, out=neg_y)
    batched(top_left).baddbmm_(neg_y, X.transpose(-1, -2), alpha=-1)
    out[..., h:, :h] = top_right.transpose(-1, -2)
    return out


def solve(alpha, A, B, leaf=None, base: int = 16):
    """Transitions T = diag(α)(I + A)⁻¹ and injections J = B (I + A)⁻¹ (``solve_shifted`` of I + A)."""
    return solve_shifted(alpha, A + torch.eye(A.shape[-1], dtype=A.dtype, device=A.device), B, leaf, base)


def solve_shifted(alpha, shifted, B, leaf=None, base: int = 16):
    """T = diag(α) M⁻¹ and J = B M⁻¹ for ``shifted`` M = I + A. M is symmetric positive definite for any
    A = Σ β k kᵀ (β > 0), with eigenvalues ≥ 1, so its inverse by halves (``spd_inverse``, down to blocks of
    ``base`` rows, which ``leaf`` inverts where given) is well conditioned at every level."""
    inv = spd_inverse(shifted, base, leaf=leaf)
    return alpha[..., None] * inv, B @ inv


def solve_reference(alpha, A, B):
    """The same with an explicit inverse in fp64."""
    A, B, alpha = A.double(), B.double(), alpha.double()
    inv = torch.linalg.inv(torch.eye(A.shape[-1], dtype=torch.float64) + A)
    return torch.diag_embed(alpha) @ inv, B @ inv


def scan(T, J, seed):
    """Prefix P_f = P_{f−1} T_f + J_f and suffix Q_f = Q_{f+1} T_f + J_f (both inclusive), seeded with
    ``seed`` ``[H, d, d]``; written in place into two preallocated banks."""
    P, Q = torch.empty_like(J), torch.empty_like(J)
    state = seed.to(J.dtype)
    for f in range(J.shape[0]):
        torch.baddbmm(J[f], state, T[f], out=P[f])
        state = P[f]
    state = seed.to(J.dtype)
    for f in reversed(range(J.shape[0])):
        torch.baddbmm(J[f], state, T[f], out=Q[f])
        state = Q[f]
    return P, Q


def scan_reference(T, J, seed):
    P, Q = [], [None] * J.shape[0]
    state = seed.double()
    for f in range(J.shape[0]):
        state = state @ T[f].double() + J[f].double()
        P.append(state)
    state = seed.double()
    for f in reversed(range(J.shape[0])):
        state = state @ T[f].double() + J[f].double()
        Q[f] = state
    return torch.stack(P), torch.stack(Q)


def gather_plan(alpha, bounds, frames: int, dtype: torch.dtype):
    """What the gather reads for each query frame t with window [lo, hi]: the prefix frame lo − 1 and the
    suffix frame hi + 1 (``[F]`` long, −1 where the seed stands in) and the decay products bridging them to
    t, ``[F, H, d]`` each (module docstring); bounds are unclamped."""
    device = alpha.device
    # built on the host and copied without waiting: a plain host-to-device copy would wait for the GPU's queue
    lo = torch.tensor([b[0] for b in bounds]).to(device, non_blocking=True)
    hi = torch.tensor([b[1] for b in bounds]).to(device, non_blocking=True)
    t = torch.arange(frames, device=device)
    log_alpha = torch.log(alpha.to(dtype).clamp(min=1e-12))
    prefix = torch.cat([torch.zeros_like(log_alpha[:1]), log_alpha.cumsum(0)])  # [F + 1, H, d]
    bridge_before = torch.exp(prefix[t + 1] - prefix[lo.clamp(min=0)])
    bridge_after = torch.exp(prefix[(hi + 1).clamp(max=frames)] - prefix[t])
    before = torch.where(lo - 1 >= 0, lo - 1, -1)
    after = torch.where(hi + 1 < frames, hi + 1, -1)
    return before, after, bridge_before, bridge_after


def gather(P, Q, alpha, bounds, seed):
    """S_lin ``[F, H, d_v, d_k]`` for every query frame (module docstring); bounds are unclamped."""
    before_frame, after_frame, bridge_before, bridge_after = gather_plan(alpha, bounds, P.shape[0], P.dtype)
    seed = seed.to(P.dtype)
    before = torch.where((before_frame >= 0)[:, None, None, None], P[before_frame.clamp(min=0)], seed)
    after = torch.where((after_frame >= 0)[:, None, None, None], Q[after_frame.clamp(min=0)], seed)
    return before * bridge_before[:, :, None, :] + after * bridge_after[:, :, None, :]


def gather_reference(P, Q, alpha, bounds, seed):
    frames = P.shape[0]
    out = []
    for t, (lo, hi) in enumerate(bounds):
        before = P[lo - 1].double() if lo - 1 >= 0 else seed.double()
        after = Q[hi + 1].double() if hi + 1 < frames else seed.double()
        a_before = torch.ones_like(alpha[0], dtype=torch.float64)
        for u in range(max(lo, 0), t + 1):
            a_before = a_before * alpha[u].double()
        a_after = torch.ones_like(alpha[0], dtype=torch.float64)
        for u in range(t, min(hi, frames - 1) + 1):
            a_after = a_after * alpha[u].double()
        out.append(before * a_before[:, None, :] + after * a_after[:, None, :])
    return torch.stack(out)


def accumulation(dtype: torch.dtype) -> torch.dtype:
    """fp32 sums for half-precision inputs; fp64 stays fp64 (the reference tests run there)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
