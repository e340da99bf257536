"""VDN-H3's hybrid attention on a host's native H3 block: the same seam as the pack's own DiT
(``hybrid.hybrid_attention_forward``), its q, k and v taken from the block that owns them.

The native block (ComfyUI's ``comfy/ldm/minimax/model.py``) holds ``attn.qkv_proj`` (stacked [q; k; v], no bias),
per-head ``q_norm`` / ``k_norm``, ``out_proj``, and gets from its model loop a rotation table
``[1, S, 1, rot/2, 2, 2]`` (each pair's ``[[cos, −sin], [sin, cos]]``) and a published layout: segments
``(start, stop, kind)`` — text, cond, cond_audio, ref_img, ref_audio, then the target audio and video — and
the signature ``(text_len, latent_t, latent_h, latent_w, audio_t)`` after padding to the patch. Its own q/k
normalisation and rotation is one fused call (comfy-kitchen's ``rms_rope_split_half``): RMS over the head
dim, times the norm weight, then channel ``i`` paired with ``i + rot/2`` for ``i < rot/2``, channels past
``rot`` untouched. ``split_half_norm_rope`` is that arithmetic in plain PyTorch (any dtype, fp64 included).

Nothing here imports the host: the block is read through its modules (the host's layers, called as they
are, so quantised or streamed weights run as the host runs them), and what only the host has — its fused
norm/rotation kernel and its weight casts — comes in as functions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ..attention.layout import SequenceLayout, Span, WindowSpec
from ..errors import H3InputError
from ..triton_forms import COMPILE_MODES, CompiledForm, plain_path
from .branch_fused import compiled_branch_available
from .hybrid import RELEASE_WINDOW, HybridContext, hybrid_attention_forward
from .options import PLAIN, RunOptions

__all__ = [
    "NATIVE_SEGMENT_KINDS",
    "NativeLayout",
    "published_layout",
    "split_half_norm_rope",
    "kitchen_norm_rope",
    "NativeAttentionSource",
    "NativeHybridSettings",
    "native_block_attention",
    "NativeVDN",
    "NativeBlockPatch",
]

log = logging.getLogger(__name__)
_BRANCH_COMPILED = RunOptions(branches_fused="compiled")

# The segment kinds the native layout publishes; every kind but the target video is a global row.
NATIVE_SEGMENT_KINDS = ("text", "cond", "cond_audio", "ref_img", "ref_audio", "audio", "video")

# (q, k, table, q_weight, k_weight, eps, rot_dim) -> (q, k) normed and rotated, new tensors
NormRope = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# (weight, device) -> the weight on that device, as the host casts a layer's weight it may hold elsewhere
CastWeight = Callable[[torch.Tensor, torch.device], torch.Tensor]


@dataclass(frozen=True)
class NativeLayout:
    """A native layout read for the window softmax: the sequence layout and the prompt's rows."""

    layout: SequenceLayout
    text: tuple[int, int]


def published_layout(segments, signature, patch: tuple[int, int, int]) -> NativeLayout:
    """The ``SequenceLayout`` of a native packed sequence from what its model publishes.

    Args:
        segments: ``[(start, stop, kind)]`` covering the sequence in order (``PackedLayout.segments``).
        signature: ``(text_len, latent_t, latent_h, latent_w, audio_t)``, the latent grid padded to the patch.
        patch: the model's ``(pt, ph, pw)``.
    """
    segments = [(int(a), int(b), str(kind)) for a, b, kind in segments]
    unknown = sorted({kind for _, _, kind in segments} - set(NATIVE_SEGMENT_KINDS))
    if unknown:
        raise H3InputError(
            f"the native H3 layout has segments of kind {unknown}, which VDN-H3's window rule does not place; "
            f"known kinds: {list(NATIVE_SEGMENT_KINDS)}"
        )
    videos = [s for s in segments if s[2] == "video"]
    texts = [s for s in segments if s[2] == "text"]
    if len(videos) != 1 or len(texts) > 1:
        raise H3InputError(
            f"the native H3 layout has {len(videos)} video and {len(texts)} text segments; VDN-H3 needs one "
            "target video segment and at most one prompt"
        )
    _, latent_t, latent_h, latent_w = (int(n) for n in tuple(signature)[:4])
    pt, ph, pw = patch
    frames, frame_h, frame_w = latent_t // pt, latent_h // ph, latent_w // pw
    v0, v1, _ = videos[0]
    if v1 - v0 != frames * frame_h * frame_w:
        raise H3InputError(
            f"the native H3 layout's video segment has {v1 - v0} rows, but its signature gives {frames} frames of "
            f"{frame_h}x{frame_w} patches ({frames * frame_h * frame_w} rows)"
        )
    globals_ = tuple(Span(f"{kind}_{i}", a, b - a) for i, (a, b, kind) in enumerate(segments) if kind != "video")
    layout = SequenceLayout(
        seq_len=segments[-1][1],
        video=Span("video", v0, v1 - v0),
        num_frames=frames,
        tokens_per_frame=frame_h * frame_w,
        frame_h=frame_h,
        frame_w=frame_w,
        global_spans=globals_,
    )
    text = (texts[0][0], texts[0][1]) if texts else (0, 0)
    return NativeLayout(layout, text)


def split_half_norm_rope(q, k, table, q_weight, k_weight, eps: float, rot_dim: int):
    """q and k ``[T, H, D]`` RMS-normed over D (in fp32, or fp64 for fp64 inputs), times their norm weights,
    and rotated by ``table`` ``[1, T, 1, rot_dim/2, 2, 2]``: channel ``i`` with channel ``i + rot_dim/2``.
    New tensors in the inputs' dtype."""
    half = rot_dim // 2
    cos = table[0, :, :, :, 0, 0]  # [T, 1, half]
    sin = table[0, :, :, :, 1, 0]
    out = []
    for x, weight in ((q, q_weight), (k, k_weight)):
        wide = torch.promote_types(x.dtype, torch.float32)
        y = x.to(wide)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * weight.to(wide)
        c, s = cos.to(wide), sin.to(wide)
        first, second = y[..., :half], y[..., half:rot_dim]
        y = torch.cat([first * c - second * s, first * s + second * c, y[..., rot_dim:]], dim=-1)
        out.append(y.to(x.dtype))
    return tuple(out)


def kitchen_norm_rope(rms_rope_split_half) -> NormRope:
    """comfy-kitchen's ``rms_rope_split_half(q, k, freqs_cis, q_scale, k_scale, epsilon=, rot_dim=)`` (as the host's
    H3 attention calls it) as a ``NormRope``."""

    def norm_rope(q, k, table, q_weight, k_weight, eps, rot_dim):
        return rms_rope_split_half(q, k, table, q_weight, k_weight, epsilon=eps, rot_dim=rot_dim)

    return norm_rope


def _same_device(weight: torch.Tensor, device: torch.device) -> torch.Tensor:
    return weight.to(device)


class NativeAttentionSource:
    """A native block's attention seen through the hybrid seam's protocol (``hybrid_attention_forward``): raw
    q, k, v from the block's own ``qkv_proj``, q/k normed and rotated with the block's norm weights and the
    model's rotation table, ``out_proj`` the block's; the softmax gate, ``to_out_linear`` and the linear
    branch from the branch file's ``parts`` (``formats.vdn.BranchWeights.transformer_blocks[i].attn``).

    ``norm_rope``: the host's fused norm/rotation (``split_half_norm_rope``'s arithmetic) where it takes the
    dtype, else None for the plain form. ``cast_weight``: how the host brings a layer's weight to the input's
    device (it may hold it elsewhere)."""

    def __init__(self, attn: nn.Module, parts: nn.Module, norm_rope: NormRope | None, cast_weight: CastWeight | None):
        self.native = attn
        self.heads, self.head_dim = int(attn.heads), int(attn.head_dim)
        self.out_proj = attn.out_proj
        self.softmax_gate = parts.softmax_gate
        self.to_out_linear = parts.to_out_linear
        self.linear_attention = parts.linear_attention
        self._norm_rope = norm_rope
        self._cast = cast_weight or _same_device

    def projection_input(self, x: torch.Tensor) -> torch.Tensor:
        """The stacked projection ``[T, 3·H·d]``, run once through the host's layer; ``project`` slices it."""
        return self.native.qkv_proj(x)

    def project(self, x, heads: slice, source: torch.Tensor):
        T, d, inner = x.shape[0], self.head_dim, self.heads * self.head_dim
        a, b = heads.start * d, heads.stop * d
        return tuple(source[:, i * inner + a : i * inner + b].view(T, -1, d) for i in range(3))

    def normed_rotated(self, q_raw, k_raw, table, ops=None):
        device = q_raw.device
        qw, kw = self._cast(self.native.q_norm.weight, device), self._cast(self.native.k_norm.weight, device)
        eps = float(self.native.q_norm.eps)
        rot_dim = table.shape[-3] * 2
        if self._norm_rope is not None and q_raw.dtype != torch.float64:
            q, k = self._norm_rope(q_raw[None], k_raw[None], table, qw, kw, eps, rot_dim)
            return q[0], k[0]
        return split_half_norm_rope(q_raw, k_raw, table, qw, kw, eps, rot_dim)


@dataclass(frozen=True)
class NativeHybridSettings:
    """How the patched attention runs: the window, the window softmax backend and its precision, and ``compile``
    (``triton_forms.COMPILE_MODES``): ``"auto"`` runs the linear branch fused and compiled where CUDA and Triton
    are present, ``"off"`` the plain path."""

    window: WindowSpec = RELEASE_WINDOW
    backend: str = "auto"
    precision: str = "bf16"
    compile: str = "auto"

    def __post_init__(self):
        if self.compile not in COMPILE_MODES:
            raise H3InputError(f"compile: got {self.compile!r}; allowed: {list(COMPILE_MODES)}")


def native_block_attention(
    attn: nn.Module,
    parts: nn.Module,
    native_layout: NativeLayout,
    settings: NativeHybridSettings,
    *,
    norm_rope: NormRope | None = None,
    cast_weight: CastWeight | None = None,
    on_window_run=None,
    run=hybrid_attention_forward,
):
    """The ``attention(h, rope_freqs=..., transformer_options=...)`` a native block calls in place of its own:
    the hybrid attention over the block's weights and the branch ``parts``; ``run`` calls
    ``hybrid_attention_forward`` (``NativeVDN.run`` picks its compiled or plain form)."""
    source = NativeAttentionSource(attn, parts, norm_rope, cast_weight)
    ctx = HybridContext(
        native_layout.layout,
        settings.window,
        settings.backend,
        native_layout.text,
        on_window_run,
        settings.precision,
    )

    # Opaque to a compile of the host's block or model (a compile node after the patch): that compile fuses the
    # block's own parts around a graph break here, and the attention runs the form ``settings.compile`` chose. Traced
    # into, the branch's compiled form was compiled again inside the block's graph: an illegal memory access on an H100.
    @torch.compiler.disable
    def attention(h, rope_freqs=None, transformer_options=None):
        if rope_freqs is None:
            raise H3InputError("the native H3 block gave its attention no rotation table; VDN-H3 needs RoPE")
        return run(source, h, rope_freqs, ctx)

    return attention


class NativeVDN:
    """VDN-H3 on a native H3 model: for each block ``i`` a replacement (``block_patch(i)``) that runs the host's
    own block with the hybrid attention in place of its attention. ``model`` is the host's diffusion model (its
    ``blocks[i].attn`` and ``patch_size`` are read at call time, so whatever the host holds then is used);
    ``branch`` the branch file's weights (``formats.vdn.BranchWeights``).

    With ``settings.compile == "auto"`` the branch runs fused and compiled where the rows' device compiles
    (``branch_fused``). The compiled form belongs to this object: where it fails to compile or launch
    (``CompileFailure``), the attention runs again from the same input on the plain path, one line says why, and
    every later call runs plain (``compiled_form``)."""

    def __init__(
        self,
        model: nn.Module,
        branch: nn.Module,
        settings: NativeHybridSettings = NativeHybridSettings(),
        *,
        norm_rope: NormRope | None = None,
        cast_weight: CastWeight | None = None,
        on_window_run=None,
    ):
        blocks, parts = len(model.blocks), len(branch.transformer_blocks)
        if blocks != parts:
            raise H3InputError(f"linear_branch: the branch file has {parts} blocks, the native H3 model {blocks}")
        self.model, self.branch, self.settings = model, branch, settings
        self._norm_rope, self._cast, self._on_run = norm_rope, cast_weight, on_window_run
        self._last: tuple[object, NativeLayout] | None = None
        self.compiled_form = CompiledForm(
            "the compiled VDN-H3 patch failed", "its attention runs the plain path"
        )  # fmt: skip

    def run(self, source, h, rope, ctx):
        """``hybrid_attention_forward(source, h, rope, ctx)``: compiled where it may, else plain."""
        if self.compiled_form.tries(self.settings.compile == "auto"):
            # the block's own projections run as the host runs them (no pack kernels on them); the branch fused
            fused = _BRANCH_COMPILED if compiled_branch_available(h.device) else PLAIN
            with self.compiled_form.attempt():
                return hybrid_attention_forward(source, h, rope, ctx, fused)
        with plain_path():
            return hybrid_attention_forward(source, h, rope, ctx)

    def layout_for(self, native_layout) -> NativeLayout:
        """The window softmax's layout for the native layout of the running evaluation (read once per layout)."""
        if self._last is None or self._last[0] is not native_layout:
            patch = tuple(getattr(self.model, "patch_size", (1, 2, 2)))
            self._last = (native_layout, published_layout(native_layout.segments, native_layout.signature, patch))
        return self._last[1]

    def attention(self, index: int, native_layout):
        """Block ``index``'s hybrid attention for one evaluation over ``native_layout``."""
        return native_block_attention(
            self.model.blocks[index].attn,
            self.branch.transformer_blocks[index].attn,
            self.layout_for(native_layout),
            self.settings,
            norm_rope=self._norm_rope,
            cast_weight=self._cast,
            on_window_run=self._on_run,
            run=self.run,
        )

    def block_patch(self, index: int, previous=None) -> "NativeBlockPatch":
        return NativeBlockPatch(self, index, previous)


class NativeBlockPatch:
    """The host's block replacement for block ``index`` (``patches_replace["dit"][("double_block", index)]``):
    called with the block's arguments and ``{"original_block": ...}``, it runs the original block with
    ``attention=`` the hybrid attention. A replacement already there (``previous``, another pack's) keeps
    running: it is called in turn, and its ``original_block`` is the one that takes the hybrid attention."""

    def __init__(self, vdn: NativeVDN, index: int, previous=None):
        self.vdn, self.index, self.previous = vdn, index, previous

    def __call__(self, args: dict, extra: dict) -> dict:
        layout = args.get("layout")
        if layout is None:
            layout = args["transformer_options"].get("minimax_h3_layout")
        if layout is None:
            raise H3InputError(
                "the native H3 block published no layout (transformer_options['minimax_h3_layout']); VDN-H3 needs "
                "a ComfyUI whose H3 model publishes it"
            )
        attention = self.vdn.attention(self.index, layout)
        original = extra["original_block"]

        def hybrid_block(block_args):
            return original({**block_args, "attention": attention})

        if self.previous is None:
            return hybrid_block(args)
        return self.previous(args, {**extra, "original_block": hybrid_block})
