"""The VDN-H3 linear branch ("Video DeltaNet"): a frame-wise, bidirectional, exact delta-rule state that
gives every video query the contribution of the frames OUTSIDE its softmax window.

Per head h, on the raw (pre-norm, pre-RoPE) q, k, v of the video rows and the block's modulated input x:
  * features: q̃ = L2(SiLU(q)); k̃ = L2(SiLU(TConv5(SConv5×5(k)))); ṽ = SiLU(TConv5(SConv5×5(v))) — depthwise
    convs per channel, zero padded, spatial over the frame grid then temporal across frames; β = σ(β_proj x);
  * frame statistics: A_f = Σ_s β k̃ k̃ᵀ (symmetrised), B_f = Σ_s β ṽ k̃ᵀ (``[d_v, d_k]``);
  * decay: α_f = exp(−exp(A_log) · softplus(up(down(mean_s x)) + dt_bias)) per key channel;
  * the exact solve: S_f = (S_{f−1} · diag(α_f) + B_f)(I + A_f)⁻¹, i.e. transition T_f = diag(α_f)(I + A_f)⁻¹ and
    injection J_f = B_f (I + A_f)⁻¹ (fp32, the SPD inverse by halves);
  * scans: prefix P_f (frames 0..f) and suffix Q_f (frames f..F−1), both seeded with 0.5 · the text state
    S_text = B_txt(I + A_txt)⁻¹ (no convs on text);
  * gather for query frame t with window [lo, hi]: P_{lo−1} · Π_{u=max(lo,0)}^{t} α_u + Q_{hi+1} · Π_{u=t}^{min(hi,F−1)} α_u
    on the d_k axis, a missing side replaced by the seed;
  * readout: RMSNorm(S_lin[t] · q̃) (weight shared by heads, eps 1e-6) × σ(up(down x)) per channel.
With anchors "both" the branch sees only frames 1..F−2 (bounds rebased) and frames 0 and F−1 read out zero.
The fp64 references (``*_reference``) are the straightforward forms the fast ones are tested against.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..triton_forms import runs_here
from . import branch_fused

__all__ = [
    "LinearBranch",
    "featurize",
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
    "TEXT_STATE_SCALE",
]

TEXT_STATE_SCALE = 0.5
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
    shape = k.shape
    if conv is not None:
        k_sp, k_tm, v_sp, v_tm = conv
        k = _short_conv(k.reshape(shape[0], shape[1], -1), k_sp, k_tm, grid).reshape(shape)
        v = _short_conv(v.reshape(shape[0], shape[1], -1), v_sp, v_tm, grid).reshape(shape)
    q = F.normalize(F.silu(q), dim=-1, eps=EPS)
    k = F.normalize(F.silu(k), dim=-1, eps=EPS)
    return q, k, F.silu(v)


def frame_statistics(k, v, beta, frames_per_chunk: int | None = None):
    """A ``[F, H, d, d]`` (symmetrised) and B ``[F, H, d_v, d_k]`` from k̃, ṽ ``[F, S, H, d]`` and β ``[F, S, H]``.

    ``frames_per_chunk`` forms them that many frames at a time, so the fp32 copies of k̃, ṽ and β·k̃ exist
    for those frames only; every frame's sums are its own, so the numbers are the same."""
    frames = k.shape[0]
    if frames_per_chunk is None or frames_per_chunk >= frames:
        return _frame_statistics(k, v, beta)
    parts = [_frame_statistics(k[f : f + frames_per_chunk], v[f : f + frames_per_chunk], beta[f : f + frames_per_chunk])
             for f in range(0, frames, frames_per_chunk)]
    return torch.cat([A for A, _ in parts]), torch.cat([B for _, B in parts])


def _frame_statistics(k, v, beta):
    acc = branch_fused.accumulation(k.dtype)
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


class _Alpha(nn.Module):
    def __init__(self, hidden, heads, head_dim, bottleneck):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.down = nn.Linear(hidden, bottleneck, bias=False)
        self.up = nn.Linear(bottleneck, heads * head_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.dt_bias = nn.Parameter(torch.zeros(heads * head_dim))

    def forward(self, mean, heads: slice):
        """α ``[F, h, d]`` (fp32, or fp64 for fp64 means) of the ``heads`` from the frame means ``[F, hidden]``."""
        acc = branch_fused.accumulation(mean.dtype)
        channels = _channels(heads, self.head_dim)
        delta = F.linear(F.linear(mean.to(acc), self.down.weight.to(acc)), self.up.weight[channels].to(acc))
        delta = (delta + self.dt_bias[channels].to(acc)).view(mean.shape[0], -1, self.head_dim)
        return torch.exp(-torch.exp(self.A_log[heads].to(acc))[:, None] * F.softplus(delta))


class _OutputGate(nn.Module):
    def __init__(self, hidden, heads, head_dim, bottleneck):
        super().__init__()
        self.down = nn.Linear(hidden, bottleneck, bias=False)
        self.up = nn.Linear(bottleneck, heads * head_dim)

    def forward(self, x, channels: slice):
        return torch.sigmoid(F.linear(self.down(x), self.up.weight[channels], self.up.bias[channels]))


def _channels(heads: slice, head_dim: int) -> slice:
    return slice(heads.start * head_dim, heads.stop * head_dim)


class _ShortConv(nn.Module):
    def __init__(self, channels, size=5):
        super().__init__()
        self.k_sp = nn.Conv2d(channels, channels, size, padding=size // 2, groups=channels, bias=False)
        self.k_tm = nn.Conv1d(channels, channels, size, padding=size // 2, groups=channels, bias=False)
        self.v_sp = nn.Conv2d(channels, channels, size, padding=size // 2, groups=channels, bias=False)
        self.v_tm = nn.Conv1d(channels, channels, size, padding=size // 2, groups=channels, bias=False)


class LinearBranch(nn.Module):
    """The branch's weights (named as released, under ``attn.linear_attention``) and its forward."""

    def __init__(self, hidden: int, heads: int, head_dim: int, bottleneck: int = 128):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.beta_proj = nn.Linear(hidden, heads, bias=False)
        self.alpha = _Alpha(hidden, heads, head_dim, bottleneck)
        self.output_gate = _OutputGate(hidden, heads, head_dim, bottleneck)
        self.norm = nn.RMSNorm(head_dim, eps=EPS)
        self.short_conv = _ShortConv(heads * head_dim)
        self.statistics_frames: int | None = None  # frames per chunk of the fp32 statistics (``low_memory``)
        self.fused: str | None = None  # ``branch_fused`` mode: None runs the plain ops below

    def _heads(self, heads: slice | None) -> slice:
        return slice(0, self.heads) if heads is None else heads

    def text_state(self, text_x, k_raw, v_raw, heads: slice | None = None):
        """0.5 · B_txt (I + A_txt)⁻¹ over all text rows ``[L, ...]`` (no convs), fp32 ``[h, d, d]``, for the
        ``heads`` whose raw k, v are given (all by default)."""
        heads = self._heads(heads)
        _, k, v = featurize(k_raw[None], k_raw[None], v_raw[None], None)
        beta = torch.sigmoid(F.linear(text_x, self.beta_proj.weight[heads]))[None]
        A, B = frame_statistics(k, v, beta)
        _, J = solve(torch.ones(A.shape[:-1], dtype=A.dtype, device=A.device), A, B,
                     branch_fused.small_inverse(self.fused))
        return TEXT_STATE_SCALE * J[0]

    def forward(self, x, q_raw, k_raw, v_raw, grid, bounds, seed=None, heads: slice | None = None):
        """Readout ``[F·S, h·d]`` for video rows ``x`` ``[F·S, hidden]`` and raw q, k, v ``[F·S, h, d]`` of the
        ``heads`` (all by default) over ``F`` frames on a ``grid`` (gh, gw), with per-frame window ``bounds``
        in these frames' coordinates; ``seed`` is the text state of those heads (zero when None)."""
        heads = self._heads(heads)
        channels = _channels(heads, self.head_dim)
        frames = len(bounds)
        S = grid[0] * grid[1]
        shape = (frames, S, heads.stop - heads.start, self.head_dim)
        conv = self.short_conv
        weights = (conv.k_sp.weight[channels], conv.k_tm.weight[channels], conv.v_sp.weight[channels],
                   conv.v_tm.weight[channels])
        beta = torch.sigmoid(F.linear(x, self.beta_proj.weight[heads])).view(frames, S, -1)
        if self.fused:
            # √β·k̃ and √β·ṽ come head-major [F, h, S, d]: the statistics are their Gram products.
            k = self._fused_features(k_raw.view(frames, S, -1), weights[0], weights[1], grid, beta, True)
            v = self._fused_features(v_raw.view(frames, S, -1), weights[2], weights[3], grid, beta, False)
            shifted, B = branch_fused.shifted_statistics(self.fused, k, v)  # I + A in one pass
        else:
            q, k, v = featurize(q_raw.reshape(shape), k_raw.reshape(shape), v_raw.reshape(shape), grid, weights)
            A, B = frame_statistics(k, v, beta, self.statistics_frames)
            shifted = A + torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
            del A
        del k, v, beta
        alpha = self.alpha(x.view(frames, S, -1).mean(dim=1, dtype=branch_fused.accumulation(x.dtype)), heads)
        T, J = solve_shifted(alpha.to(B.dtype), shifted, B, branch_fused.small_inverse(self.fused))
        del shifted, B  # each [F, h, d, d] fp32: freed as soon as read, so none is held through the readout
        seed = torch.zeros(J.shape[1:], dtype=J.dtype, device=J.device) if seed is None else seed
        P, Q = branch_fused.scan(self.fused, T, J, seed)
        del T, J
        # [F, h, d_v, d_k]; the fused readout rounds it to the rows' dtype anyway, so it is gathered in it
        state = branch_fused.gather(self.fused, P, Q, alpha, bounds, seed, q_raw.dtype if self.fused else None)
        del P, Q
        if self.fused:
            return self._fused_readout(x, q_raw.view(shape), state, channels)
        out = torch.einsum("fhvk,fshk->fshv", state.to(q.dtype), q)
        del q
        acc = branch_fused.accumulation(x.dtype)
        out = F.rms_norm(out.to(acc), (self.head_dim,), self.norm.weight.to(acc), EPS).to(x.dtype)
        return (out * self.output_gate(x, channels).view(shape)).reshape(frames * S, -1)

    def _fused_features(self, raw, spatial, temporal, grid, beta, normalize: bool):
        y = branch_fused.spatial_conv(raw, spatial, grid)
        return branch_fused.run(self.fused, "conv_features", y, temporal, beta.shape[-1], normalize, beta)

    def _fused_readout(self, x, q_raw, state, channels: slice):
        gate = self.output_gate
        logits = F.linear(gate.down(x), gate.up.weight[channels], gate.up.bias[channels])
        return branch_fused.run(self.fused, "readout", q_raw, state, self.norm.weight, logits)
