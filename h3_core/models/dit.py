"""The MiniMax H3 Omni-Transformer (dense path): one stack of blocks over one packed sequence.

The packed sequence ``[T, hidden]`` holds text rows (projected and refined by a 2-block token refiner),
conditioning/reference rows, audio rows and video rows; attention is full self-attention over all of
it. Every row carries a modality tag (0 video, 1 text, 2 audio) and the index of its timestep; each
block's AdaLN table has one row per (timestep, modality). Timesteps are ``t = 1 − σ`` in [0, 1], t = 1
clean, not scaled by 1000. The output is the data-ward velocity of the video and audio rows
(``x0 = x_t + σ · v``).

Module names follow the native checkpoint (ComfyUI's repackaged files use them, with ``qkv_proj`` stacked
as [q; k; v] and ``fc1`` as [gate; up]). Precision as released: the patch projections, the timestep MLP
and the output heads in fp32, everything else in the compute dtype (bf16).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention.kernels import dense_attention
from ..parallel.ulysses import SequenceShards
from ..triton_forms import CompiledForm
from .adaln_tables import PrecomputedTable, adaln_tables_for, curve_embedding
from .block_ops import PLAIN_OPS, BlockOps
from .fp8_linear import quantize_input, reads_quantized_rows
from .hybrid import HybridContext, add_hybrid_parts
from .low_memory import add_linear_cols, head_slices, linear_row_blocks
from .options import FINAL_CHUNK_ROWS, PLAIN, RunOptions
from .whole_sequence import WHOLE_SEQUENCE

__all__ = [
    "DiTConfig",
    "H3DiT",
    "MODALITY_VIDEO",
    "MODALITY_TEXT",
    "MODALITY_AUDIO",
    "timestep_embedding",
    "rope_cos_sin",
]

MODALITY_VIDEO, MODALITY_TEXT, MODALITY_AUDIO = 0, 1, 2
MODALITIES = 3


@dataclass(frozen=True)
class DiTConfig:
    """Sizes of the DiT; the defaults are the released model."""

    hidden: int = 5376
    layers: int = 50
    heads: int = 56
    head_dim: int = 128
    ffn: int = 14336
    refiner_layers: int = 2
    video_channels: int = 24
    patch: tuple[int, int, int] = (1, 2, 2)
    audio_channels: int = 32
    text_dim: int = 5120
    freq_dim: int = 256
    time_hidden: int = 5376
    time_embed: int = 2688
    rope_freqs: int = 16
    rope_theta: float = 10000.0
    eps: float = 1e-5
    hybrid: bool = False  # VDN-H3: blocks carry the softmax gate, to_out_linear and the linear branch
    # > 0: the pruned ("curve") form. A table ``adaln_t_table`` [grid, time_embed] replaces the time embedder and
    # ``time_embed`` is the curve's width (8 in the published files); the AdaLN linears read it without SiLU.
    adaln_curve_grid: int = 0

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def video_row(self) -> int:
        return self.video_channels * math.prod(self.patch)


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """fp32 ``[cos(t·f), sin(t·f)]`` with ``f_k = 10000^(−k / (dim/2))`` — cosines first, t unscaled."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin ``[T, 6·F]`` for ``(t, h, w)`` positions ``[T, 3]``: each axis times the shared F
    frequencies, the three concatenated and then repeated (rotate-half pairs i and i + 3F)."""
    angles = (positions.float()[:, :, None] * inv_freq.float()[None, None]).flatten(1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    """Fused ``qkv_proj`` (stacked [q; k; v], no bias), per-head RMSNorm on q and k, optional RoPE, full
    attention, ``out_proj``. ``run.head_groups`` > 1 runs the heads a group at a time (``low_memory``)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden, 3 * cfg.inner, bias=False)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.eps)
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.eps)
        self.out_proj = nn.Linear(cfg.inner, cfg.hidden, bias=False)

    def normed_rotated(self, q, k, rope, ops: BlockOps = PLAIN_OPS):
        """q and k RMS-normed per head and, with ``rope`` (cos, sin), rotated."""
        return ops.qk_norm_rope(q, self.q_norm, rope), ops.qk_norm_rope(k, self.k_norm, rope)

    def projection_input(self, x: torch.Tensor):
        """What the q, k and v projections read: ``x``, or for an fp8 ``qkv_proj`` its rows quantised once (the
        three row slices, and every head group's, would otherwise quantise the same rows again)."""
        if reads_quantized_rows(self.qkv_proj, x.device):
            return quantize_input(x)
        return x

    def project(
        self, x: torch.Tensor, heads: slice | None = None, source=None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Raw q, k, v ``[T, h, d]`` of the heads in ``heads`` (all by default), each its own dense tensor: three
        row slices of the stacked weight (all heads of a quantised-kernel layer: its own forward once,
        ``linear_row_blocks``), read from ``source`` (``projection_input``) if given. Dense, the
        linear branch's convolutions take k and v without a layout copy, and each can be freed on its own."""
        T, d = x.shape[0], self.head_dim
        heads = slice(0, self.heads) if heads is None else heads
        inner, a, b = self.heads * d, heads.start * d, heads.stop * d
        source = x if source is None else source
        ranges = [(i * inner + a, i * inner + b) for i in range(3)]
        return tuple(t.view(T, -1, d) for t in linear_row_blocks(self.qkv_proj, source, ranges))

    def forward(self, x: torch.Tensor, rope=None, ctx=None, run: RunOptions = PLAIN) -> torch.Tensor:
        """``rope``: (cos, sin) or None; ``ctx``: None for full attention over ``x``, or the run's attention
        context, which runs it (``ctx.attend``): VDN-H3's ``HybridContext`` (the hybrid attention) or
        ``parallel.SequenceShards`` when ``x`` holds this rank's rows of a sequence split among ranks."""
        if ctx is not None:
            return ctx.attend(self, x, rope, run)
        T, d = x.shape[0], self.head_dim
        out = None
        source = self.projection_input(x)
        for heads in head_slices(self.heads, run.head_groups):
            q, k, v = self.project(x, heads, source)
            if heads.stop == self.heads:
                source = None  # the fp8 rows' last reader: freed before the attention
            q, k = self.normed_rotated(q, k, rope, run.block_ops)
            attended = dense_attention(q, k, v).out.reshape(T, -1)
            del q, k, v
            out = add_linear_cols(out, self.out_proj, attended, heads.start * d, heads.stop * d)
        return out


class HybridAttention(Attention):
    """VDN-H3's hybrid attention (``h3_core.models.hybrid``): the dense module's weights plus the softmax gate,
    ``to_out_linear`` and the linear branch, named as released under ``attn.``. Without a hybrid context it
    is the dense attention."""

    def __init__(self, cfg: DiTConfig):
        super().__init__(cfg)
        add_hybrid_parts(self, cfg)


class SwiGLU(nn.Module):
    """``fc2(silu(gate) · up)`` with ``fc1`` giving ``[gate; up]`` (no biases), on its rows as ``run.ffn_rows`` runs
    them: all at once or in row chunks (``low_memory``)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, 2 * cfg.ffn, bias=False)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def _rows(self, x, ops: BlockOps):
        return self.fc2(ops.swiglu(self.fc1(x), reads_quantized_rows(self.fc2, x.device)))

    def reads_quantized_rows(self, run: RunOptions, device: torch.device) -> bool:
        """Whether the input may come already quantised (``QuantizedRows``): an fp8 ``fc1`` run whole, not in
        row chunks."""
        return reads_quantized_rows(self.fc1, device) and run.ffn_chunk_rows is None

    def forward(self, x, run: RunOptions = PLAIN):
        ops = run.block_ops
        return run.ffn_rows.apply(lambda rows: self._rows(rows, ops), x, self.fc2.out_features)


class RefinerBlock(nn.Module):
    """A plain pre-norm block over the text rows: no AdaLN, no RoPE."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.norm1, self.attn = nn.RMSNorm(cfg.hidden, eps=cfg.eps), Attention(cfg)
        self.norm2, self.mlp = nn.RMSNorm(cfg.hidden, eps=cfg.eps), SwiGLU(cfg)

    def forward(self, x, run: RunOptions = PLAIN):
        x = x + self.attn(self.norm1(x), run=run)
        return x + self.mlp(self.norm2(x), run)


class TokenRefiner(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.blocks = nn.ModuleList(RefinerBlock(cfg) for _ in range(cfg.refiner_layers))
        self.final_norm = nn.RMSNorm(cfg.hidden, eps=cfg.eps)

    def forward(self, x, run: RunOptions = PLAIN):
        for block in self.blocks:
            x = block(x, run)
        return self.final_norm(x)


class AdaLNProjection(nn.Module):
    """``linear(silu(t_emb))`` (``linear(c(t))`` in the curve form) → a table ``[timesteps · 3, parts · hidden]``
    with one row per (timestep, modality)
    (``per_modality``) or per timestep; the activation runs at the embedding's fp32, only its result is cast."""

    def __init__(self, cfg: DiTConfig, parts: int, per_modality: bool):
        super().__init__()
        self.parts, self.hidden = parts, cfg.hidden
        self.curve = cfg.adaln_curve_grid > 0
        self.linear = nn.Linear(cfg.time_embed, parts * cfg.hidden * (MODALITIES if per_modality else 1))

    def table(self, temb: torch.Tensor) -> torch.Tensor:
        """The linear's output ``[K, parts · hidden · modalities]`` for time embeddings ``[K, time_embed]``."""
        return self.linear((temb if self.curve else F.silu(temb)).to(self.linear.weight.dtype))

    def forward(self, temb) -> tuple[torch.Tensor, ...]:
        """``temb``: time embeddings, or a ``PrecomputedTable`` made earlier by ``table`` (``adaln_tables``)."""
        table = temb.table if isinstance(temb, PrecomputedTable) else self.table(temb)
        return table.view(-1, self.parts * self.hidden).chunk(self.parts, dim=-1)


class Block(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden, eps=cfg.eps)
        self.attn = HybridAttention(cfg) if cfg.hybrid else Attention(cfg)
        self.norm2, self.mlp = nn.RMSNorm(cfg.hidden, eps=cfg.eps), SwiGLU(cfg)
        self.adaln_proj = AdaLNProjection(cfg, 6, per_modality=True)

    def forward(self, x, temb, rows, rope, ctx=None, run: RunOptions = PLAIN):
        """``rows``: each packed row's AdaLN table row, ``t_index · 3 + tag`` (a ``[T]`` tensor, or its
        ``row_runs``); ``ctx``: the hybrid context; ``run.block_ops``: the per-element work (``block_ops``). The
        plain ops apply the table rows run by run, in place, so no ``[T, hidden]`` copy of any of the six
        modulations is ever made."""
        ops = run.block_ops
        rows = ops.table_rows(rows if isinstance(rows, tuple) else row_runs(rows), x.device)
        # The pruned form's AdaLN linears are fp32; their rows modulate in the block's dtype.
        shift1, scale1, gate1, shift2, scale2, gate2 = (m.to(x.dtype) for m in self.adaln_proj(temb))
        # the attention's input is gone before the residual's norm makes the FFN's
        attended = self.attn(ops.norm_modulate(x, self.norm1, shift1, scale1, rows), rope, ctx, run)
        quantized = self.mlp.reads_quantized_rows(run, x.device)
        x, h = ops.residual_norm(x, attended, gate1, rows, self.norm2, shift2, scale2, quantized)
        return ops.gated_residual_(x, self.mlp(h, run), gate2, rows)


def row_runs(rows: torch.Tensor) -> tuple[tuple[int, int, int], ...]:
    """The stretches of equal AdaLN row in a packed sequence, ``(start, stop, row)``: a handful (text, video,
    audio, condition rows), read to the host once per model evaluation."""
    values, counts = torch.unique_consecutive(rows, return_counts=True)
    stops = counts.cumsum(0).tolist()
    return tuple((stop - count, stop, value) for value, count, stop in zip(values.tolist(), counts.tolist(), stops))


class TimeEmbedder(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.proj_in = nn.Linear(cfg.freq_dim, cfg.time_hidden)
        self.proj_out = nn.Linear(cfg.time_hidden, cfg.time_embed)

    def forward(self, t):
        freqs = timestep_embedding(t, self.proj_in.in_features).to(self.proj_in.weight.dtype)
        return self.proj_out(F.silu(self.proj_in(freqs)))


class Rope(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        # Made on the CPU and moved to the device being built on: on the meta device torch.arange runs through
        # torch._refs, whose first call in a process imports dynamo and sympy (most of a second of a first load).
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(torch.get_default_device()))


class FinalLayer(nn.Module):
    """Norm, AdaLN shift/scale per timestep and the fp32 output heads, on the video and audio rows only,
    ``chunk_rows`` rows at a time (row-wise work: the same numbers as all rows at once, without ``[T, hidden]``
    fp32 copies)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.eps)
        self.adaln_proj = AdaLNProjection(cfg, 2, per_modality=False)
        self.video_out = nn.Linear(cfg.hidden, cfg.video_row)
        self.audio_out = nn.Linear(cfg.hidden, cfg.audio_channels)

    def forward(self, x, temb, timestep_index, video_index, audio_index, chunk_rows: int = FINAL_CHUNK_ROWS):
        shift, scale = self.adaln_proj(temb)
        return tuple(
            self._head(x, shift, scale, timestep_index, index, head, chunk_rows)
            for index, head in ((video_index, self.video_out), (audio_index, self.audio_out))
        )

    def _head(self, x, shift, scale, timestep_index, index, head, chunk_rows):
        out = torch.empty(index.numel(), head.out_features, dtype=head.weight.dtype, device=x.device)
        for start in range(0, index.numel(), chunk_rows):
            rows = index[start : start + chunk_rows]
            t = timestep_index.index_select(0, rows)
            h = self.norm(x.index_select(0, rows)) * (1 + scale.index_select(0, t)) + shift.index_select(0, t)
            out[start : start + rows.numel()] = head(h.to(head.weight.dtype))
        return out


class H3DiT(nn.Module):
    def __init__(self, cfg: DiTConfig = DiTConfig()):
        super().__init__()
        self.cfg = cfg
        self.video_patch_proj = nn.Linear(cfg.video_row, cfg.hidden)
        self.audio_patch_proj = nn.Linear(cfg.audio_channels, cfg.hidden)
        self.condition_proj = nn.Linear(cfg.text_dim, cfg.hidden)
        if cfg.adaln_curve_grid > 0:
            self.register_buffer("adaln_t_table", torch.zeros(cfg.adaln_curve_grid, cfg.time_embed))
        else:
            self.time_embedder = TimeEmbedder(cfg)
        self.rope = Rope(cfg)
        self.token_refiner = TokenRefiner(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.final_layer = FinalLayer(cfg)
        # its compiled path's fallback (``run_options.evaluate``): plain from its first failure on
        self.compiled_form = CompiledForm("the compiled DiT path failed", "this model runs the plain path")

    def forward(
        self,
        video_rows: torch.Tensor,
        audio_rows: torch.Tensor,
        text_rows: torch.Tensor,
        timesteps: torch.Tensor,
        timestep_index: torch.Tensor,
        tags: torch.Tensor,
        positions: torch.Tensor,
        video_index: torch.Tensor,
        audio_index: torch.Tensor,
        text_index: torch.Tensor,
        hybrid: HybridContext | SequenceShards | None = None,
        run: RunOptions = PLAIN,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One model evaluation over one packed sequence of ``T`` rows.

        Args:
            video_rows ``[Nv, 96]``, audio_rows ``[Na, 32]``, text_rows ``[L, 5120]``: the rows of each kind, in
                the order of ``video_index`` / ``audio_index`` / ``text_index`` (their places in the sequence).
            timesteps ``[K]``: the distinct timesteps in the sequence; ``timestep_index`` ``[T]`` picks one per row.
            tags ``[T]``: each row's modality (0 video, 1 text, 2 audio); positions ``[T, 3]``: RoPE (t, h, w).
            hybrid: for a VDN-H3 model (``cfg.hybrid``), the window and layout of the sequence; without it the
                blocks run dense attention (plain H3). A ``parallel.SequenceShards`` instead runs the blocks on
                this rank's rows (every rank of its group calls this with the same inputs): the embeddings, the
                text refiner and the AdaLN work replicated, each block on the rank's rows with Ulysses attention
                (the hybrid attention when the shards carry a ``HybridContext`` as ``inner``), the rows gathered
                before the final layer, so every rank returns the whole velocity.
            run: how the evaluation runs (``RunOptions``: fused or plain, in head groups and row chunks, the cancel
                check before every block), passed down with the call.
        Returns:
            The velocity of the video rows ``[Nv, 96]`` and of the audio rows ``[Na, 32]`` (fp32).
        """
        T = positions.shape[0]
        text = self.token_refiner(self.condition_proj(text_rows.to(self.condition_proj.weight.dtype)), run)
        sequence = WHOLE_SEQUENCE if hybrid is None else hybrid
        kinds = (text_index, video_index, audio_index)
        # the rows run here and of each kind's rows, their places among them and which of the kind's rows they are
        mine, picks = sequence.local_rows(T, kinds)
        x = text.new_zeros(mine.stop - mine.start, self.cfg.hidden)
        for (places, which), rows, proj in zip(
            picks,
            (text, video_rows, audio_rows),
            (None, self.video_patch_proj, self.audio_patch_proj),
        ):
            rows = rows[which]
            x.index_copy_(0, places, rows if proj is None else proj(rows.to(proj.weight.dtype)).to(text.dtype))
        if self.cfg.adaln_curve_grid > 0:
            temb = curve_embedding(self.adaln_t_table, timesteps)
        else:
            temb = self.time_embedder(timesteps)
        table_rows = (timestep_index * MODALITIES + tags)[mine]
        rope = rope_cos_sin(positions[mine], self.rope.inv_freq)
        tables = adaln_tables_for(self, timesteps)
        rows = row_runs(table_rows)
        for i, block in enumerate(self.blocks):
            if run.check_cancel is not None:
                run.check_cancel()
            x = block(x, temb if tables is None else tables[i], rows, rope, hybrid, run)
        heads = functools.partial(self.final_layer, x, temb, chunk_rows=run.final_chunk_rows)
        return sequence.velocities(heads, timestep_index, kinds[1:], picks[1:])


# ---- precision and positions ------------------------------------------------------------------


def rope_inv_freq(cfg: DiTConfig) -> torch.Tensor:
    """The rotary frequencies, on the CPU."""
    steps = torch.arange(0, 2 * cfg.rope_freqs, 2, dtype=torch.float32, device="cpu")
    return cfg.rope_theta ** -(steps / (2 * cfg.rope_freqs))
