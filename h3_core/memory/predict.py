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
from dataclasses import dataclass

import torch

from ..models.dit import MODALITIES
from ..models.low_memory import LowMemory

__all__ = [
    "BlockShape",
    "block_peaks",
    "ROTATE_TEMPS",
    "BRANCH_BUFFERS",
    "FUSED_ROTATE_TEMPS",
    "FUSED_BRANCH_BUFFERS",
    "BRANCH_BESIDE_EXTRA",
    "FP8_SOFTMAX_TEMPS",
    "FP8_BRANCH_BESIDE_EXTRA",
]

ROTATE_TEMPS = 3.0  # rotated half, the two products and their sum, ~0.75 I each, plus the result
# The linear branch's own buffers at its peak, in C / G: q̃, k̃, ṽ (3) and fp32 k̃, ṽ, β·k̃ (6) account for 9;
# the rest are layout copies around the depthwise convolutions and the feature normalisation. Measured
# (bench/results/block_memory.md) when one group's raw q, k, v were strided views of the stacked projection;
# they now come dense, so the plain path's peak may sit below these figures.
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
# The linear branch on a second stream beside the window softmax (``RunOptions.branch_stream``, one head group):
# both phases' buffers alive at once raised an evaluation's peak by this much, in I. Measured once, fused blocks and
# fp8 linears at the release length on an H200 (bench/results/dit_step.md); applied to plain blocks unmeasured.
BRANCH_BESIDE_EXTRA = 0.385
# The fp8 window softmax's buffers beside the attention phase's others, in I/G: 1.5 of e4m3 q, k and v (read off the
# code) and the staging and output buffers (fitted). With the branch beside it, the peak rises by
# ``FP8_BRANCH_BESIDE_EXTRA`` I instead of ``BRANCH_BESIDE_EXTRA``. Both measured once, fused blocks, fp8 linears,
# one head group, at the release length on an H200 (bench/results/dit_step.md); plain blocks and head groups are
# predicted unmeasured.
FP8_SOFTMAX_TEMPS = 1.81
FP8_BRANCH_BESIDE_EXTRA = 0.75


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

    @classmethod
    def of(cls, cfg, packed, dtype: torch.dtype = torch.bfloat16) -> "BlockShape":
        """From a ``DiTConfig`` and a ``PackedSequence``; the branch reads the video rows of every frame but
        the two anchor frames (the released window)."""
        layout = packed.layout
        branch_frames = max(0, layout.num_frames - 2)
        return cls(
            rows=int(packed.positions.shape[0]),
            hidden=cfg.hidden,
            inner=cfg.inner,
            ffn=cfg.ffn,
            branch_rows=branch_frames * layout.tokens_per_frame,
            element=torch.empty((), dtype=dtype).element_size(),
            branch_frames=branch_frames,
        )


def block_peaks(
    shape: BlockShape,
    options: LowMemory = LowMemory(),
    *,
    hybrid: bool,
    fused: bool = False,
    linears: str = "dtype",
    branch_stream: bool = False,
    attention_precision: str = "bf16",
) -> dict[str, float]:
    """Predicted peak bytes above what is allocated when a block is called: ``attention``, ``ffn`` and the
    whole ``block`` (their maximum). ``fused``: the blocks run ``block_fused``'s kernels; ``linears="fp8"``:
    with head groups the projection's input is quantised once for all groups and held through them;
    ``branch_stream``: the linear branch beside the window softmax (one head group), ``BRANCH_BESIDE_EXTRA``;
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
        if branch_stream and not grouped:
            attention += (FP8_BRANCH_BESIDE_EXTRA if fp8 else BRANCH_BESIDE_EXTRA) * I
            if linears != "fp8":  # the readout waits for the first stream's to_out_linear, not its output
                attention += shape.branch_rows * (shape.inner - shape.hidden) * e
    if grouped and linears == "fp8":
        attention += T * (shape.hidden + 4)  # e4m3 codes and an fp32 scale per row (Attention.projection_input)
    chunk = T if options.ffn_chunk_rows is None else min(T, options.ffn_chunk_rows)
    fc2_out = (chunk * shape.hidden * e + D) if chunk < T else D
    ffn = 2 * D + 2 * chunk * shape.ffn * e + fc2_out
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
        if linears == "fp8" and parent in FP8_LAYERS and name.endswith(".weight") and tensor.dim() == 2:
            return tensor.numel() + tensor.shape[0] * 4
        return tensor.numel() * element

    tensors = list(model.named_parameters()) + list(model.named_buffers())
    block = sum(size(n, t) for n, t in tensors if n.startswith("blocks.0."))
    adaln = sum(size(n, t) for n, t in tensors if n.startswith("blocks.0.adaln_proj."))
    other = sum(size(n, t) for n, t in tensors if not n.startswith("blocks."))
    return WeightBytes(per_block=block, other=other, blocks=cfg.layers, adaln=adaln)


def evaluation_peak(
    cfg,
    shape: BlockShape,
    options: LowMemory = LowMemory(),
    *,
    hybrid: bool,
    dtype: torch.dtype = torch.bfloat16,
    linears: str = "dtype",
    resident_blocks: int | None = None,
    prefetch: int = 1,
    adaln_on_host: bool = False,
    steps: int = 50,
    timesteps_per_step: int = 2,
    fused: bool = False,
    branch_stream: bool = False,
    attention_precision: str = "bf16",
) -> dict[str, float]:
    """Predicted peak device bytes of one model evaluation (``branch_stream`` and ``attention_precision`` as
    ``block_peaks``): the weights on
    the device (all blocks, or ``resident_blocks`` of them plus ``prefetch + 1`` streaming slots of one block each;
    without the blocks' AdaLN projections when ``adaln_on_host``, but with their tables for ``steps`` steps of
    ``timesteps_per_step`` distinct timesteps), the hidden state and the RoPE tables that live through the
    whole evaluation, and the largest block's working memory. Returns ``weights``, ``activations`` and
    ``total``."""
    weights = weight_bytes(cfg, dtype, linears=linears)
    per_block = weights.per_block
    if adaln_on_host:
        table = timesteps_per_step * 6 * MODALITIES * cfg.hidden * torch.empty((), dtype=dtype).element_size()
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
        hybrid=hybrid,
        fused=fused,
        linears=linears,
        branch_stream=branch_stream,
        attention_precision=attention_precision,
    )
    activations = living + peaks["block"]
    return dict(weights=float(on_device), activations=float(activations), total=float(on_device + activations))


# Extra time of each lower-memory choice, as a fraction of a hybrid block's time at the release length
# (bench/results/dit_block.md).
HEAD_GROUP_COST = {1: 0.0, 2: 0.0, 4: 0.08, 8: 0.19}
# With fused blocks, as a fraction of a whole evaluation (bench/results/dit_step.md): 2 groups with a
# 32,768-row FFN; 8 groups with a 16,384-row FFN and 14 of 50 blocks streamed (the groups' share not separated).
FUSED_HEAD_GROUP_COST = {1: 0.0, 2: 0.02, 8: 0.91}
# Host-to-device copy rate assumed for streamed blocks when no measurement overrides it (pinned memory, PCIe 5).
HOST_COPY_BYTES_PER_S = 25e9

# The order a card short of memory gives things up in: the cheapest first.
LOW_MEMORY_STEPS = (
    ("2 head groups, FFN in 32768-row chunks", LowMemory(ffn_chunk_rows=32768, head_groups=2), False),
    ("AdaLN projections in host memory", LowMemory(ffn_chunk_rows=32768, head_groups=2), True),
    ("4 head groups, FFN in 16384-row chunks", LowMemory(ffn_chunk_rows=16384, head_groups=4), True),
    ("8 head groups, FFN in 16384-row chunks", LowMemory(ffn_chunk_rows=16384, head_groups=8), True),
)


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


def plan_for_memory(
    cfg,
    shape: BlockShape,
    budget: float,
    *,
    hybrid: bool,
    dtype: torch.dtype = torch.bfloat16,
    linears: str = "dtype",
    steps: int = 50,
    prefetch: int = 1,
    fused: bool = False,
    attention_precision: str = "bf16",
) -> MemoryPlan:
    """The cheapest way to run within ``budget`` bytes of device memory (e.g. the free memory less a margin):
    nothing, then the ``LOW_MEMORY_STEPS`` in order, then streaming blocks from host memory with as many as
    fit resident. A plan that still does not fit comes back with ``fits`` False and every step taken."""
    taken: list[str] = []

    def peak(options, adaln_on_host, resident=None):
        return evaluation_peak(
            cfg,
            shape,
            options,
            hybrid=hybrid,
            dtype=dtype,
            linears=linears,
            steps=steps,
            adaln_on_host=adaln_on_host,
            resident_blocks=resident,
            prefetch=prefetch,
            fused=fused,
            attention_precision=attention_precision,
        )

    def plan(options, adaln_on_host, resident, predicted, extra):
        return MemoryPlan(options, adaln_on_host, resident, predicted, budget, tuple(taken), extra)

    options, adaln_on_host = LowMemory(), False
    predicted = peak(options, adaln_on_host)
    if predicted["total"] <= budget:
        return plan(options, adaln_on_host, None, predicted, "none")
    for name, step_options, step_adaln in LOW_MEMORY_STEPS:
        if step_options.head_groups > cfg.heads:
            continue  # a model with fewer heads stops at one head per group
        options, adaln_on_host = step_options, step_adaln
        taken.append(name)
        predicted = peak(options, adaln_on_host)
        if predicted["total"] <= budget:
            return plan(options, adaln_on_host, None, predicted, _group_cost(options, fused))
    weights = weight_bytes(cfg, dtype, linears=linears)
    per_block = weights.per_block - weights.adaln
    for resident in range(cfg.layers - 1, -1, -1):
        predicted = peak(options, adaln_on_host, resident)
        if predicted["total"] <= budget:
            break
    streamed = cfg.layers - resident
    taken.append(f"{streamed} of {cfg.layers} blocks streamed from host memory")
    copy_s = streamed * per_block / HOST_COPY_BYTES_PER_S
    extra = (
        f"{_group_cost(options, fused)}; up to {copy_s:.1f} s per evaluation of block copies not hidden behind compute"
    )
    return plan(options, adaln_on_host, resident, predicted, extra)


def _group_cost(options: LowMemory, fused: bool = False) -> str:
    if fused:
        cost = FUSED_HEAD_GROUP_COST.get(options.head_groups)
        return "more time: unmeasured" if cost is None else f"about {round(100 * cost)} % more time per evaluation"
    cost = HEAD_GROUP_COST.get(options.head_groups)
    return "unmeasured" if cost is None else f"about {round(100 * cost)} % more time per hybrid block"
