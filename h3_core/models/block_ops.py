"""A DiT block's per-element work — the AdaLN norms and modulations, the gated residuals, the q/k norm and
rotation, the FFN's SiLU·up and the softmax gate — as one object given with each call (``RunOptions.block_ops``).

``BlockOps`` runs each step as its own PyTorch op: the reference, and what the model's files read as its math.
``FusedBlockOps`` runs the same steps as ``block_fused``'s functions in one of its modes (compiled, with Triton
kernels on CUDA). The blocks, the attention and the FFN call the same methods whichever they are given, so their
``forward`` never asks which form it runs in.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import H3InputError
from . import block_fused
from .branch_fused import FUSED_MODES
from .fp8_linear import reads_quantized_rows

__all__ = ["BlockOps", "FusedBlockOps", "PLAIN_OPS", "block_ops_for", "rotate_half", "modulate_", "gated_add_"]


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first ``cos.shape[-1]`` channels of ``x`` ``[T, H, D]``."""
    n = cos.shape[-1]
    half = n // 2
    rot, rest = x[..., :n], x[..., n:]
    cos, sin = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]
    turned = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + turned * sin, rest], dim=-1)


def modulate_(h, shift, scale, runs):
    """``h · (1 + scale[row]) + shift[row]`` in place, row by row of the table (``runs``: ``(start, stop, row)``)."""
    for start, stop, row in runs:
        h[start:stop].mul_(1 + scale[row]).add_(shift[row])
    return h


def gated_add_(y, gate, x, runs):
    """``x + gate[row] · y`` into ``y``'s storage (the same two roundings as the out-of-place form)."""
    for start, stop, row in runs:
        y[start:stop].mul_(gate[row])
    return y.add_(x)


class BlockOps:
    """The per-element work op by op. ``rows`` is what ``table_rows`` made of the packed sequence's AdaLN runs; the
    ``quantized`` flags ask for an fp8 linear's input quantised as it is formed, which these ops leave to the linear
    that reads it."""

    def table_rows(self, runs, device):
        """The AdaLN rows as the other methods take them: the runs ``(start, stop, row)`` themselves."""
        return runs

    def norm_modulate(self, x, norm: nn.RMSNorm, shift, scale, rows):
        return modulate_(norm(x), shift, scale, rows)

    def residual_norm(self, x, y, gate, rows, norm: nn.RMSNorm, shift, scale, quantized: bool):
        """The residual ``x + gate · y`` (in ``y``'s storage) and the FFN's input, ``norm_modulate`` of it."""
        x = gated_add_(y, gate, x, rows)
        return x, modulate_(norm(x), shift, scale, rows)

    def gated_residual_(self, x, y, gate, rows):
        return gated_add_(y, gate, x, rows)

    def qk_norm_rope(self, t, norm: nn.RMSNorm, rope):
        """``t`` ``[T, H, D]`` RMS-normed per head and, with ``rope`` (cos, sin), rotated."""
        t = norm(t)
        return t if rope is None else rotate_half(t, *rope)

    def swiglu(self, gate_up, quantized: bool):
        """``silu(gate) · up`` in ``fc1``'s output ``[T, 2·ffn]`` (gate | up): no further ``[T, ffn]`` buffers."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate, inplace=True).mul_(up)

    def gates_while_quantizing(self, out_proj, device) -> bool:
        """Whether the softmax gate is applied as ``out_proj``'s input is quantised (``gate_heads_input``) rather
        than by the window softmax as it writes its output."""
        return False

    def gate_heads_input(self, soft, gate, quantized: bool):
        """``out_proj``'s input ``[T, h·d]``: the softmax output ``soft`` ``[T, h, d]`` times its per-head ``gate``
        ``[T, h]``, in place."""
        return soft.mul_(gate[..., None]).reshape(soft.shape[0], -1)


class FusedBlockOps(BlockOps):
    """The same steps as ``block_fused``'s functions in ``mode`` (``branch_fused.FUSED_MODES``): each chain in one
    pass with fp32 sums, the AdaLN rows looked up per packed row, an fp8 linear's input quantised as it is formed."""

    def __init__(self, mode: str):
        self.mode = mode

    def table_rows(self, runs, device):
        """Each packed row's AdaLN table row ``[T]``, on ``device``."""
        return block_fused.row_index(runs, device)

    def norm_modulate(self, x, norm, shift, scale, rows):
        return block_fused.run(self.mode, "norm_modulate", x, norm.weight, shift, scale, rows, norm.eps)

    def residual_norm(self, x, y, gate, rows, norm, shift, scale, quantized):
        return block_fused.residual_norm(self.mode, x, y, gate, rows, norm.weight, shift, scale, norm.eps, quantized)

    def gated_residual_(self, x, y, gate, rows):
        return block_fused.run(self.mode, "gated_residual_", x, y, gate, rows)

    def qk_norm_rope(self, t, norm, rope):
        cos, sin = rope if rope is not None else (None, None)
        return block_fused.run(self.mode, "qk_norm_rope", t, norm.weight, cos, sin, norm.eps)

    def swiglu(self, gate_up, quantized):
        if quantized:
            return block_fused.swiglu_quantized(self.mode, gate_up)
        return block_fused.run(self.mode, "swiglu_", gate_up)

    def gates_while_quantizing(self, out_proj, device):
        return reads_quantized_rows(out_proj, device)

    def gate_heads_input(self, soft, gate, quantized):
        return block_fused.gate_heads_input(self.mode, soft, gate, quantized)


PLAIN_OPS = BlockOps()
_BY_MODE = {mode: PLAIN_OPS if mode is None else FusedBlockOps(mode) for mode in FUSED_MODES}


def block_ops_for(mode: str | None) -> BlockOps:
    """The ops of ``block_fused`` mode ``mode`` (None: the plain ops)."""
    if mode not in _BY_MODE:
        raise H3InputError(f"blocks_fused: got {mode!r}; allowed: {FUSED_MODES}")
    return _BY_MODE[mode]
