"""``window_softmax``: the VDN-H3 window softmax over a packed sequence, on the backend you choose.

Backends share one signature ``(q, k, v, layout, window, scale) -> out`` on token-major ``[T, H, D]``:
  * ``ref`` — per-frame loop of dense attention (the oracle; any device, any dtype);
  * ``flex`` — FlexAttention with a cached block mask;
  * ``decomposed`` — dense calls over strided window views merged by log-sum-exp (no mask, no copies);
  * ``auto`` — decomposed on CUDA when a fused dense kernel with log-sum-exp is available, else flex on
    CUDA, else ref. ``on_run`` is told what actually ran.
When every window covers all frames the rule keeps every pair and any backend but ``ref`` runs one dense
call.

``precision="fp8"`` (opt-in, approximate): q, k and v in e4m3 with one scale each and the probabilities
rounded to e4m3 inside the kernel (``window_fp8``): the decomposed plan on an fp8 kernel (``auto`` resolves
to it), or the per-frame reference on the emulated kernel (``ref``); flex has no fp8 form.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from dataclasses import dataclass
from enum import Enum
from typing import Callable

import torch

from ..errors import H3BackendUnavailable, H3InputError
from . import window_flex
from .kernels import dense_attention, resolve_kernel
from .layout import SequenceLayout, WindowSpec, is_full_cover, window_bounds
from .window_decomposed import window_softmax_decomposed
from .window_fp8 import window_softmax_fp8, window_softmax_fp8_ref
from .window_ref import window_softmax_ref

__all__ = [
    "WindowBackend",
    "BACKENDS",
    "PRECISIONS",
    "check_precision",
    "WindowRun",
    "window_softmax",
    "resolve_window_backend",
    "force_window_backend",
]

log = logging.getLogger(__name__)


class WindowBackend(str, Enum):
    AUTO = "auto"
    DECOMPOSED = "decomposed"
    FLEX = "flex"
    REF = "ref"


BACKENDS = tuple(b.value for b in WindowBackend)
# bf16: exact in the inputs' own dtype (whatever it is); fp8: e4m3 inputs and probabilities, faster, approximate.
PRECISIONS = ("bf16", "fp8")


@dataclass(frozen=True)
class WindowRun:
    """What a ``window_softmax`` call ran: the backend asked for, the one resolved, and the kernel
    underneath (a dense kernel name, or flex's ``triton`` / ``flash`` / ``eager``)."""

    requested: str
    backend: str
    kernel: str


_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("h3_forced_window_backend", default=None)
_auto_logged: set = set()


def _check_backend(name) -> str:
    value = name.value if isinstance(name, WindowBackend) else name
    if value not in BACKENDS:
        raise H3InputError(f"unknown window softmax backend {name!r}; valid backends: {list(BACKENDS)}")
    return value


@contextlib.contextmanager
def force_window_backend(name: str):
    """Make every ``window_softmax(backend="auto")`` inside the block use ``name``."""
    token = _forced.set(_check_backend(name))
    try:
        yield
    finally:
        _forced.reset(token)


def resolve_window_backend(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The concrete backend for a request; an explicit choice that cannot run raises."""
    name = _check_backend(backend)
    if name == "auto":
        name = _forced.get() or "auto"
    if name == "flex" and not window_flex.is_available():
        raise H3BackendUnavailable(
            "window softmax backend 'flex' needs torch.nn.attention.flex_attention (PyTorch >= 2.5); "
            "use backend 'decomposed' or upgrade PyTorch"
        )
    if name != "auto":
        return name
    device = torch.device(device)
    if device.type == "cuda":
        kernel = resolve_kernel(device, dtype, head_dim)
        if kernel != "math":
            resolved = "decomposed"
        else:
            resolved = "flex" if window_flex.is_available() else "ref"
    else:
        resolved = "ref"
    key = (str(device), dtype, head_dim)
    if key not in _auto_logged:
        _auto_logged.add(key)
        log.info("window softmax backend 'auto' on %s %s d=%d resolved to %s", device, dtype, head_dim, resolved)
    return resolved


def check_precision(precision: str, backend: str = "auto") -> str:
    """``precision`` if it is one of ``PRECISIONS`` and ``backend`` has a form for it, else ``H3InputError``."""
    if precision not in PRECISIONS:
        raise H3InputError(f"attention_precision: must be one of {list(PRECISIONS)}, got {precision!r}")
    if precision == "fp8" and _check_backend(backend) == "flex":
        raise H3InputError(
            "attention_precision: 'fp8' runs on window_backend 'auto' or 'decomposed' (or 'ref', emulated), "
            "got window_backend 'flex'"
        )
    return precision


def _validate(q, k, v, layout, window):
    if not isinstance(layout, SequenceLayout):
        raise H3InputError(f"layout must be a SequenceLayout, got {type(layout).__name__}")
    if not isinstance(window, WindowSpec):
        raise H3InputError(f"window must be a WindowSpec, got {type(window).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise H3InputError(f"{name} must be a token-major [T, H, D] tensor, got {shape}")
        if not x.is_floating_point():
            raise H3InputError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x.stride(-1) != 1:
            raise H3InputError(f"{name} must have a contiguous last dim, got strides {x.stride()}")
    if not (q.shape == k.shape == v.shape):
        raise H3InputError(
            f"q, k, v must have the same [T, H, D] shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise H3InputError(f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype}")
    if q.shape[0] != layout.seq_len:
        raise H3InputError(f"q has {q.shape[0]} rows but layout.seq_len is {layout.seq_len}")


_RUNNERS = {  # decomposed is called on its own: it takes the gate
    "ref": window_softmax_ref,
    "flex": window_flex.window_softmax_flex_run,
}


def window_softmax(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SequenceLayout,
    window: WindowSpec,
    backend: str = "auto",
    scale: float | None = None,
    on_run: Callable[[WindowRun], None] | None = None,
    precision: str = "bf16",
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention under the VDN-H3 window rule.

    Args:
        q, k, v: ``[T, H, D]`` token-major, any float dtype, ``T == layout.seq_len``.
        layout: where global rows and video frames sit.
        window: radius, chunk and anchors of the window rule.
        backend: one of ``BACKENDS``. Default: ``"auto"``.
        scale: score scale. Default: ``D ** -0.5``.
        on_run: called with what ran (``WindowRun``) once the call has run.
        precision: one of ``PRECISIONS`` (see the module docstring). Default: ``"bf16"``, exact.
        gate: ``[T, H]`` or None: the output multiplied per row and head (the hybrid block's softmax gate),
            by the decomposed backend's staged windows as they convert their output, elsewhere after.
    Returns:
        ``[T, H, D]`` in q's dtype.
    """
    _validate(q, k, v, layout, window)
    if gate is not None and gate.shape != q.shape[:2]:
        raise H3InputError(f"gate must be [T, H] = {list(q.shape[:2])}, got {list(gate.shape)}")
    requested = _check_backend(backend)
    head_dim = q.shape[-1]
    scale = head_dim**-0.5 if scale is None else float(scale)
    if check_precision(precision, requested) == "fp8":
        name = "ref" if (_forced.get() if requested == "auto" else requested) == "ref" else "decomposed"
        if name == "ref":
            out, kernel = window_softmax_fp8_ref(q, k, v, layout, window, scale).to(q.dtype), "emulated"
        else:
            out, kernel = window_softmax_fp8(q, k, v, layout, window, scale)
        if on_run is not None:
            on_run(WindowRun(requested, name, kernel))
        return out if gate is None else out.mul_(gate[..., None])
    name = resolve_window_backend(requested, q.device, q.dtype, head_dim)
    F = layout.num_frames
    full = is_full_cover(window_bounds(F, window.radius, window.chunk), F)
    if full and name != "ref":
        out = dense_attention(q, k, v, scale=scale).out
        kernel = resolve_kernel(q.device, q.dtype, head_dim)
    elif name == "decomposed":
        out, gate = window_softmax_decomposed(q, k, v, layout, window, scale, gate=gate), None
        kernel = resolve_kernel(q.device, q.dtype, head_dim)
    else:
        out = _RUNNERS[name](q, k, v, layout, window, scale)
        out, kernel = out if name == "flex" else (out, "sdpa")
    if on_run is not None:
        on_run(WindowRun(requested, name, kernel))
    return out if gate is None else out.mul_(gate[..., None])
