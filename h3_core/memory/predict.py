"""How much device memory a DiT evaluation needs, before running it.

A block's working memory is a sum of buffers whose sizes are the sequence's rows times one of the model's
widths, so it is written here in those units, for the phase of the block where it peaks:

* ``D`` = rows × hidden, ``I`` = rows × inner (all heads; a head group holds ``I / G``), ``F`` = FFN rows ×
  ffn width (``R`` rows per chunk), ``C`` = branch rows × inner (the linear branch's video rows), each times
  the element size (bf16: 2).
* Attention phase, per head group: the modulated input (1 D), q, k, v from the fused projection (3 I/G),
  q and k normed (2 I/G) and the RoPE temporaries while one of them is rotated (``ROTATE_TEMPS`` I/G); from
  the second group on, the running sum of ``out_proj`` (1 D). With one group, v is a strided view of the
  fused projection that the attention kernel copies to contiguous memory (1 I). The fp8 window softmax
  (``attention_precision="fp8"``) holds, beside the normed q and k and v, their e4m3 copies (1.5 I/G) and its
  staging and e4m3 output buffers: ``FP8_SOFTMAX_TEMPS`` I/G in all, in place of the RoPE temporaries.
* Hybrid attention: its peak is inside the linear branch, which holds the group's raw q, k, v (3 I/G) and
  its own buffers, ``BRANCH_BUFFERS`` C/G (the three features, fp32 k̃, ṽ and β·k̃ for the frame
  statistics, and the short convolutions' layout copies), beside the modulated input and the attention
  output (2 D) and, from the second group on, the branch readout's running sum (1 D).
* FFN phase: the block's output so far (1 D), the modulated input (1 D), ``fc1``'s output (2 F: gate and
  up, the product is formed in place) and ``fc2``'s output (1 D, or R rows of it with a preallocated
  result when chunked).

Every term but the branch's own buffers is read off the forward. ``BRANCH_BUFFERS`` is measured: on an
H200 at 102 latent frames with 1 and with 8 head groups (``bench/block_memory.py``); the other option sets
and a 52-frame clip then check the whole model (``bench/results/block_memory.md``).

With the blocks' elementwise work fused (``models.block_fused``, ``fused=True``) q and k are normed and
rotated in one pass (``FUSED_ROTATE_TEMPS``) and the branch writes its features head-major with no layout
copies and no fp32 copies for the statistics (``FUSED_BRANCH_BUFFERS``); both measured on an H200 at the
release length, one head group (``bench/results/dit_block.md``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..attention.window import check_precision
from ..errors import H3InputError
from ..formats.checkpoints import LINEARS
from ..models.dit import MODALITIES, DiTConfig
from ..models.fp8_linear import device_linear_form
from ..models.hybrid import RELEASE_WINDOW
from ..models.low_memory import LowMemory
from .speed import H100, CardSpeed, block_operations

__all__ = [
    "ModelForm",
    "WEIGHTS_ONLY",
    "BlockShape",
    "block_peaks",
    "ROTATE_TEMPS",
    "BRANCH_BUFFERS",
    "FUSED_ROTATE_TEMPS",
    "FUSED_BRANCH_BUFFERS",
    "FP8_SOFTMAX_TEMPS",
]

ROTATE_TEMPS = 3.0  # rotated half, the two products and their sum, ~0.75 I each, plus the result
# The linear branch's own buffers at its peak, in C / G: q̃, k̃, ṽ (3) and fp32 k̃, ṽ, β·k̃ (6) account for 9;
# the rest are layout copies around the depthwise convolutions and the feature normalisation. Measured
# (bench/results/block_memory.md) when one group's raw q, k, v were strided views of the stacked projection and
# q̃ was made with k̃ and ṽ; they now come dense and q̃ is made at the readout, so the plain path's peak may sit
# below these figures.
BRANCH_BUFFERS = {1: 13.77, "grouped": 14.67}
# Of those, the fp32 copies of k̃, ṽ and β·k̃ for every frame (read off the code): with ``branch_frames`` they
# exist for that many frames only. This reduction is derived, not yet measured, so ``plan_for_memory`` does
# not use the option.
FP32_STATISTICS = 6.0
# Fused blocks, in the same units, measured with one head group (bench/results/dit_block.md): the fused
# branch forms its statistics as Gram products of the bf16 features, with no fp32 copies, frees its fp32 frame
# states as soon as read and reads out in one pass without q̃, so its peak is where it convolves v beside k̃,
# about 3 C. The grouped figure predates the last of those changes and is kept, an overestimate.
FUSED_ROTATE_TEMPS = 0.5
FUSED_BRANCH_BUFFERS = {1: 3.10, "grouped": 5.71}
# The fp8 window softmax's buffers beside the attention phase's others, in I/G: 1.5 of e4m3 q, k and v (read off the
# code) and the staging and output buffers (fitted). Measured once, fused blocks, fp8 linears, one head group, at the
# release length on an H200 (bench/results/dit_step.md); plain blocks and head groups are predicted unmeasured.
FP8_SOFTMAX_TEMPS = 1.81


# fp8 layers on a card without fp8 tensor cores: one byte a weight held, each layer's weight dequantised into the
# compute dtype as it runs (``fp8_linear.fp8_linear_weights_only``), the activations never quantised
WEIGHTS_ONLY = "fp8 weights only"


@dataclass(frozen=True)
class ModelForm:
    """The model as it will be evaluated: its ``cfg``, whether its blocks are ``hybrid`` (VDN-H3's), its weights'
    ``dtype``, its ``linears`` (``"dtype"``; ``"fp8"``: the fp8 layers; ``WEIGHTS_ONLY``: fp8 layers on a card
    that multiplies them in ``dtype``, ``fp8_linear.linear_form``), whether the blocks run ``fused``
    (``models.block_fused``) and the window softmax's ``attention_precision``. Made, it has been checked: a
    ``linears`` or ``attention_precision`` outside what is allowed raises ``H3InputError`` naming it."""

    cfg: DiTConfig
    hybrid: bool
    dtype: torch.dtype = torch.bfloat16
    linears: str = "dtype"
    fused: bool = False
    attention_precision: str = "bf16"

    def __post_init__(self):
        if self.linears not in (*LINEARS, WEIGHTS_ONLY):
            raise H3InputError(f"linears: must be one of {[*LINEARS, WEIGHTS_ONLY]}, got {self.linears!r}")
        check_precision(self.attention_precision)

    @classmethod
    def of(cls, model, fused: bool | str | None = False, attention_precision: str = "bf16", device=None) -> "ModelForm":
        """A loaded ``H3DiT`` as it holds its weights (fp8 layers or not, their compute dtype) and as it will
        multiply them on ``device`` (given: its fp8 layers ``WEIGHTS_ONLY`` on a card without fp8 matmuls);
        ``fused``: whether, or the mode in which (``policy.fuse_for``), its blocks run fused."""
        fc2 = model.blocks[0].mlp.fc2
        linears = "fp8" if getattr(model, "fp8_layers", None) else "dtype"
        if linears == "fp8" and device is not None and device_linear_form(device) == "weights only":
            linears = WEIGHTS_ONLY
        return cls(
            model.cfg,
            hybrid=bool(model.cfg.hybrid),
            dtype=getattr(fc2, "compute_dtype", None) or fc2.weight.dtype,
            linears=linears,
            fused=bool(fused),
            attention_precision=attention_precision,
        )


@dataclass(frozen=True)
class BlockShape:
    """The sizes a block's memory depends on, in elements (``element`` bytes each)."""

    rows: int
    hidden: int
    inner: int
    ffn: int
    branch_rows: int
    element: int = 2
    branch_frames: int = 0
    video_rows: int = 0  # the target video's rows (0: not known, every row counted as one)
    attended_rows: int = 0  # the rows a video row's softmax sees (0: all)

    @classmethod
    def of(cls, cfg, packed, dtype: torch.dtype = torch.bfloat16) -> "BlockShape":
        """From a ``DiTConfig`` and a ``PackedSequence``; the branch reads the video rows of every frame but
        the two anchor frames, and a video row's softmax sees its window's frames, the anchors and the other
        streams' rows (the released window) — VDN-H3's; plain H3's sees every row."""
        layout = packed.layout
        rows = int(packed.positions.shape[0])
        branch_frames = max(0, layout.num_frames - 2)
        video = layout.video.length
        window = RELEASE_WINDOW
        window_frames = min(layout.num_frames, (2 * window.radius + 1) * max(window.chunk, 1) + 2)
        attended = min(rows, window_frames * layout.tokens_per_frame + rows - video) if cfg.hybrid else rows
        return cls(
            rows=rows,
            hidden=cfg.hidden,
            inner=cfg.inner,
            ffn=cfg.ffn,
            branch_rows=branch_frames * layout.tokens_per_frame,
            element=torch.empty((), dtype=dtype).element_size(),
            branch_frames=branch_frames,
            video_rows=video,
            attended_rows=attended,
        )


def block_peaks(
    shape: BlockShape,
    options: LowMemory = LowMemory(),
    *,
    hybrid: bool,
    fused: bool = False,
    linears: str = "dtype",
    attention_precision: str = "bf16",
) -> dict[str, float]:
    """Predicted peak bytes above what is allocated when a block is called: ``attention``, ``ffn`` and the
    whole ``block`` (their maximum). ``fused``: the blocks run ``block_fused``'s kernels; ``linears="fp8"``:
    with head groups the projection's input is quantised once for all groups and held through them;
    ``attention_precision="fp8"``: a hybrid block's window softmax in fp8 (``FP8_SOFTMAX_TEMPS``)."""
    e, T = shape.element, shape.rows
    D, I = T * shape.hidden * e, T * shape.inner * e
    C = shape.branch_rows * shape.inner * e
    groups = options.head_groups
    grouped = groups > 1
    base = D + (D if grouped else I) + 5 * I / groups
    attention = base + (FUSED_ROTATE_TEMPS if fused else ROTATE_TEMPS) * I / groups
    if hybrid:
        fp8 = attention_precision == "fp8"
        if fp8:
            attention = max(attention, base + FP8_SOFTMAX_TEMPS * I / groups)
        own = (FUSED_BRANCH_BUFFERS if fused else BRANCH_BUFFERS)["grouped" if grouped else 1]
        if not fused and options.branch_frames is not None and shape.branch_frames > options.branch_frames:
            own -= FP32_STATISTICS * (1 - options.branch_frames / shape.branch_frames)
        attention = max(attention, (3 if grouped else 2) * D + 3 * I / groups + own * C / groups)
    if grouped and linears == "fp8":
        attention += T * (shape.hidden + 4)  # e4m3 codes and an fp32 scale per row (Attention.projection_input)
    chunk = T if options.ffn_chunk_rows is None else min(T, options.ffn_chunk_rows)
    fc2_out = (chunk * shape.hidden * e + D) if chunk < T else D
    ffn = 2 * D + 2 * chunk * shape.ffn * e + fc2_out
    if linears == WEIGHTS_ONLY:  # each layer's weight dequantised while it runs: qkv_proj's, fc1's the largest
        attention += 3 * shape.inner * shape.hidden * e
        ffn += 2 * shape.ffn * shape.hidden * e
    return dict(attention=attention, ffn=ffn, block=max(attention, ffn))


@dataclass(frozen=True)
class WeightBytes:
    """The model's weights in bytes: the blocks (each; ``adaln`` of it the AdaLN projection) and everything
    else."""

    per_block: int
    other: int
    blocks: int
    adaln: int = 0

    @property
    def total(self) -> int:
        return self.per_block * self.blocks + self.other


@functools.lru_cache(maxsize=32)  # a meta model per call takes a second; a plan asks again for every candidate
def weight_bytes(cfg, dtype: torch.dtype = torch.bfloat16, *, linears: str = "dtype") -> WeightBytes:
    """What a model of ``cfg`` holds, counted on the meta device: parameters and buffers in ``dtype`` except
    the fp32 islands; with ``linears="fp8"`` the fp8 layers hold one byte per weight and an fp32 scale per
    output channel."""
    from ..models.dit import H3DiT
    from ..models.fp8_linear import FP8_LAYERS
    from ..models.precision import keeps_fp32

    curve = cfg.adaln_curve_grid > 0
    with torch.device("meta"):
        model = H3DiT(cfg)
    element = torch.empty((), dtype=dtype).element_size()

    def size(name: str, tensor: torch.Tensor) -> int:
        parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        if keeps_fp32(name, curve):
            return tensor.numel() * 4
        if linears in ("fp8", WEIGHTS_ONLY) and parent in FP8_LAYERS and name.endswith(".weight") and tensor.dim() == 2:
            return tensor.numel() + tensor.shape[0] * 4
        return tensor.numel() * element

    tensors = list(model.named_parameters()) + list(model.named_buffers())
    block = sum(size(n, t) for n, t in tensors if n.startswith("blocks.0."))
    adaln = sum(size(n, t) for n, t in tensors if n.startswith("blocks.0.adaln_proj."))
    other = sum(size(n, t) for n, t in tensors if not n.startswith("blocks."))
    return WeightBytes(per_block=block, other=other, blocks=cfg.layers, adaln=adaln)


def evaluation_peak(
    form: ModelForm,
    shape: BlockShape,
    options: LowMemory = LowMemory(),
    *,
    resident_blocks: int | None = None,
    prefetch: int = 1,
    adaln_on_host: bool = False,
    steps: int = 50,
    timesteps_per_step: int = 2,
) -> dict[str, float]:
    """Predicted peak device bytes of one evaluation of the model ``form`` describes: the weights on the device
    (all blocks, or ``resident_blocks`` of them plus ``prefetch + 1`` streaming slots of one block each; without the
    blocks' AdaLN projections when ``adaln_on_host``, but with their tables for ``steps`` steps of
    ``timesteps_per_step`` distinct timesteps), the hidden state and the RoPE tables that live through the whole
    evaluation, and the largest block's working memory (``block_peaks``). Returns ``weights``, ``activations`` and
    ``total``."""
    cfg = form.cfg
    weights = weight_bytes(cfg, form.dtype, linears=form.linears)
    per_block = weights.per_block
    if adaln_on_host:
        table = timesteps_per_step * 6 * MODALITIES * cfg.hidden * torch.empty((), dtype=form.dtype).element_size()
        per_block = per_block - weights.adaln + steps * table
    if resident_blocks is None or resident_blocks >= cfg.layers:
        on_device = weights.other + per_block * cfg.layers
    else:
        on_device = weights.other + per_block * (resident_blocks + prefetch + 1)
    T, e = shape.rows, shape.element
    rope_tables = 2 * T * 6 * cfg.rope_freqs * 4  # cos and sin, fp32, [T, 6 · rope_freqs] each (rope_cos_sin)
    living = T * shape.hidden * e + rope_tables
    peaks = block_peaks(
        shape,
        options,
        hybrid=form.hybrid,
        fused=form.fused,
        linears=form.linears,
        attention_precision=form.attention_precision,
    )
    activations = living + peaks["block"]
    return dict(weights=float(on_device), activations=float(activations), total=float(on_device + activations))


# Extra time of each head-group level, as a fraction of a hybrid block's time at the release length
# (bench/results/dit_block.md).
HEAD_GROUP_COST = {1: 0.0, 2: 0.0, 4: 0.08, 8: 0.19}
# With fused blocks, as a fraction of a whole evaluation: 2 groups with a 32,768-row FFN (bench/results/dit_step.md);
# 4 groups with a 16,384-row FFN, against 1 group, both with 49 of 50 blocks streamed (bench/results/dit_step_caps.md);
# 8 groups with a 16,384-row FFN and 14 of 50 blocks streamed (dit_step.md: the groups' share not separated, so an
# overestimate of the groups' own).
FUSED_HEAD_GROUP_COST = {1: 0.0, 2: 0.02, 4: 0.11, 8: 0.91}
# A streamed block's copy, even where the compute hides it, slows the evaluation by this share of the copy's time
# (the copy and the compute share the card's memory): fitted to 41 and 49 of 50 fp8 blocks streamed beside the
# resident run (bench/results/dit_step_caps.md).
STREAM_CONTENTION = 0.62

# The head-group levels a card short of memory may take, with the FFN chunk each comes with.
HEAD_GROUP_LEVELS = (
    (None, LowMemory()),
    ("2 head groups, FFN in 32768-row chunks", LowMemory(ffn_chunk_rows=32768, head_groups=2)),
    ("4 head groups, FFN in 16384-row chunks", LowMemory(ffn_chunk_rows=16384, head_groups=4)),
    ("8 head groups, FFN in 16384-row chunks", LowMemory(ffn_chunk_rows=16384, head_groups=8)),
)
ADALN_ON_HOST = "AdaLN projections in host memory"


def head_group_cost(groups: int, fused: bool) -> float:
    """The extra share of an evaluation's time ``groups`` head groups cost: the measured figure, or between the two
    measured levels around it (linear in log₂ groups)."""
    table = FUSED_HEAD_GROUP_COST if fused else HEAD_GROUP_COST
    if groups in table:
        return table[groups]
    below = max(g for g in table if g < groups)
    above = min((g for g in table if g > groups), default=None)
    if above is None:
        return table[below]
    share = (math.log2(groups) - math.log2(below)) / (math.log2(above) - math.log2(below))
    return table[below] + share * (table[above] - table[below])


@dataclass(frozen=True)
class MemoryPlan:
    """What to run with to fit ``budget`` bytes, the predicted peak, and the choices in the order taken."""

    options: LowMemory
    adaln_on_host: bool
    resident_blocks: int | None  # None: every block resident
    predicted: dict[str, float]
    budget: float
    steps: tuple[str, ...]
    extra_time: str

    @property
    def fits(self) -> bool:
        return self.predicted["total"] <= self.budget


@dataclass(frozen=True)
class _Candidate:
    name: str | None
    options: LowMemory
    adaln_on_host: bool
    resident: int | None
    predicted: dict
    seconds: float


def plan_for_memory(
    form: ModelForm,
    shape: BlockShape,
    budget: float,
    *,
    steps: int = 50,
    prefetch: int = 1,
    speed: CardSpeed = H100,
    streaming: bool = True,
) -> MemoryPlan:
    """The quickest way to run the model ``form`` describes within ``budget`` bytes of device memory (e.g. the free
    memory less a margin), by predicted time on ``speed`` (``predicted_seconds``), among every head-group level with
    the AdaLN projections on the device or in host memory, all blocks resident or (``streaming``) as many as fit, the
    rest streamed from host memory. A plan that still does not fit comes back with ``fits`` False and the most given
    up."""
    cfg = form.cfg

    def peak(options, adaln_on_host, resident=None):
        return evaluation_peak(
            form,
            shape,
            options,
            steps=steps,
            adaln_on_host=adaln_on_host,
            resident_blocks=resident,
            prefetch=prefetch,
        )

    def seconds(options, adaln_on_host, resident):
        return predicted_seconds(form, shape, speed, options, adaln_on_host, resident, steps=steps, prefetch=prefetch)

    def candidate(name, options, adaln_on_host, resident):
        predicted = peak(options, adaln_on_host, resident)
        return _Candidate(name, options, adaln_on_host, resident, predicted, seconds(options, adaln_on_host, resident))

    fitting: list[_Candidate] = []
    most_given_up = None
    for name, options in HEAD_GROUP_LEVELS:
        if options.head_groups > cfg.heads:
            continue  # a model with fewer heads stops at one head per group
        for adaln_on_host in (False, True):
            most_given_up = (name, options, adaln_on_host)
            if peak(options, adaln_on_host)["total"] <= budget:
                fitting.append(candidate(name, options, adaln_on_host, None))
            elif streaming:
                resident = _most_resident(cfg.layers, lambda r: peak(options, adaln_on_host, r)["total"] <= budget)
                if resident is not None:
                    fitting.append(candidate(name, options, adaln_on_host, resident))
    if fitting:
        best = min(fitting, key=lambda c: c.seconds)  # the first of equals: the least given up
    else:
        best = candidate(*most_given_up, 0 if streaming else None)
    taken = tuple(
        step
        for step in (
            best.name,
            ADALN_ON_HOST if best.adaln_on_host else None,
            None
            if best.resident is None
            else f"{cfg.layers - best.resident} of {cfg.layers} blocks streamed from host memory",
        )
        if step is not None
    )
    base = seconds(LowMemory(), False, None)
    extra = "none" if not taken else (
        f"predicted {best.seconds:.2f} s per evaluation against {base:.2f} s with nothing given up, on "
        f"{speed.describe()}"
    )  # fmt: skip
    return MemoryPlan(best.options, best.adaln_on_host, best.resident, best.predicted, budget, taken, extra)


def _most_resident(layers: int, fits) -> int | None:
    """The most blocks that may stay resident (fewer than ``layers``) with the rest streamed, or None if not even
    none may: the peak grows with every resident block, so a bisection finds it."""
    if not fits(0):
        return None
    lo, hi = 0, layers - 1  # fits(lo) holds
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def predicted_seconds(
    form: ModelForm,
    shape: BlockShape,
    speed: CardSpeed,
    options: LowMemory,
    adaln_on_host: bool,
    resident: int | None,
    *,
    steps: int = 50,
    prefetch: int = 1,
) -> float:
    """Predicted seconds of one evaluation of the model ``form`` describes on ``speed`` with these choices: the
    blocks' compute (``speed.seconds`` of ``block_operations``) and its head groups' extra share
    (``head_group_cost``); each streamed block's copy where the compute of the ``prefetch`` blocks before it does not
    hide it, and ``STREAM_CONTENTION`` of it where it does; with the AdaLN projections in host memory, their one
    visit to the device per run, shared by its evaluations (``steps``)."""
    cfg = form.cfg
    block = speed.seconds(*block_operations(shape), linears=form.linears)
    total = cfg.layers * block * (1 + head_group_cost(options.head_groups, form.fused))
    weights = weight_bytes(cfg, form.dtype, linears=form.linears)
    if resident is not None and resident < cfg.layers:
        copy = speed.copy_seconds(weights.per_block - (weights.adaln if adaln_on_host else 0))
        hidden = min(copy, prefetch * block)
        total += (cfg.layers - resident) * (copy - hidden + STREAM_CONTENTION * hidden)
    if adaln_on_host:
        total += speed.copy_seconds(weights.adaln * cfg.layers) / max(steps, 1)
    return total
