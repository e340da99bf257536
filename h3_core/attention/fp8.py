"""Dense attention on e4m3 inputs: the opt-in fp8 window softmax's kernels.

Quantisation is per tensor: ``quantize_e4m3(x)`` maps ``x``'s largest magnitude onto e4m3's 448 and keeps the
inverse as a float32 ``descale`` on the device (no host sync). Inside the kernel the scores are
``(q8 · k8ᵀ) · descale_q · descale_k · scale``; the probabilities ``exp(s - max)`` (in [0, 1]) are scaled by
``P_SCALE`` and rounded to e4m3 before they meet ``v8``; the row sums are taken before that rounding.

Kernels (``FP8_KERNELS``), best first:
  * ``cudnn_fp8`` — cuDNN's FP8 SDPA forward through ``nvidia-cudnn-frontend`` (Hopper and later). Where the
    device cannot write a bf16 output from it, the output is written in e4m3 on v's own scale and widened.
  * ``emulated`` — the same roundings in float32 matmuls, on any device: the reference every kernel is checked
    against, and what runs on the CPU (the fp8 kernels' rounding, none of their speed).

Shapes: token-major ``[T, H, D]`` or ``[B, T, H, D]``, any strides with a contiguous last dim.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from ..errors import H3BackendUnavailable, H3InputError
from ._lru import BoundedLRU
from .convert import scale_convert
from .kernels import DeviceFacts, _optional_module, device_facts

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
    "force_fp8_kernel",
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


@dataclass
class _CudnnGraph:
    graph: object
    workspace: int
    out_fp8: bool


_graphs = BoundedLRU(64)
_graph_lock = threading.Lock()
_handles = threading.local()
_UID_Q, _UID_K, _UID_V, _UID_O, _UID_AMAX_S, _UID_AMAX_O = 1, 2, 3, 4, 5, 6
_UID_SCALARS = (7, 8, 9, 10, 11, 12)  # descale q, k, v, s; scale s, o


def _head_major_dims(x: torch.Tensor):
    """cuDNN's [B, H, T, D] description of a token-major [B, T, H, D] tensor."""
    B, T, H, D = x.shape
    s = x.stride()
    return [B, H, T, D], [s[0], s[2], s[1], s[3]]


def _cudnn_handle(cudnn, device: torch.device):
    handles = getattr(_handles, "by_device", None)
    if handles is None:
        handles = _handles.by_device = {}
    if device not in handles:
        with torch.cuda.device(device):
            handles[device] = cudnn.create_handle()
    cudnn.set_stream(handle=handles[device], stream=torch.cuda.current_stream(device).cuda_stream)
    return handles[device]


def _build_cudnn_graph(cudnn, handle, q, k, v, o_dims, o_strides, scale, out_fp8):
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(handle=handle, io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32)
    tensors = []
    for name, uid, x in (("q", _UID_Q, q), ("k", _UID_K, k), ("v", _UID_V, v)):
        dims, strides = _head_major_dims(x)
        tensors.append(graph.tensor(name=name, dim=dims, stride=strides, data_type=e4m3, uid=uid))
    scalars = [
        graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32, uid=uid)
        for name, uid in zip(("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"), _UID_SCALARS)
    ]
    o, _, amax_s, amax_o = graph.sdpa_fp8(
        q=tensors[0],
        k=tensors[1],
        v=tensors[2],
        descale_q=scalars[0],
        descale_k=scalars[1],
        descale_v=scalars[2],
        descale_s=scalars[3],
        scale_s=scalars[4],
        scale_o=scalars[5],
        generate_stats=False,
        attn_scale=scale,
        use_causal_mask=False,
        name="h3_fp8_window",
    )
    o.set_uid(_UID_O).set_output(True).set_dim(o_dims).set_stride(o_strides)
    o.set_data_type(e4m3 if out_fp8 else cudnn.data_type.BFLOAT16)
    for amax, uid in ((amax_s, _UID_AMAX_S), (amax_o, _UID_AMAX_O)):
        amax.set_uid(uid).set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return _CudnnGraph(graph, graph.get_workspace_size(), out_fp8)


_bf16_output: dict[str, bool] = {}  # per device: whether cuDNN writes a bf16 output from e4m3 inputs there


def writes_e4m3_output(device: torch.device) -> bool:
    """Whether cuDNN's fp8 attention on ``device`` (a tensor's, with its index) writes e4m3 outputs, widened after."""
    return not _bf16_output.get(str(device), True)


def _cudnn_graph(cudnn, handle, q, k, v, out, scale) -> _CudnnGraph:
    device = str(q.device)
    o_dims, o_strides = _head_major_dims(out)
    key = (device, tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), v.stride(), tuple(o_strides), scale)

    def build():
        if _bf16_output.get(device, True):
            try:
                built = _build_cudnn_graph(cudnn, handle, q, k, v, o_dims, o_strides, scale, out_fp8=False)
                _bf16_output[device] = True
                return built
            except Exception as exc:  # the engines of this device take e4m3 outputs only
                log.info("cuDNN fp8 attention on %s writes e4m3 outputs (a bf16 output was refused: %s)", device, exc)
                _bf16_output[device] = False
        # the e4m3 output goes to a contiguous buffer of q's shape, widened into ``out`` afterwards
        B, T, H, D = q.shape
        dims, strides = [B, H, T, D], [T * H * D, D, H * D, 1]
        return _build_cudnn_graph(cudnn, handle, q, k, v, dims, strides, scale, out_fp8=True)

    with _graph_lock:
        return _graphs.get_or_build(key, build)


_constants: dict[str, dict[str, torch.Tensor]] = {}


def _device_constants(device: torch.device) -> dict[str, torch.Tensor]:
    key = str(device)
    if key not in _constants:
        full = lambda value: torch.full((1, 1, 1, 1), value, dtype=torch.float32, device=device)  # noqa: E731
        _constants[key] = {"one": full(1.0), "p_scale": full(P_SCALE), "p_descale": full(1.0 / P_SCALE)}
    return _constants[key]


def _cudnn_fp8(q, k, v, scale, out_dtype, out=None, out_fp8=False):
    cudnn = _optional_module("cudnn")
    device = q.values.device
    handle = _cudnn_handle(cudnn, device)
    if out is None:
        out = torch.empty(q.values.shape, dtype=out_dtype, device=device)
    entry = _cudnn_graph(cudnn, handle, q.values, k.values, v.values, out, scale)
    target = torch.empty(q.values.shape, dtype=E4M3, device=device) if entry.out_fp8 else out
    const = _device_constants(device)
    amax = torch.empty(2, 1, 1, 1, 1, dtype=torch.float32, device=device)
    buffers = {
        _UID_Q: q.values,
        _UID_K: k.values,
        _UID_V: v.values,
        _UID_O: target,
        _UID_AMAX_S: amax[0],
        _UID_AMAX_O: amax[1],
    }
    descales = (q.descale, k.descale, v.descale, const["p_descale"], const["p_scale"])
    # an e4m3 output is written on v's scale (scale_o = 1 / descale_v), where it cannot saturate
    scale_o = (1.0 / v.descale) if entry.out_fp8 else const["one"]
    for uid, value in zip(_UID_SCALARS, (*descales, scale_o)):
        buffers[uid] = value.reshape(1, 1, 1, 1)
    workspace = torch.empty(max(entry.workspace, 1), dtype=torch.uint8, device=device)
    entry.graph.execute(buffers, workspace, handle=handle)
    if entry.out_fp8:
        for b in range(out.shape[0]):
            scale_convert(target[b], out[b], v.descale)
    return out


def _cudnn_check(facts: DeviceFacts, head_dim: int) -> str | None:
    if facts.type != "cuda" or facts.rocm:
        return "needs an NVIDIA GPU"
    if facts.capability is None or facts.capability < (9, 0):
        return f"cuDNN's fp8 attention needs compute capability >= 9.0, device has {facts.capability}"
    if head_dim % 16 or head_dim > 256:
        return f"head_dim {head_dim} must be a multiple of 16 and <= 256"
    if _optional_module("cudnn") is None:
        return "'cudnn' is not importable (install nvidia-cudnn-frontend)"
    return None


@dataclass(frozen=True)
class _Fp8Kernel:
    name: str
    run: Callable
    check: Callable  # (facts, head_dim) -> reason it cannot run, or None


_KERNELS = {
    "cudnn_fp8": _Fp8Kernel("cudnn_fp8", _cudnn_fp8, _cudnn_check),
    # float32 matmuls over whole score rows: on a GPU only when asked for by name (tests, error tables)
    "emulated": _Fp8Kernel(
        "emulated",
        _emulated,
        lambda facts, head_dim: None if facts.type == "cpu" else "has none of the fp8 kernels' speed off the CPU",
    ),
}
_probed: dict[tuple, tuple[str, tuple]] = {}
_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("h3_forced_fp8_kernel", default=None)
# A kernel's output against the reference's on the trial: the two round the probabilities under different running
# maxima and sum in different orders, so they differ by a fraction of one e4m3 rounding.
TRIAL_TOLERANCE = 2e-2


@contextlib.contextmanager
def force_fp8_kernel(name: str):
    """Run every fp8 attention inside the block with kernel ``name`` (an error if it cannot run)."""
    _check_name(name)
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


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
    out_fp8 = kernel.name == "cudnn_fp8" and writes_e4m3_output(q.device)
    ref = fp8_attention_reference(*args, scale, out_fp8)
    err = ((got.float() - ref).norm() / ref.norm()).item()
    if not err < TRIAL_TOLERANCE:
        return f"trial disagrees with the reference (rel err {err:.2e})"
    return None


def resolve_fp8_kernel(device: torch.device, head_dim: int, kernel: str | None = None) -> str:
    """The kernel fp8 attention uses on ``device`` (probed on first use); an explicit one that cannot run raises."""
    device = torch.device(device)
    name = kernel or _forced.get()
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
    return _probed[(str(torch.device(device)), head_dim, _forced.get())][1]


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
        kernel: one of ``FP8_KERNELS``. Default: the probed choice (or ``force_fp8_kernel``'s).
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
