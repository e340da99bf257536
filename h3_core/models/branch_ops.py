"""The linear branch's frame statistics and readout as one object given with each call (``RunOptions.branch_ops``).

``BranchOps`` runs them op by op as ``branch_math`` writes them (the reference); ``FusedBranchOps`` as
``branch_fused``'s functions in one of its modes. ``LinearBranch.forward`` calls the same methods whichever it is
given; the solve, the scan and the gather take ``mode`` (None: plain) themselves.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import H3InputError
from . import branch_fused
from .branch_math import EPS, featurize_keys_values, featurize_queries, frame_statistics

__all__ = ["BranchOps", "FusedBranchOps", "branch_ops_for"]


class BranchOps:
    """``mode`` None: the plain ops."""

    mode: str | None = None

    def statistics(self, k_raw, v_raw, shape, grid, conv_weights, beta, frames_at_a_time):
        """``(I + A, B)`` of the frames: the shifted and the plain statistics ``[F, h, d, d]`` of the featurised k
        and v weighted by ``beta``. ``frames_at_a_time``: the statistics that many frames at a time (None: all)."""
        k, v = featurize_keys_values(k_raw.reshape(shape), v_raw.reshape(shape), grid, conv_weights)
        A, B = frame_statistics(k, v, beta, frames_at_a_time)
        del k, v
        return A.add_(torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)), B

    def state_dtype(self, rows_dtype: torch.dtype) -> torch.dtype | None:
        """The dtype the state is gathered in (None: as the scan leaves it)."""
        return None

    def readout(self, q_raw, state, norm_weight, gate_logits: Callable[[], torch.Tensor], shape, dtype):
        """``RMSNorm(state · q̃) × σ(gate_logits())`` ``[F·S, h·d]`` in ``dtype``, q̃ featurised from ``q_raw`` here
        (so it is not held through the solve and the scans); the gate's logits (as large as the readout) made only
        once q̃ is gone."""
        q = featurize_queries(q_raw.reshape(shape))
        out = torch.einsum("fhvk,fshk->fshv", state.to(q.dtype), q)
        del q
        acc = branch_fused.accumulation(dtype)
        out = F.rms_norm(out.to(acc), (shape[-1],), norm_weight.to(acc), EPS).to(dtype)
        return (out * torch.sigmoid(gate_logits()).view(shape)).reshape(shape[0] * shape[1], -1)


class FusedBranchOps(BranchOps):
    """The same in ``branch_fused`` mode ``mode``: √β·k̃ and √β·ṽ made head-major ``[F, h, S, d]`` in one pass
    each, their Gram products with I added in one pass, the readout in one."""

    def __init__(self, mode: str):
        self.mode = mode

    def statistics(self, k_raw, v_raw, shape, grid, conv_weights, beta, frames_at_a_time):
        frames, S = shape[0], shape[1]
        k = self._features(k_raw.view(frames, S, -1), conv_weights[0], conv_weights[1], grid, beta, True)
        v = self._features(v_raw.view(frames, S, -1), conv_weights[2], conv_weights[3], grid, beta, False)
        return branch_fused.shifted_statistics(self.mode, k, v)

    def _features(self, raw, spatial, temporal, grid, beta, normalize: bool):
        y = branch_fused.spatial(self.mode, raw, spatial, grid)
        return branch_fused.run(self.mode, "conv_features", y, temporal, beta.shape[-1], normalize, beta)

    def state_dtype(self, rows_dtype):
        return rows_dtype  # the fused readout rounds the state to the rows' dtype anyway

    def readout(self, q_raw, state, norm_weight, gate_logits, shape, dtype):
        return branch_fused.run(self.mode, "readout", q_raw.view(shape), state, norm_weight, gate_logits())


PLAIN_BRANCH_OPS = BranchOps()
_BY_MODE = {mode: PLAIN_BRANCH_OPS if mode is None else FusedBranchOps(mode) for mode in branch_fused.FUSED_MODES}


def branch_ops_for(mode: str | None) -> BranchOps:
    """The ops of ``branch_fused`` mode ``mode`` (None: the plain ops)."""
    if mode not in _BY_MODE:
        raise H3InputError(f"branches_fused: got {mode!r}; allowed: {branch_fused.FUSED_MODES}")
    return _BY_MODE[mode]
