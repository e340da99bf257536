"""Window softmax through FlexAttention and a block mask built from the layout.

The mask is a pure ``mask_mod`` over four per-row tables (the row's frame, the clamped window of a query
row, and whether a key row is an anchor column), so one compiled kernel serves every geometry of the
same length. Block masks are cached (bounded LRU) by geometry, block size and device.

On CUDA with Triton the kernel (and the block mask) is compiled once per shape; when flash-attn-4 is
importable on sm90+ it runs through flex's FLASH backend (FA4), falling back to Triton if FLASH fails and to eager
flex if compiling fails, from then on (one line logged): what the process's ``FlexKernel`` has learnt.
On other devices, and on the plain path (``triton_forms.plain_path``: the user's ``compile="off"``), flex runs
eagerly (it materialises the scores: fine for tests, not for long sequences). Dynamo's recompile limit is
raised only around the compiled calls.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings

import torch

from ..triton_forms import CompiledForm, compiles_on, compiling, guarded, plain_path
from ._lru import BoundedLRU
from .layout import SequenceLayout, WindowSpec, anchor_frames, clamped_window, window_bounds

__all__ = [
    "FlexKernel",
    "FLEX",
    "window_softmax_flex",
    "build_window_block_mask",
    "block_mask_cache_info",
    "MAX_CACHED_MASKS",
]

log = logging.getLogger(__name__)

MAX_CACHED_MASKS = 16
FLEX_KERNELS = ("auto", "triton", "flash")
_masks = BoundedLRU(MAX_CACHED_MASKS)
# One compiled kernel (and mask) per sequence length: more than dynamo's default 8 geometries.
RECOMPILE_LIMIT = 64
# Flex kernels index with int32: one call may hold at most this many elements per q/k/v tensor.
_MAX_ELEMENTS = 2**31 - 1


def _flex():
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def is_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def block_size_for(device: torch.device):
    """(Q, KV) block: 256×128 on datacenter Blackwell (sm100/sm103), where FA4 needs it; 128 elsewhere."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) in ((10, 0), (10, 3)):
        return (256, 128)
    return 128


def _row_tables(layout: SequenceLayout, window: WindowSpec, device):
    T, F = layout.seq_len, layout.num_frames
    S = layout.tokens_per_frame
    row_frame = torch.full((T,), -1, dtype=torch.int32)
    row_lo = torch.zeros(T, dtype=torch.int32)
    row_hi = torch.full((T,), max(F - 1, 0), dtype=torch.int32)
    is_column_anchor = torch.zeros(T, dtype=torch.bool)
    v0 = layout.video_start
    if F:
        row_frame[v0 : layout.video_stop] = torch.arange(F, dtype=torch.int32).repeat_interleave(S)
        anchors = anchor_frames(F)
        for frame, bounds in enumerate(window_bounds(F, window.radius, window.chunk)):
            if window.anchor_rows and frame in anchors:
                continue
            a, b = layout.frame_rows(frame)
            row_lo[a:b], row_hi[a:b] = clamped_window(bounds, F)
        if window.anchor_columns:
            for frame in anchors:
                a, b = layout.frame_rows(frame)
                is_column_anchor[a:b] = True
    return tuple(t.to(device) for t in (row_frame, row_lo, row_hi, is_column_anchor))


def _compiles(device: torch.device) -> bool:
    """Whether flex may be compiled for ``device``: CUDA with Triton, off the plain path."""
    return compiling() and compiles_on(device)


def _recompile_limit():
    """Dynamo's recompile limit raised to ``RECOMPILE_LIMIT`` while the block runs (restored after)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(getattr(config, name), RECOMPILE_LIMIT)})


def build_window_block_mask(layout: SequenceLayout, window: WindowSpec, device, block_size=None, kernel=None):
    """The FlexAttention ``BlockMask`` of the window rule for ``layout`` (uncached), built by a compiled
    function where flex is compiled (``_compiles``) and ``kernel`` (the process's ``FLEX`` by default) has not
    failed to compile."""
    device = torch.device(device)
    form = (kernel or FLEX).compiled_form
    if form.tries(_compiles(device)):
        with form.attempt(), _recompile_limit():
            return _block_mask(layout, window, device, block_size, True)
    with plain_path():
        return _block_mask(layout, window, device, block_size, False)


def _block_mask(layout: SequenceLayout, window: WindowSpec, device: torch.device, block_size, compiled: bool):
    from torch.nn.attention.flex_attention import create_block_mask

    row_frame, row_lo, row_hi, is_column_anchor = _row_tables(layout, window, device)

    def mask_mod(b, h, q_idx, kv_idx):
        key_frame = row_frame[kv_idx]
        in_window = (key_frame >= row_lo[q_idx]) & (key_frame <= row_hi[q_idx])
        return (key_frame < 0) | in_window | is_column_anchor[kv_idx]

    T = layout.seq_len
    with warnings.catch_warnings():
        # torch >= 2.10 deprecates the flag in favour of torch.compile(create_block_mask); both build the
        # mask blockwise instead of materialising T×T.
        warnings.filterwarnings("ignore", message=".*_compile flag on create_block_mask.*")
        build = guarded(create_block_mask) if compiled else create_block_mask
        return build(
            mask_mod,
            None,
            None,
            T,
            T,
            device=device,
            BLOCK_SIZE=block_size or block_size_for(device),
            _compile=compiled,
        )


def cached_block_mask(layout: SequenceLayout, window: WindowSpec, device, kernel=None):
    device = torch.device(device)
    block = block_size_for(device)
    key = (layout, window, str(device), block)
    return _masks.get_or_build(key, lambda: build_window_block_mask(layout, window, device, block, kernel))


def block_mask_cache_info() -> dict:
    return _masks.info()


class FlexKernel:
    """Flex attention's compiled kernel and what it has learnt: ``preferred`` ``"auto"`` runs FLASH (FA4) where
    usable, else Triton (benchmarks pin ``"triton"`` or ``"flash"``); a FLASH failure moves this kernel to Triton,
    a compile failure to eager flex (its ``compiled_form``), each for as long as it is used."""

    def __init__(self, preferred: str = "auto"):
        if preferred not in FLEX_KERNELS:
            raise ValueError(f"flex kernel: got {preferred!r}; allowed: {list(FLEX_KERNELS)}")
        self.preferred = preferred
        self.flash_failed = False
        self.compiled_form = CompiledForm("compiling flex attention failed", "running it eagerly")
        self._compiled = None

    def flash_usable(self, device) -> bool:
        if self.preferred == "flash":
            return True
        return (
            self.preferred == "auto"
            and not self.flash_failed
            and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9
            and importlib.util.find_spec("flash_attn") is not None
            and importlib.util.find_spec("flash_attn.cute") is not None
        )

    def run(self, q4, k4, v4, mask, scale, device):
        """``(output, which kernel ran it)``."""
        if self.compiled_form.tries(_compiles(device)):
            with self.compiled_form.attempt():
                if self._compiled is None:
                    self._compiled = torch.compile(_flex(), dynamic=False)
                with _recompile_limit():
                    return self._run_compiled(q4, k4, v4, mask, scale, device)
        with plain_path(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return _flex()(q4, k4, v4, block_mask=mask, scale=scale), "eager"

    def _run_compiled(self, q4, k4, v4, mask, scale, device):
        if self.flash_usable(device):
            try:
                flash = self._compiled(q4, k4, v4, block_mask=mask, scale=scale, kernel_options={"BACKEND": "FLASH"})
                return flash, "flash"
            except Exception as exc:  # FLASH lowering or FA4 failed: use Triton from now on
                if self.preferred == "flash":
                    raise
                self.flash_failed = True
                log.warning("flex FLASH backend failed (%s); using the Triton backend from now on", exc)
        return guarded(self._compiled)(q4, k4, v4, block_mask=mask, scale=scale), "triton"


# The process's flex kernel: the compiled flex function is one per process, and so is what it has learnt.
FLEX = FlexKernel()


def window_softmax_flex_run(
    q, k, v, layout: SequenceLayout, window: WindowSpec, scale: float, kernel: FlexKernel | None = None
) -> tuple[torch.Tensor, str]:
    """``window_softmax_flex`` and the kernel that ran it (``triton``, ``flash`` or ``eager``), through
    ``kernel`` (the process's ``FLEX`` by default)."""
    kernel = kernel or FLEX
    T, H, D = q.shape
    mask = cached_block_mask(layout, window, q.device, kernel)
    # Heads are split only when one call would overflow int32 indexing.
    heads_per_call = max(1, min(H, _MAX_ELEMENTS // max(1, T * D)))
    if heads_per_call == H:
        q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        res, ran = kernel.run(q4, k4, v4, mask, scale, q.device)
        return res[0].transpose(0, 1), ran
    out = torch.empty_like(q)
    for h0 in range(0, H, heads_per_call):
        h1 = min(H, h0 + heads_per_call)
        q4, k4, v4 = (x[:, h0:h1].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        res, ran = kernel.run(q4, k4, v4, mask, scale, q.device)
        out[:, h0:h1] = res[0].transpose(0, 1)
    return out, ran


def window_softmax_flex(
    q, k, v, layout: SequenceLayout, window: WindowSpec, scale: float, kernel: FlexKernel | None = None
) -> torch.Tensor:
    """Window softmax through FlexAttention with the window rule's block mask, through ``kernel``."""
    return window_softmax_flex_run(q, k, v, layout, window, scale, kernel)[0]
