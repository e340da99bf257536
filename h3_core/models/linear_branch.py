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
  * gather for query frame t with window [lo, hi]: P_{lo−1} · Π_{u=max(lo,0)}^{t} α_u + Q_{hi+1} ·
    Π_{u=t}^{min(hi,F−1)} α_u
    on the d_k axis, a missing side replaced by the seed;
  * readout: RMSNorm(S_lin[t] · q̃) (weight shared by heads, eps 1e-6) × σ(up(down x)) per channel.
With anchors "both" the branch sees only frames 1..F−2 (bounds rebased) and frames 0 and F−1 read out zero.
The math in its plain form, with fp64 references, is ``branch_math``; the fused forms are ``branch_fused``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import branch_fused
from .branch_math import EPS, featurize_keys_values, frame_statistics, solve, solve_shifted
from .options import PLAIN, RunOptions

__all__ = ["LinearBranch", "TEXT_STATE_SCALE", "RowInputs", "GivenRowInputs"]

TEXT_STATE_SCALE = 0.5


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

    def logits(self, down_rows: torch.Tensor, channels: slice) -> torch.Tensor:
        """The gate's pre-activations of ``channels`` from its bottleneck rows ``down(x)``."""
        return F.linear(down_rows, self.up.weight[channels], self.up.bias[channels])


def _channels(heads: slice, head_dim: int) -> slice:
    return slice(heads.start * head_dim, heads.stop * head_dim)


class _ShortConv(nn.Module):
    def __init__(self, channels, size=5):
        super().__init__()
        self.k_sp = nn.Conv2d(channels, channels, size, padding=size // 2, groups=channels, bias=False)
        self.k_tm = nn.Conv1d(channels, channels, size, padding=size // 2, groups=channels, bias=False)
        self.v_sp = nn.Conv2d(channels, channels, size, padding=size // 2, groups=channels, bias=False)
        self.v_tm = nn.Conv1d(channels, channels, size, padding=size // 2, groups=channels, bias=False)


class RowInputs:
    """What the branch reads from the block's input rows ``x`` ``[F·S, hidden]`` of its video frames, computed
    from ``x`` when asked (so each is made where the plain forward made it): β's pre-activations of the heads,
    the frame means for α, and the output gate's pre-activations of their channels."""

    def __init__(self, branch: "LinearBranch", x: torch.Tensor, frames: int):
        self.branch, self.x, self.frames, self.dtype = branch, x, frames, x.dtype

    def beta_logits(self, heads: slice) -> torch.Tensor:
        return F.linear(self.x, self.branch.beta_proj.weight[heads])

    def frame_mean(self) -> torch.Tensor:
        acc = branch_fused.accumulation(self.dtype)
        return self.x.view(self.frames, -1, self.x.shape[-1]).mean(dim=1, dtype=acc)

    def gate_logits(self, channels: slice) -> torch.Tensor:
        gate = self.branch.output_gate
        return gate.logits(gate.down(self.x), channels)


class GivenRowInputs(RowInputs):
    """The same inputs made elsewhere: β's pre-activations ``[F·S, h]`` of the heads, the frame means
    ``[F, hidden]`` and the output gate's bottleneck rows ``down(x)`` ``[F·S, bottleneck]`` (for rows split
    among ranks: ``parallel`` gathers them)."""

    def __init__(self, branch, beta_logits: torch.Tensor, frame_mean: torch.Tensor, gate_down: torch.Tensor):
        self.branch, self._beta, self._mean, self._down = branch, beta_logits, frame_mean, gate_down
        self.dtype = beta_logits.dtype

    def beta_logits(self, heads: slice) -> torch.Tensor:
        return self._beta

    def frame_mean(self) -> torch.Tensor:
        return self._mean

    def gate_logits(self, channels: slice) -> torch.Tensor:
        return self.branch.output_gate.logits(self._down, channels)


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

    def _heads(self, heads: slice | None) -> slice:
        return slice(0, self.heads) if heads is None else heads

    def text_state(self, text_x, k_raw, v_raw, heads: slice | None = None, beta_logits=None, run: RunOptions = PLAIN):
        """0.5 · B_txt (I + A_txt)⁻¹ over all text rows ``[L, ...]`` (no convs), fp32 ``[h, d, d]``, for the
        ``heads`` whose raw k, v are given (all by default); ``beta_logits`` ``[L, h]`` in place of ``text_x``'s;
        the inverse in ``run.branch_ops`` mode."""
        heads = self._heads(heads)
        k, v = featurize_keys_values(k_raw[None], v_raw[None], None)
        if beta_logits is None:
            beta_logits = F.linear(text_x, self.beta_proj.weight[heads])
        beta = torch.sigmoid(beta_logits)[None]
        A, B = frame_statistics(k, v, beta)
        ones = torch.ones(A.shape[:-1], dtype=A.dtype, device=A.device)
        _, J = solve(ones, A, B, branch_fused.small_inverse(run.branch_ops.mode, A.device))
        return TEXT_STATE_SCALE * J[0]

    def forward(self, x, q_raw, k_raw, v_raw, grid, bounds, seed=None, heads: slice | None = None, run=PLAIN):
        """Readout ``[F·S, h·d]`` for video rows ``x`` ``[F·S, hidden]`` and raw q, k, v ``[F·S, h, d]`` of the
        ``heads`` (all by default) over ``F`` frames on a ``grid`` (gh, gw), with per-frame window ``bounds``
        in these frames' coordinates; ``seed`` is the text state of those heads (zero when None). ``x`` may be a
        ``RowInputs`` (what the branch reads from the rows, made elsewhere) instead. ``run``: the ``RunOptions``
        (``branch_ops``: the statistics and the readout, plain or fused; ``branch_frames``: the plain statistics
        that many frames at a time)."""
        ops = run.branch_ops
        rows = x if isinstance(x, RowInputs) else RowInputs(self, x, len(bounds))
        dtype = rows.dtype
        heads = self._heads(heads)
        channels = _channels(heads, self.head_dim)
        frames = len(bounds)
        S = grid[0] * grid[1]
        shape = (frames, S, heads.stop - heads.start, self.head_dim)
        conv = self.short_conv
        weights = (
            conv.k_sp.weight[channels],
            conv.k_tm.weight[channels],
            conv.v_sp.weight[channels],
            conv.v_tm.weight[channels],
        )
        beta = torch.sigmoid(rows.beta_logits(heads)).view(frames, S, -1)
        shifted, B = ops.statistics(k_raw, v_raw, shape, grid, weights, beta, run.branch_frames)
        del beta
        alpha = self.alpha(rows.frame_mean(), heads)
        T, J = solve_shifted(alpha.to(B.dtype), shifted, B, branch_fused.small_inverse(ops.mode, B.device))
        del shifted, B  # each [F, h, d, d] fp32: freed as soon as read, so none is held through the readout
        seed = torch.zeros(J.shape[1:], dtype=J.dtype, device=J.device) if seed is None else seed
        P, Q = branch_fused.scan(ops.mode, T, J, seed)
        del T, J
        # [F, h, d_v, d_k]
        state = branch_fused.gather(ops.mode, P, Q, alpha, bounds, seed, ops.state_dtype(q_raw.dtype))
        del P, Q
        return ops.readout(q_raw, state, self.norm.weight, lambda: rows.gate_logits(channels), shape, dtype)
