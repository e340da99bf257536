"""Dense attention that also returns the log-sum-exp, over every kernel this machine offers.

Shape legend (B batch, T rows, H heads, D head dim):
    token-major (default): q ``[T, H, D]`` or ``[B, T, H, D]``; lse ``[T, H]`` or ``[B, T, H]``.
    head-major (``head_major=True``): q ``[H, T, D]`` or ``[B, H, T, D]``; lse ``[H, T]`` or ``[B, H, T]``.
Inputs may be strided views (only the last dim must be contiguous), including overlapping views of
one buffer along the batch dim. ``out`` has q's layout and dtype. ``lse`` is the natural-log
log-sum-exp of the scaled scores, float32 (float64 for float64 inputs); it may be a strided view.

Kernels, best first: ``fa4`` (flash-attn-4, CuTe DSL), ``fa3`` (flash-attn 3, Hopper), ``fa2``
(flash-attn 2), ``cudnn`` / ``flash`` / ``efficient`` (PyTorch's fused SDPA ops), ``math`` (any device,
any dtype; the reference). The choice is probed once per (device, dtype, head_dim): each candidate must
import, claim the device and dtype, and reproduce ``math`` on a small trial that includes an
overlapping strided key view. ``force_kernel`` or ``kernel=`` pins one for tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from ..errors import H3BackendUnavailable, H3InputError

__all__ = [
    "KERNELS",
    "AttnOut",
    "DeviceFacts",
    "dense_attention",
    "resolve_kernel",
    "force_kernel",
    "probed_kernels",
    "device_facts",
]

log = logging.getLogger(__name__)

KERNELS = ("fa4", "fa3", "fa2", "cudnn", "flash", "efficient", "math")
_HALF = (torch.float16, torch.bfloat16)


class AttnOut(NamedTuple):
    out: torch.Tensor
    lse: torch.Tensor


@dataclass(frozen=True)
class DeviceFacts:
    """What the kernel choice depends on; tests replace ``device_facts`` to stand in for a GPU."""

    type: str
    capability: tuple[int, int] | None = None
    rocm: bool = False
    arch: str | None = None  # the ROCm gfx name, e.g. "gfx950"


def device_facts(device: torch.device) -> DeviceFacts:
    if device.type != "cuda":
        return DeviceFacts(device.type)
    rocm = torch.version.hip is not None
    arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", None) if rocm else None
    return DeviceFacts("cuda", tuple(torch.cuda.get_device_capability(device)), rocm=rocm, arch=arch)


def _optional_module(name: str):
    try:
        return importlib.import_module(name)
    except Exception:  # a broken optional install must not stop the pack from loading
        return None


# Every kernel below takes token-major [B, T, H, D] views, the scale, whether attention is causal (query
# i sees keys 0..i; Tq == Tk) and an optional preallocated output it may write into, and returns
# (out [B, Tq, H, D], lse [B, Tq, H]).


def _math(q, k, v, scale, causal=False, out=None):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qh, kh, vh = (x.transpose(1, 2).to(acc) for x in (q, k, v))
    B, H, Tq, _ = qh.shape
    out = torch.empty(B, H, Tq, vh.shape[-1], dtype=acc, device=q.device)
    lse = torch.empty(B, H, Tq, dtype=acc, device=q.device)
    # Bound the transient score block to about 64 Mi elements.
    step = max(1, (1 << 26) // max(1, B * H * kh.shape[2]))
    for s in range(0, Tq, step):
        scores = torch.matmul(qh[:, :, s : s + step], kh.transpose(-1, -2)) * scale
        if causal:
            rows = torch.arange(s, s + scores.shape[2], device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(kh.shape[2], device=q.device)[None, :] > rows, float("-inf"))
        lse_block = torch.logsumexp(scores, dim=-1)
        lse[:, :, s : s + step] = lse_block
        out[:, :, s : s + step] = torch.matmul(torch.exp(scores - lse_block.unsqueeze(-1)), vh)
    return out.transpose(1, 2).to(q.dtype), lse.transpose(1, 2)


def _head_major(*xs):
    return tuple(x.transpose(1, 2) for x in xs)


def _cudnn(q, k, v, scale, causal=False, out=None):
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        *_head_major(q, k, v), None, True, is_causal=causal, scale=scale
    )
    out, lse = res[0], res[1]
    if lse.dim() == 4:  # some releases return [B, H, T, 1]
        lse = lse.squeeze(-1)
    return out.transpose(1, 2), lse.transpose(1, 2)


def _flash(q, k, v, scale, causal=False, out=None):
    res = torch.ops.aten._scaled_dot_product_flash_attention(*_head_major(q, k, v), is_causal=causal, scale=scale)
    return res[0].transpose(1, 2), res[1].transpose(1, 2)


def _efficient(q, k, v, scale, causal=False, out=None):
    res = torch.ops.aten._scaled_dot_product_efficient_attention(
        *_head_major(q, k, v), None, True, is_causal=causal, scale=scale
    )
    # The log-sum-exp comes padded to a multiple of 32 rows.
    return res[0].transpose(1, 2), res[1][:, :, : q.shape[1]].transpose(1, 2)


def _lse_from_flash_attn(res):
    out, lse = res[0], res[1]
    return out, lse.transpose(1, 2)


def _fa2(q, k, v, scale, causal=False, out=None):
    fa = importlib.import_module("flash_attn")
    res = fa.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True)
    return _lse_from_flash_attn(res)


def _fa3(q, k, v, scale, causal=False, out=None):
    fa = importlib.import_module("flash_attn_interface")
    res = fa.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True)
    return _lse_from_flash_attn(res)


def _fa4(q, k, v, scale, causal=False, out=None):
    if out is None:
        fa = importlib.import_module("flash_attn.cute")
        res = fa.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
        return _lse_from_flash_attn(res)
    # The forward entry point takes a preallocated output, which spares a copy per call.
    fwd = importlib.import_module("flash_attn.cute.interface")._flash_attn_fwd
    return _lse_from_flash_attn(fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True, out=out))


def _cuda_only(facts: DeviceFacts, dtype, min_cc=(8, 0), dtypes=_HALF):
    if facts.type != "cuda":
        return "needs a CUDA device"
    if facts.rocm:
        return "not built for ROCm here"
    if facts.capability is None or facts.capability < min_cc:
        return f"needs compute capability >= {min_cc[0]}.{min_cc[1]}, device has {facts.capability}"
    if dtype not in dtypes:
        return f"does not take {dtype}"
    return None


def _needs_module(module: str, package: str):
    def check(facts, dtype, head_dim):
        if _optional_module(module) is None:
            return f"'{module}' is not importable (install {package})"
        return None

    return check


def _all(*checks):
    def check(facts, dtype, head_dim):
        for c in checks:
            reason = c(facts, dtype, head_dim)
            if reason:
                return reason
        return None

    return check


def _head_dim_at_most(limit):
    return lambda facts, dtype, head_dim: (
        None
        if head_dim <= limit and head_dim % 8 == 0
        else (f"head_dim {head_dim} must be a multiple of 8 and <= {limit}")
    )


@dataclass(frozen=True)
class _Kernel:
    name: str
    run: Callable
    check: Callable  # (facts, dtype, head_dim) -> reason it cannot run, or None


_KERNELS = {
    k.name: k
    for k in (
        _Kernel(
            "fa4",
            _fa4,
            _all(
                lambda f, d, h: (
                    _cuda_only(f, d, (9, 0))
                    or (None if f.capability[0] in (9, 10, 11) else "flash-attn-4 runs on sm90/sm100/sm110 only")
                ),
                _head_dim_at_most(256),
                _needs_module("flash_attn.cute", "flash-attn-4"),
            ),
        ),
        _Kernel(
            "fa3",
            _fa3,
            _all(
                lambda f, d, h: (
                    _cuda_only(f, d, (9, 0)) or (None if f.capability[0] == 9 else "flash-attn 3 runs on sm90 only")
                ),
                _head_dim_at_most(256),
                _needs_module("flash_attn_interface", "flash-attn 3 (hopper build)"),
            ),
        ),
        _Kernel(
            "fa2",
            _fa2,
            _all(
                lambda f, d, h: _cuda_only(f, d, (8, 0)),
                _head_dim_at_most(256),
                _needs_module("flash_attn", "flash-attn 2"),
            ),
        ),
        _Kernel("cudnn", _cudnn, _all(lambda f, d, h: _cuda_only(f, d, (9, 0)), _head_dim_at_most(256))),
        _Kernel("flash", _flash, _all(lambda f, d, h: _cuda_only(f, d, (8, 0)), _head_dim_at_most(256))),
        _Kernel(
            "efficient",
            _efficient,
            _all(lambda f, d, h: _cuda_only(f, d, (5, 0), _HALF + (torch.float32,)), _head_dim_at_most(512)),
        ),
        _Kernel("math", _math, lambda f, d, h: None),
    )
}


@dataclass(frozen=True)
class KernelChoice:
    """The kernel picked for one (device, dtype, head_dim) and why the better ones were passed over."""

    name: str
    rejected: tuple[tuple[str, str], ...]


_probed: dict[tuple, KernelChoice] = {}
_verified: set[tuple] = set()
_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("h3_forced_kernel", default=None)


def _check_name(name: str) -> None:
    if name not in _KERNELS:
        raise H3InputError(f"unknown attention kernel {name!r}; valid kernels: {list(KERNELS)}")


@contextlib.contextmanager
def force_kernel(name: str):
    """Run every dense attention inside the block with kernel ``name`` (an error if it cannot run)."""
    _check_name(name)
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def probed_kernels() -> dict[tuple, KernelChoice]:
    """The probe results so far, keyed by ``(device, dtype, head_dim)``."""
    return dict(_probed)


def _trial_passes(kernel: _Kernel, device, dtype, head_dim) -> str | None:
    """Run the kernel on a small case shaped like the window calls; return why it failed, or None."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    H, Tq, Tk, stride = 2, 37, 70, 23
    q = torch.randn(2, Tq, H, head_dim, generator=gen).to(device, dtype)
    kv = torch.randn(2, Tk + stride, H, head_dim, generator=gen).to(device, dtype)
    # Overlapping batch views of one buffer, as the decomposed window path issues them.
    view = kv.as_strided((2, Tk, H, head_dim), (stride * H * head_dim, H * head_dim, head_dim, 1))
    scale = head_dim**-0.5
    try:
        out, lse = kernel.run(q, view, view, scale)
    except Exception as exc:  # any failure just rules the kernel out
        return f"trial call failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    ref_out, ref_lse = _math(q, view, view, scale)
    if out.shape != ref_out.shape or lse.shape != ref_lse.shape:
        return f"trial returned shapes {tuple(out.shape)}/{tuple(lse.shape)}"
    err = (out.float() - ref_out.float()).norm() / ref_out.float().norm()
    lse_err = (lse.float() - ref_lse.float()).abs().max()
    if not (err < 2e-2 and lse_err < 2e-2):
        return f"trial disagrees with math (out rel err {err:.2e}, lse abs err {lse_err:.2e})"
    return None


def _why_not(kernel: _Kernel, device, dtype, head_dim) -> str | None:
    reason = kernel.check(device_facts(device), dtype, head_dim)
    if reason is None and kernel.name != "math":
        reason = _trial_passes(kernel, device, dtype, head_dim)
    return reason


def resolve_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, kernel: str | None = None) -> str:
    """The kernel dense attention will use for these facts (probing on first use)."""
    device = torch.device(device)
    name = kernel or _forced.get()
    if name is not None:
        _check_name(name)
        key = (str(device), dtype, head_dim, name)
        if key not in _verified:
            reason = _why_not(_KERNELS[name], device, dtype, head_dim)
            if reason:
                raise H3BackendUnavailable(
                    f"attention kernel {name!r} cannot run on {device} with {dtype}, head_dim {head_dim}: {reason}"
                )
            _verified.add(key)
        return name
    key = (str(device), dtype, head_dim)
    choice = _probed.get(key)
    if choice is None:
        rejected = []
        for cand in KERNELS:
            reason = _why_not(_KERNELS[cand], device, dtype, head_dim)
            if reason is None:
                choice = KernelChoice(cand, tuple(rejected))
                break
            rejected.append((cand, reason))
        _probed[key] = choice
        log.info(
            "dense attention on %s %s d=%d uses %s (passed over: %s)",
            device,
            dtype,
            head_dim,
            choice.name,
            "; ".join(f"{n}: {r}" for n, r in rejected) or "none",
        )
    return choice.name


def _as_batched_token_major(x: torch.Tensor, head_major: bool) -> torch.Tensor:
    if x.dim() == 3:
        x = x.unsqueeze(0)
    return x.transpose(1, 2) if head_major else x


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    head_major: bool = False,
    kernel: str | None = None,
    causal: bool = False,
    out: torch.Tensor | None = None,
) -> AttnOut:
    """Full (unmasked) attention of every query over every key, with the log-sum-exp.

    Args:
        q: ``[Tq, H, D]`` / ``[B, Tq, H, D]`` (or head-major, see the module docstring).
        k, v: the same layout with ``Tk`` rows.
        scale: score scale. Default: ``D ** -0.5``.
        head_major: inputs are ``[.., H, T, D]``.
        kernel: force one of ``KERNELS``. Default: the probed choice (or ``force_kernel``'s).
        causal: query i attends to keys 0..i only (needs Tq == Tk). Default: False.
        out: a preallocated output (q's shape and layout) that kernels able to do so write into; the
            result is that tensor when ``result.out is out``, else a new one.
    Returns:
        ``AttnOut(out, lse)``: out in q's layout and dtype, lse ``[.., Tq, H]`` (``[.., H, Tq]`` head-major).
    """
    if q.dim() not in (3, 4) or q.dim() != k.dim() or k.shape != v.shape:
        raise H3InputError(
            f"dense_attention needs q, k, v of equal rank 3 or 4 and k.shape == v.shape; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise H3InputError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    batched = q.dim() == 4
    q4, k4, v4 = (_as_batched_token_major(x, head_major) for x in (q, k, v))
    if q4.shape[0] != k4.shape[0] or q4.shape[2:] != k4.shape[2:] or k4.shape[1] == 0:
        raise H3InputError(
            f"dense_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, heads and "
            f"head dim, and k needs at least one row"
        )
    if causal and q4.shape[1] != k4.shape[1]:
        raise H3InputError(f"causal attention needs as many queries as keys, got {q4.shape[1]} and {k4.shape[1]}")
    head_dim = q4.shape[-1]
    scale = head_dim**-0.5 if scale is None else float(scale)
    name = resolve_kernel(q.device, q.dtype, head_dim, kernel)
    given = out
    if q4.shape[1] == 0:
        res = torch.empty_like(q4)
        lse = torch.empty(
            q4.shape[:3], dtype=torch.float64 if q.dtype == torch.float64 else torch.float32, device=q.device
        )
    else:
        target = None if out is None or out.shape != q.shape else _as_batched_token_major(out, head_major)
        res, lse = _KERNELS[name].run(q4, k4, v4, scale, causal, target)
        if target is not None and res.data_ptr() == target.data_ptr() and res.stride() == target.stride():
            return AttnOut(given, _unbatch(lse, head_major, batched))
    if head_major:
        res = res.transpose(1, 2)
    if not batched:
        res = res[0]
    return AttnOut(res, _unbatch(lse, head_major, batched))


def _unbatch(lse, head_major, batched):
    if head_major:
        lse = lse.transpose(1, 2)
    return lse if batched else lse[0]
