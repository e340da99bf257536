"""Dense attention on e4m3 inputs: the opt-in fp8 window softmax's kernels.

Quantisation is per tensor: ``quantize_e4m3(x)`` maps ``x``'s largest magnitude onto e4m3's 448 and keeps the
inverse as a float32 ``descale`` on the device (no host sync). Inside the kernel the scores are
``(q8 · k8ᵀ) · descale_q · descale_k · scale``; the probabilities ``exp(s - max)`` (in [0, 1]) are scaled by
``P_SCALE`` and rounded to e4m3 before they meet ``v8``; the row sums are taken before that rounding.

Kernels (``FP8_KERNELS``), best first:
  * ``cudnn_fp8`` — cuDNN's FP8 SDPA forward through ``nvidia-cudnn-frontend`` (Hopper and later; ``fp8_cudnn``).
  * ``emulated`` — the same roundings in float32 matmuls, on any device: the reference every kernel is checked
    against, and what runs on the CPU (the fp8 kernels' rounding, none of their speed).

Shapes: token-major ``[T, H, D]`` or ``[B, T, H, D]``, any strides with a contiguous last dim.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from ..errors import H3BackendUnavailable, H3InputError
from . import fp8_cudnn
from .convert import scale_convert
from .kernels import device_facts

__all__ = [
    "E4M3",
    "E4M3_MAX",
    "P_SCALE",
    "FP8_KERNELS",
    "Fp8Rows",
    "quantize_e4m3",
    "fp8_attention",
    "fp8_attention_reference",
    "resolve_fp8_kernel",
    "fp8_kernel_refusals",
]

log = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# The probabilities are in [0, 1]; scaled onto e4m3's range before their rounding, as the fp8 kernels expect.
P_SCALE = 448.0
FP8_KERNELS = ("cudnn_fp8", "emulated")


class Fp8Rows(NamedTuple):
    """e4m3 ``values`` and the float32 ``descale`` (shape [1], on their device) that turns them back."""

    values: torch.Tensor
    descale: torch.Tensor

    def rows(self, index) -> "Fp8Rows":
        return Fp8Rows(self.values[index], self.descale)


def quantize_e4m3(x: torch.Tensor) -> Fp8Rows:
    """``x`` ([..., H, D], float) in e4m3 with one scale for the whole tensor: its largest magnitude onto 448."""
    lo, hi = torch.aminmax(x)
    # an all-zero tensor still gets a finite scale (its codes are zeros either way)
    amax = torch.maximum(-lo, hi).float().clamp(min=1e-30).reshape(1)
    scale = E4M3_MAX / amax
    values = torch.empty(x.shape, dtype=E4M3, device=x.device)
    if x.dim() == 3:
        scale_convert(x, values, scale, saturate=True)
    else:
        for i in range(x.shape[0]):
            scale_convert(x[i], values[i], scale, saturate=True)
    return Fp8Rows(values, 1.0 / scale)


def _batched(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 4 else x.unsqueeze(0)


def fp8_attention_reference(q: Fp8Rows, k: Fp8Rows, v: Fp8Rows, scale: float, out_fp8: bool = False):
    """The fp8 kernels' arithmetic in float32 (see the module docstring): ``[B, Tq, H, D]`` float32 output.
    ``out_fp8``: the output also rounded to e4m3 on v's scale (what a kernel that writes e4m3 returns)."""
    qh, kh, vh = (_batched(x.values).transpose(1, 2).float() for x in (q, k, v))
    score_scale = (q.descale * k.descale).reshape(()) * scale
    B, H, Tq, _ = qh.shape
    out = torch.empty(B, H, Tq, vh.shape[-1], dtype=torch.float32, device=qh.device)
    step = max(1, (1 << 24) // max(1, B * H * kh.shape[2]))
    for s in range(0, Tq, step):
        scores = torch.matmul(qh[:, :, s : s + step], kh.transpose(-1, -2)) * score_scale
        probs = torch.exp(scores - scores.amax(-1, keepdim=True))
        sums = probs.sum(-1, keepdim=True)
        rounded = (probs * P_SCALE).to(E4M3).float()
        out[:, :, s : s + step] = torch.matmul(rounded, vh) * (v.descale.reshape(()) / P_SCALE) / sums
    if out_fp8:
        # |o| <= max |v| = 448 · descale_v: e4m3 codes on v's own scale never saturate.
        out = (out / v.descale.reshape(())).to(E4M3).float() * v.descale.reshape(())
    return out.transpose(1, 2)


# Every kernel takes token-major [B, T, H, D] e4m3 views with their descales, the score scale, the output dtype and
# an optional preallocated output (q's shape, that dtype) it writes into; it returns the output.


def _emulated(q, k, v, scale, out_dtype, out=None, out_fp8=False):
    res = fp8_attention_reference(q, k, v, scale, out_fp8)
    if out is None:
        return res.to(out_dtype)
    out.copy_(res)
    return out


def _cudnn_fp8(q, k, v, scale, out_dtype, out=None, out_fp8=False):
    if out is None:
        out = torch.empty(q.values.shape, dtype=out_dtype, device=q.values.device)
    return fp8_cudnn.run(q.values, k.values, v.values, (q.descale, k.descale, v.descale), scale, P_SCALE, out)


@dataclass(frozen=True)
class _Fp8Kernel:
    name: str
    run: Callable
    check: Callable  # (facts, head_dim) -> reason it cannot run, or None


_KERNELS = {
    "cudnn_fp8": _Fp8Kernel("cudnn_fp8", _cudnn_fp8, fp8_cudnn.unavailable),
    # float32 matmuls over whole score rows: on a GPU only when asked for by name (tests, error tables)
    "emulated": _Fp8Kernel(
        "emulated",
        _emulated,
        lambda facts, head_dim: None if facts.type == "cpu" else "has none of the fp8 kernels' speed off the CPU",
    ),
}
_probed: dict[tuple, tuple[str, tuple]] = {}
# A kernel's output against the reference's: the two round the probabilities under different running maxima and
# sum in different orders, so a few codes land one e4m3 step apart (6-12 % of their value); where the kernel writes
# e4m3 outputs, so do some of those. cuDNN's difference on the GPU tests' cases: bench/results/fp8_attention.md.
TRIAL_TOLERANCE = 5e-2


def _check_name(name: str) -> None:
    if name not in _KERNELS:
        raise H3InputError(f"unknown fp8 attention kernel {name!r}; valid kernels: {list(FP8_KERNELS)}")


def _trial(kernel: _Fp8Kernel, device: torch.device, head_dim: int) -> str | None:
    """The kernel on a small case shaped like the window calls (a head slice of wider rows, two groups) against
    the reference; why it failed, or None."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(2, rows, 4, head_dim, generator=gen).to(device) for rows in (40, 72, 72))
    k[..., :3] *= 20  # a few large channels, as q·k has
    q8, k8, v8 = (quantize_e4m3(x) for x in (q, k, v))
    heads = slice(1, 3)
    args = [Fp8Rows(x.values[:, :, heads], x.descale) for x in (q8, k8, v8)]
    scale = head_dim**-0.5
    try:
        out = torch.zeros(2, 40, 4, head_dim, dtype=torch.bfloat16, device=device)[:, :, heads]
        got = kernel.run(*args, scale, torch.bfloat16, out=out)
    except Exception as exc:  # any failure just rules the kernel out
        return f"trial call failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    out_fp8 = kernel.name == "cudnn_fp8" and fp8_cudnn.writes_e4m3_output(q.device, torch.bfloat16)
    ref = fp8_attention_reference(*args, scale, out_fp8)
    err = ((got.float() - ref).norm() / ref.norm()).item()
    if not err < TRIAL_TOLERANCE:
        return f"trial disagrees with the reference (rel err {err:.2e})"
    return None


def resolve_fp8_kernel(device: torch.device, head_dim: int, kernel: str | None = None) -> str:
    """The kernel fp8 attention uses on ``device`` (probed on first use); an explicit one that cannot run raises."""
    device, name = torch.device(device), kernel
    if name is not None:
        _check_name(name)
    key = (str(device), head_dim, name)
    if key not in _probed:
        rejected = []
        chosen = None
        for cand in (name,) if name else FP8_KERNELS:
            spec = _KERNELS[cand]
            reason = None if cand == name == "emulated" else spec.check(device_facts(device), head_dim)
            if reason is None and cand != "emulated":
                reason = _trial(spec, device, head_dim)
            if reason is None:
                chosen = cand
                break
            rejected.append((cand, reason))
        if chosen is None:
            raise H3BackendUnavailable(
                f"fp8 attention cannot run on {device} (head_dim {head_dim}): "
                + "; ".join(f"{n}: {r}" for n, r in rejected)
                + ". Set attention_precision bf16, or install nvidia-cudnn-frontend for an sm90+ GPU"
            )
        _probed[key] = (chosen, tuple(rejected))
        log.info(
            "fp8 attention on %s d=%d uses %s (passed over: %s)",
            device,
            head_dim,
            chosen,
            "; ".join(f"{n}: {r}" for n, r in rejected) or "none",
        )
    return _probed[key][0]


def fp8_kernel_refusals(device: torch.device, head_dim: int) -> tuple[tuple[str, str], ...]:
    """Why the kernels better than the one chosen on ``device`` were passed over."""
    resolve_fp8_kernel(device, head_dim)
    return _probed[(str(torch.device(device)), head_dim, None)][1]


def fp8_attention(
    q: Fp8Rows,
    k: Fp8Rows,
    v: Fp8Rows,
    *,
    scale: float | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """Every query over every key, on e4m3 inputs (``quantize_e4m3``), written in ``out_dtype``.

    Args:
        q, k, v: ``Fp8Rows`` of ``[T, H, D]`` / ``[B, T, H, D]`` token-major e4m3 values (k and v of equal shape).
        scale: score scale. Default: ``D ** -0.5``.
        out: a preallocated output of q's shape in ``out_dtype`` to write into (it is returned).
        kernel: one of ``FP8_KERNELS``. Default: the probed choice.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Fp8Rows) or x.values.dtype != E4M3:
            raise H3InputError(f"fp8_attention: {name} must be Fp8Rows of e4m3 values (quantize_e4m3)")
    qv, kv_ = q.values, k.values
    if qv.dim() not in (3, 4) or qv.dim() != kv_.dim() or kv_.shape != v.values.shape:
        raise H3InputError(
            f"fp8_attention needs q, k, v of equal rank 3 or 4 and k.shape == v.shape; got "
            f"q {tuple(qv.shape)}, k {tuple(kv_.shape)}, v {tuple(v.values.shape)}"
        )
    if qv.shape[-2:] != kv_.shape[-2:] or qv.shape[:-3] != kv_.shape[:-3] or kv_.shape[-3] == 0:
        raise H3InputError(
            f"fp8_attention: q {tuple(qv.shape)} and k {tuple(kv_.shape)} must share batch, heads and head dim, "
            "and k needs at least one row"
        )
    head_dim = qv.shape[-1]
    scale = head_dim**-0.5 if scale is None else float(scale)
    name = resolve_fp8_kernel(qv.device, head_dim, kernel)
    batched = qv.dim() == 4
    q4, k4, v4 = (Fp8Rows(_batched(x.values), x.descale) for x in (q, k, v))
    target = None if out is None else _batched(out)
    if q4.values.shape[1] == 0:
        res = torch.empty(q4.values.shape, dtype=out_dtype, device=qv.device) if target is None else target
    else:
        res = _KERNELS[name].run(q4, k4, v4, scale, out_dtype, out=target)
    if out is not None:
        return out
    return res if batched else res[0]
