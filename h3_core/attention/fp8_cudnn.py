"""cuDNN's FP8 SDPA forward (``nvidia-cudnn-frontend``'s graph API) on token-major e4m3 views: the ``cudnn_fp8``
kernel of ``fp8``.

``run`` takes ``[B, T, H, D]`` e4m3 q, k, v (any strides, contiguous last dim), their float32 descales ([1], on the
device), the score scale, the probabilities' scale and an output of q's shape. One graph per geometry is built and
cached. The output is written where it lies, in its own dtype, where the device's engines write bf16 or fp16 from
e4m3 inputs; elsewhere (or for a float32 output) it is written in e4m3 on v's own scale (``scale_o = 1 /
descale_v``: ``|o| <= max |v|``, so it cannot saturate) into a buffer and widened after.
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass

import torch

from ._lru import BoundedLRU
from .convert import scale_convert
from .kernels import DeviceFacts, _optional_module

__all__ = ["run", "unavailable", "writes_e4m3_output"]

log = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
_UID_Q, _UID_K, _UID_V, _UID_O, _UID_AMAX_S, _UID_AMAX_O = 1, 2, 3, 4, 5, 6
_UID_SCALARS = (7, 8, 9, 10, 11, 12)  # descale q, k, v, s; scale s, o
_SCALAR_NAMES = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")


@dataclass
class _Graph:
    graph: object
    workspace: int
    out_e4m3: bool


_graphs = BoundedLRU(64)
_graph_lock = threading.Lock()
_handles = threading.local()
_wide_output: dict[tuple[str, torch.dtype], bool] = {}  # (device, dtype): the engines there write that dtype
_constants: dict[str, dict[str, torch.Tensor]] = {}


def unavailable(facts: DeviceFacts, head_dim: int) -> str | None:
    """Why the kernel cannot run on a device of ``facts`` at ``head_dim``, or None."""
    if facts.type != "cuda" or facts.rocm:
        return "needs an NVIDIA GPU"
    if facts.capability is None or facts.capability < (9, 0):
        return f"cuDNN's fp8 attention needs compute capability >= 9.0, device has {facts.capability}"
    if head_dim % 16 or head_dim > 256:
        return f"head_dim {head_dim} must be a multiple of 16 and <= 256"
    if _optional_module("cudnn") is None:
        return "'cudnn' is not importable (install nvidia-cudnn-frontend)"
    return None


def writes_e4m3_output(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the output for ``dtype`` on ``device`` (a tensor's, with its index) is written in e4m3 and widened."""
    return not _wide_output.get((str(device), dtype), dtype in (torch.bfloat16, torch.float16))


def _head_major(x: torch.Tensor) -> tuple[list[int], list[int]]:
    """cuDNN's [B, H, T, D] dims and strides of a token-major [B, T, H, D] tensor."""
    B, T, H, D = x.shape
    s = x.stride()
    return [B, H, T, D], [s[0], s[2], s[1], s[3]]


def _handle(cudnn, device: torch.device):
    """This thread's handle for ``device``, on torch's current stream."""
    handles = getattr(_handles, "by_device", None)
    if handles is None:
        handles = _handles.by_device = {}
    if device not in handles:
        with torch.cuda.device(device):
            handles[device] = cudnn.create_handle()
    cudnn.set_stream(handle=handles[device], stream=torch.cuda.current_stream(device).cuda_stream)
    return handles[device]


def _build(cudnn, handle, q, k, v, o_dims, o_strides, scale, o_type) -> object:
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(handle=handle, io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32)
    inputs = []
    for name, uid, x in (("q", _UID_Q, q), ("k", _UID_K, k), ("v", _UID_V, v)):
        dims, strides = _head_major(x)
        inputs.append(graph.tensor(name=name, dim=dims, stride=strides, data_type=e4m3, uid=uid))
    scalars = [
        graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32, uid=uid)
        for name, uid in zip(_SCALAR_NAMES, _UID_SCALARS)
    ]
    o, _, amax_s, amax_o = graph.sdpa_fp8(
        q=inputs[0],
        k=inputs[1],
        v=inputs[2],
        **dict(zip(_SCALAR_NAMES, scalars)),
        generate_stats=False,
        attn_scale=scale,
        use_causal_mask=False,
        name="h3_fp8_window",
    )
    o.set_uid(_UID_O).set_output(True).set_dim(o_dims).set_stride(o_strides).set_data_type(o_type)
    for amax, uid in ((amax_s, _UID_AMAX_S), (amax_o, _UID_AMAX_O)):
        amax.set_uid(uid).set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph


def _graph(cudnn, handle, q, k, v, out, scale) -> _Graph:
    device = str(q.device)
    wide = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}.get(out.dtype)
    o_dims, o_strides = _head_major(out)
    key = (device, out.dtype, tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), v.stride(), tuple(o_strides))
    key += (scale,)

    def build() -> _Graph:
        if wide is not None and not writes_e4m3_output(q.device, out.dtype):
            try:
                graph = _build(cudnn, handle, q, k, v, o_dims, o_strides, scale, wide)
                _wide_output[(device, out.dtype)] = True
                return _Graph(graph, graph.get_workspace_size(), False)
            except Exception as exc:  # the engines of this device write e4m3 outputs only
                log.info("cuDNN fp8 attention on %s writes e4m3 outputs (%s was refused: %s)", device, out.dtype, exc)
                _wide_output[(device, out.dtype)] = False
        B, T, H, D = q.shape  # a contiguous e4m3 buffer of q's shape, widened into ``out`` afterwards
        graph = _build(cudnn, handle, q, k, v, [B, H, T, D], [T * H * D, D, H * D, 1], scale, cudnn.data_type.FP8_E4M3)
        return _Graph(graph, graph.get_workspace_size(), True)

    with _graph_lock:
        return _graphs.get_or_build(key, build)


def _device_constants(device: torch.device, p_scale: float) -> dict[str, torch.Tensor]:
    key = f"{device}/{p_scale}"
    if key not in _constants:

        def full(value):
            return torch.full((1, 1, 1, 1), value, dtype=torch.float32, device=device)

        _constants[key] = {"one": full(1.0), "p_scale": full(p_scale), "p_descale": full(1.0 / p_scale)}
    return _constants[key]


def run(q, k, v, descales, scale: float, p_scale: float, out: torch.Tensor) -> torch.Tensor:
    """Attention of e4m3 ``q`` over ``k``, ``v`` (``descales`` = their float32 descales) written into ``out``."""
    cudnn = importlib.import_module("cudnn")
    device = q.device
    handle = _handle(cudnn, device)
    entry = _graph(cudnn, handle, q, k, v, out, scale)
    target = torch.empty(q.shape, dtype=E4M3, device=device) if entry.out_e4m3 else out
    const = _device_constants(device, p_scale)
    amax = torch.empty(2, 1, 1, 1, 1, dtype=torch.float32, device=device)
    descale_v = descales[2]
    scale_o = (1.0 / descale_v) if entry.out_e4m3 else const["one"]
    scalars = (*descales, const["p_descale"], const["p_scale"], scale_o)
    buffers = {_UID_Q: q, _UID_K: k, _UID_V: v, _UID_O: target, _UID_AMAX_S: amax[0], _UID_AMAX_O: amax[1]}
    buffers.update((uid, value.reshape(1, 1, 1, 1)) for uid, value in zip(_UID_SCALARS, scalars))
    workspace = torch.empty(max(entry.workspace, 1), dtype=torch.uint8, device=device)
    entry.graph.execute(buffers, workspace, handle=handle)
    if entry.out_e4m3:
        for b in range(out.shape[0]):
            scale_convert(target[b], out[b], descale_v)
    return out
