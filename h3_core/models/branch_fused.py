"""The linear branch's per-element work in few passes, with the features laid out head-major.

The plain branch (``linear_branch.LinearBranch`` with ``fused = None``) is the reference: it runs each step
as its own PyTorch op over the video rows (spatial conv, a layout copy, the temporal conv, another copy,
SiLU, the L2 norm; then the readout einsum, the fp32 RMSNorm and the gate), each a pass over ``[F·S, h·d]``.
Here the temporal conv, SiLU and L2 norm are one function that writes k̃ and ṽ straight into ``[F, h, S, d]``
(the layout the frame statistics read without copies); and the readout — q̃, its product with the frame's
state, the RMSNorm, the output gate and the return to token-major rows — is one function. Sums run
in fp32 (fp64 for fp64 inputs) and each result is rounded once, so the numbers are the plain path's up to
the roundings it skips.

Modes (``RunOptions.branches_fused``): ``"compiled"`` runs these functions through ``torch.compile`` (one generated
kernel each; needs Triton on CUDA), and inside ``triton_forms.plain_path`` as written (the same arithmetic, op
by op); ``None`` the plain path. The compiled functions and the Triton kernels are
``triton_forms.guarded``: one that fails to compile or launch raises ``CompileFailure``, and the model
evaluation is run again on the plain path (``run_options.Evaluations``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..triton_forms import compiles_on, compiling, guarded, runs_here, triton_form
from . import branch_math
from .branch_math import accumulation

try:  # Triton is optional: without it the plain forms run
    from . import block_triton
except ImportError:
    block_triton = None
try:  # Triton is optional: without it the plain forms run
    from . import branch_triton
except ImportError:
    branch_triton = None

__all__ = [
    "FUSED_MODES",
    "compiled_branch_available",
    "spatial_conv",
    "spatial",
    "conv_features",
    "gram_products",
    "gram_statistics",
    "shifted_gram",
    "shifted_statistics",
    "query_features",
    "readout_finish",
    "readout",
    "scan",
    "gather",
    "run",
    "call",
    "triton_kernel",
    "small_inverse",
]

FUSED_MODES = (None, "compiled")
EPS = 1e-6


def spatial_conv(x: torch.Tensor, weight: torch.Tensor, grid) -> torch.Tensor:
    """Depthwise 5×5 over each frame's grid of ``x`` ``[F, S, C]``, zero padded: ``[F, S, C]``.

    The frame grid read as ``[F, C, gh, gw]`` is a channels-last view of ``x``, which the convolution takes
    (and returns) without a layout copy."""
    frames, _, channels = x.shape
    y = F.conv2d(
        x.view(frames, grid[0], grid[1], channels).permute(0, 3, 1, 2),
        weight.to(x.dtype),
        padding=weight.shape[-1] // 2,
        groups=channels,
    )
    return y.permute(0, 2, 3, 1).reshape(frames, -1, channels)


def conv_features(
    y: torch.Tensor, taps: torch.Tensor, heads: int, normalize: bool, beta: torch.Tensor | None = None
) -> torch.Tensor:
    """SiLU(TConv(y)) per channel, L2-normalised per head when ``normalize``, times √β per row and head when
    ``beta`` ``[F, S, heads]`` is given: ``[F, heads, S, d]`` from the spatially convolved ``y``
    ``[F, S, heads·d]`` and the temporal taps ``[C, 1, n]`` (zero padded across frames, cross-correlation as
    ``conv1d``)."""
    frames, tokens, channels = y.shape
    acc = accumulation(y.dtype)
    n = taps.shape[-1]
    padded = F.pad(y.to(acc), (0, 0, 0, 0, n // 2, n // 2))
    w = taps.to(acc).view(channels, n)
    z = padded[0:frames] * w[:, 0]
    for j in range(1, n):
        z = z + padded[j : j + frames] * w[:, j]
    z = F.silu(z).view(frames, tokens, heads, channels // heads)
    if normalize:
        z = z / torch.linalg.vector_norm(z, dim=-1, keepdim=True).clamp_min(EPS)
    if beta is not None:
        z = z * beta.to(acc).sqrt()[..., None]
    return z.permute(0, 2, 1, 3).contiguous().to(y.dtype)


def gram_products(k_scaled: torch.Tensor, v_scaled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frame statistics' Gram products from features already scaled by √β (``conv_features`` with
    ``beta``), head-major ``[F, h, S, d]``: Σ_s (√β k̃)(√β k̃)ᵀ as the GEMM leaves it (symmetric up to its
    roundings) and B = Σ_s (√β ṽ)(√β k̃)ᵀ, ``[F, h, d, d]`` in fp32 (fp64 for fp64 features).

    Half-precision features go straight into the tensor cores with fp32 sums (``torch.bmm``'s ``out_dtype``,
    CUDA only), so no fp32 copy of k̃, ṽ or β·k̃ is made; elsewhere the features are widened first."""
    frames, heads, tokens, d = k_scaled.shape
    acc = accumulation(k_scaled.dtype)
    g = k_scaled.reshape(frames * heads, tokens, d)
    h = v_scaled.reshape(frames * heads, tokens, d)
    if g.is_cuda and g.dtype in (torch.bfloat16, torch.float16):
        A = torch.bmm(g.transpose(1, 2), g, out_dtype=acc)
        B = torch.bmm(h.transpose(1, 2), g, out_dtype=acc)
    else:
        g, h = g.to(acc), h.to(acc)
        A, B = g.transpose(1, 2) @ g, h.transpose(1, 2) @ g
    return A.view(frames, heads, d, d), B.view(frames, heads, d, d)


def gram_statistics(k_scaled: torch.Tensor, v_scaled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frame statistics A (symmetrised) and B from ``gram_products``. A is positive semi-definite by
    construction, so I + A stays positive definite (``branch_math.solve``)."""
    A, B = gram_products(k_scaled, v_scaled)
    return 0.5 * (A + A.transpose(-1, -2)), B


def shifted_gram(A: torch.Tensor) -> torch.Tensor:
    """I + ½(A + Aᵀ): the solve's input from a Gram product, one pass where symmetrising and adding I are
    three."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    return 0.5 * (A + A.transpose(-1, -2)) + eye


def shifted_statistics(mode: str, k_scaled: torch.Tensor, v_scaled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """I + A and B (``gram_statistics``) for ``branch_math.solve_shifted``, I + A formed by ``shifted_gram``
    as ``mode`` says (``call``)."""
    A, B = gram_products(k_scaled, v_scaled)
    return call(mode, shifted_gram, A, name="shifted_gram"), B


def query_features(q: torch.Tensor) -> torch.Tensor:
    """q̃ = L2(SiLU(q)) per head, ``[F, h, S, d]`` from raw ``[F, S, h, d]``."""
    z = F.silu(q.to(accumulation(q.dtype)))
    z = z / torch.linalg.vector_norm(z, dim=-1, keepdim=True).clamp_min(EPS)
    return z.permute(0, 2, 1, 3).contiguous().to(q.dtype)


def readout_finish(o: torch.Tensor, norm_weight: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """RMSNorm(o) · σ(gate) back in token-major rows: ``[F·S, h·d]`` from the readout ``o`` ``[F, h, S, d]``
    and the gate's pre-activations ``[F·S, h·d]``; the result has the gate's dtype."""
    frames, heads, tokens, d = o.shape
    acc = accumulation(o.dtype)
    z = o.to(acc)
    z = z * torch.rsqrt(z.square().mean(-1, keepdim=True) + EPS) * norm_weight.to(acc)
    z = z.permute(0, 2, 1, 3).reshape(frames * tokens, heads * d)
    return (z * torch.sigmoid(gate_logits.to(acc))).to(gate_logits.dtype)


def readout(
    q_raw: torch.Tensor, state: torch.Tensor, norm_weight: torch.Tensor, gate_logits: torch.Tensor
) -> torch.Tensor:
    """The branch's output rows ``[F·S, h·d]`` (the gate's dtype): RMSNorm(S_lin · q̃) · σ(gate) from raw
    ``q_raw`` ``[F, S, h, d]``, each frame's state ``[F, h, d_v, d_k]`` and the gate's pre-activations: q̃
    (``query_features``), the product as a batched GEMM in the rows' dtype, then ``readout_finish``."""
    q = query_features(q_raw)
    return readout_finish(torch.matmul(q, state.to(q.dtype).transpose(-1, -2)), norm_weight, gate_logits)


def _state_kernel(name: str, mode: str | None, states: torch.Tensor):
    """The Triton kernel ``name`` for the branch's fp32 frame states in ``"compiled"`` mode on CUDA, when the
    kernel takes their size (d a power of two of at least 16); None otherwise."""
    d = states.shape[-1]
    if mode == "compiled" and runs_here(states) and states.dtype == torch.float32 and d >= 16 and d & (d - 1) == 0:
        return triton_kernel(name, states.device)
    return None


def scan(mode: str | None, T: torch.Tensor, J: torch.Tensor, seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix and suffix states (``branch_math.scan``), run as ``mode`` says: in ``"compiled"`` mode on
    CUDA both directions as one Triton kernel; otherwise the library's per-frame batched GEMMs (also for
    ``"compiled"``: there is nothing for ``torch.compile`` to fuse)."""

    kernel = _state_kernel("scan", mode, J)
    return kernel(T, J, seed) if kernel is not None else branch_math.scan(T, J, seed)


def gather(
    mode: str | None,
    P: torch.Tensor,
    Q: torch.Tensor,
    alpha: torch.Tensor,
    bounds,
    seed: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Each query frame's state (``branch_math.gather``) rounded once to ``out_dtype`` (default: the states'),
    run as ``mode`` says: in ``"compiled"`` mode on CUDA one Triton pass; otherwise the library's form."""

    kernel = _state_kernel("gather", mode, P)
    if kernel is not None:
        return kernel(P, Q, alpha, bounds, seed, out_dtype=out_dtype)
    state = branch_math.gather(P, Q, alpha, bounds, seed)
    return state if out_dtype is None else state.to(out_dtype)


_FUNCTIONS = {
    "conv_features": conv_features,
    "query_features": query_features,
    "readout_finish": readout_finish,
    "readout": readout,
}
_compiled: dict[object, object] = {}  # each fused function's torch.compile wrapper, made on first use


def compiled_branch_available(device: torch.device | str = "cuda") -> bool:
    """Whether ``"compiled"`` can run on ``device``: CUDA with Triton importable (``triton_forms.compiles_on``)."""
    return compiles_on(device)


# Hand-written Triton forms that ``"compiled"`` runs on CUDA instead of ``torch.compile``'s (module, function):
# each does in one pass what the compiled form splits into several or writes with scattered stores.
_TRITON = {
    "conv_features": (branch_triton, "conv_features_triton"),
    "readout": (branch_triton, "readout_triton"),
    "scan": (branch_triton, "scan_triton"),
    "gather": (branch_triton, "gather_triton"),
    "qk_norm_rope": (block_triton, "qk_norm_rope_triton"),
    "norm_modulate": (block_triton, "block_norm_triton"),
    "swiglu_": (block_triton, "swiglu_triton"),
    "gated_residual_": (block_triton, "gated_residual_triton"),
    "gate_heads_": (block_triton, "gate_heads_triton"),
    "small_inverse": (branch_triton, "small_inverse_triton"),
    "shifted_gram": (branch_triton, "shifted_gram_triton"),
    "spatial_conv": (branch_triton, "spatial_conv_triton"),
}


def triton_kernel(name: str, device: torch.device):
    """The hand-written Triton form of the fused function ``name`` on ``device``; None if it has none, Triton is
    missing or the launch table does not run it there."""
    return triton_form(*_TRITON[name], device) if name in _TRITON else None


def _rows_kernel(name: str, mode: str | None, rows: torch.Tensor):
    """The Triton kernel ``name`` in ``"compiled"`` mode (outside ``triton_forms.plain_path``) for CUDA rows with a
    contiguous last dimension that are not fp64 (the kernels sum in fp32); None otherwise."""
    if mode == "compiled" and compiling() and runs_here(rows) and rows.dtype != torch.float64 and rows.stride(-1) == 1:
        return triton_kernel(name, rows.device)
    return None


def spatial(mode: str | None, x: torch.Tensor, weight: torch.Tensor, grid) -> torch.Tensor:
    """``spatial_conv`` in ``mode``: in ``"compiled"``, for rows ``_rows_kernel`` takes and 5×5 taps, the Triton
    pass (fp32 sums in its own order, one rounding); cuDNN's depthwise convolution otherwise."""
    kernel = _rows_kernel("spatial_conv", mode, x) if tuple(weight.shape[-2:]) == (5, 5) else None
    return kernel(x, weight, grid) if kernel is not None else spatial_conv(x, weight, grid)


def small_inverse(mode: str | None, device: torch.device):
    """The solve's leaf inverse (``branch_math.spd_inverse``'s ``leaf``) in ``mode``: in ``"compiled"`` the
    Triton pass over all the small blocks at once, where the library's batched inverse launches an LU
    factorisation, two triangular solves and row swaps per call; None (the library's) otherwise."""
    return triton_kernel("small_inverse", device) if mode == "compiled" else None


def call(mode: str, fn, *args, name: str | None = None):
    """``fn(*args)`` as ``mode`` says: ``"compiled"`` through ``torch.compile`` — or, for CUDA rows with a
    contiguous last dimension, through the Triton kernel registered for ``name`` (which sums in fp32, so fp64
    rows keep the compiled form's fp64 sums); otherwise as written. Inside ``triton_forms.plain_path`` nothing is
    compiled: ``"compiled"`` runs as written."""
    if mode == "compiled" and compiling():
        kernel = _rows_kernel(name, mode, args[0]) if name is not None else None
        if kernel is not None:
            return kernel(*args)
        if fn not in _compiled:
            _compiled[fn] = guarded(torch.compile(fn))
        fn = _compiled[fn]
    return fn(*args)


def run(mode: str, name: str, *args):
    """Call the branch's fused function ``name`` as ``mode`` says (``call``)."""
    return call(mode, _FUNCTIONS[name], *args, name=name)
