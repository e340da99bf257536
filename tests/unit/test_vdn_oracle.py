"""An outside oracle for the VDN-H3 linear branch ("Video DeltaNet") and the hybrid block that adds it.

The expected values come from a naive fp64 re-implementation written in this file from the re-implementation
notes (``/work/shared/reference/vdn_h3.md``: §2 the hybrid block, §3 the linear branch, §4 the window rule,
§11 the gotchas), with explicit loops over frames, tokens and heads wherever the maths is a sum or a
recurrence. Nothing of h3_core's own branch maths (its ``*_reference`` helpers, ``branch_fused``, the Triton
forms) builds an expected value: h3_core only provides the modules under test and their weights, which the
oracle reads by the parameter names the notes document.

What is compared:
  * ``h3_core.models.linear_branch.LinearBranch`` (forward and ``text_state``) on every path it has on the
    CPU: the plain ops, the statistics formed a few frames at a time, the fused functions as written
    (``"compiled"`` with compilation off, ``plain_path``), a head range, and — under Triton's CPU
    interpreter, in fp32 — the ``"compiled"`` path's hand-written kernels;
  * ``h3_core.models.dit.HybridAttention`` with a ``HybridContext`` (the softmax gate, ``out_proj``, the
    window softmax as a dense masked softmax and the branch through ``to_out_linear`` on video rows only);
  * the branch file's key names and shapes the loader expects (``h3_core.formats.vdn.branch_layouts``,
    ``BranchWeights``, ``h3_core.formats.checkpoints.describe_dit_checkpoint``) against the documented table.
"""

import contextlib
import json
import textwrap

import pytest
import torch
from fused_eager import fused_written
from safetensors.torch import save_file

from h3_core.attention.layout import SequenceLayout, WindowSpec
from h3_core.errors import H3InputError
from h3_core.formats.checkpoints import describe_dit_checkpoint
from h3_core.formats.keymap import load_into
from h3_core.formats.vdn import BranchWeights, branch_layouts
from h3_core.models.dit import DiTConfig, HybridAttention
from h3_core.models.hybrid import HybridContext
from h3_core.models.linear_branch import LinearBranch
from h3_core.models.run_options import PLAIN, RunOptions

DT = torch.float64
EPS = 1e-6  # the L2 normalisation's and the readout RMSNorm's epsilon (§2 table, §3)
TEXT_STATE_SCALE = 0.5  # both scans start from 0.5 · S_text (§3, §11.5)
TOL = 1e-13  # fp64 paths: max |got − want| against max |want|


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Run this module's tiny tensor ops on one intra-op thread (restored afterwards): on a shared, busy
    machine a second thread only adds waiting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------------------------
# The oracle: §3 written out, one frame / token / head at a time, in fp64.
# ----------------------------------------------------------------------------------------------------------------


def silu(z):
    return z * torch.sigmoid(z)


def l2(z):
    """z divided by its Euclidean norm (the norm floored at EPS)."""
    return z / max(float(torch.sqrt((z * z).sum())), EPS)


def softplus(z):
    return torch.log(1 + torch.exp(z))


def spatial_conv(x, weight, gh, gw):
    """Depthwise 5×5 over each frame's gh×gw token grid (tokens row-major), zero padded by 2, applied as
    ``nn.Conv2d`` applies a ``[C, 1, 5, 5]`` weight: out[i, j] = Σ_ab w[a, b] · x[i + a − 2, j + b − 2]."""
    frames, _, channels = x.shape
    n = weight.shape[-1]
    r = n // 2
    out = torch.zeros_like(x)
    for f in range(frames):
        for i in range(gh):
            for j in range(gw):
                acc = torch.zeros(channels, dtype=x.dtype)
                for a in range(n):
                    for b in range(n):
                        ii, jj = i + a - r, j + b - r
                        if 0 <= ii < gh and 0 <= jj < gw:
                            acc = acc + weight[:, 0, a, b] * x[f, ii * gw + jj]
                out[f, i * gw + j] = acc
    return out


def temporal_conv(x, weight):
    """Depthwise 5 taps across frames, zero padded, non-causal, as ``nn.Conv1d`` applies a ``[C, 1, 5]`` weight:
    out[f] = Σ_j w[j] · x[f + j − 2]."""
    frames = x.shape[0]
    n = weight.shape[-1]
    r = n // 2
    out = torch.zeros_like(x)
    for f in range(frames):
        for j in range(n):
            g = f + j - r
            if 0 <= g < frames:
                out[f] = out[f] + weight[:, 0, j] * x[g]
    return out


def delta_update(state, alpha, A, B):
    """The ``vdn_solve`` step S_f = (S_{f−1} · diag(α_f) + B_f)(I + A_f)⁻¹, solved from the right."""
    d = A.shape[-1]
    rhs = state @ torch.diag(alpha) + B
    return torch.linalg.solve(torch.eye(d, dtype=A.dtype) + A, rhs, left=False)


def frame_sums(k_feats, v_feats, betas):
    """A = Σ_s β_s k̃_s k̃_sᵀ (then symmetrised) and B = Σ_s β_s ṽ_s k̃_sᵀ over a list of tokens."""
    d = k_feats[0].shape[0]
    A = torch.zeros(d, d, dtype=DT)
    B = torch.zeros(d, d, dtype=DT)
    for k, v, b in zip(k_feats, v_feats, betas):
        A = A + b * torch.outer(k, k)
        B = B + b * torch.outer(v, k)
    return 0.5 * (A + A.T), B


def oracle_text_state(w, text_x, k_raw, v_raw):
    """0.5 · B_txt (I + A_txt)⁻¹ per head over all text rows: SiLU/L2 features without convs, α = 1."""
    rows, heads, d = k_raw.shape
    seed = torch.zeros(heads, d, d, dtype=DT)
    for h in range(heads):
        ks = [l2(silu(k_raw[r, h])) for r in range(rows)]
        vs = [silu(v_raw[r, h]) for r in range(rows)]
        bs = [torch.sigmoid(w["beta_proj.weight"][h] @ text_x[r]) for r in range(rows)]
        A, B = frame_sums(ks, vs, bs)
        seed[h] = TEXT_STATE_SCALE * delta_update(torch.zeros(d, d, dtype=DT), torch.ones(d, dtype=DT), A, B)
    return seed


def oracle_states(w, x, k_raw, v_raw, grid, frames):
    """Per frame and head: α ``[F, H, d]``, A and B ``[F, H, d, d]``, and the token features."""
    gh, gw = grid
    S = gh * gw
    heads, d = k_raw.shape[1], k_raw.shape[2]
    k_conv = temporal_conv(
        spatial_conv(k_raw.reshape(frames, S, heads * d), w["short_conv.k_sp.weight"], gh, gw),
        w["short_conv.k_tm.weight"],
    )
    v_conv = temporal_conv(
        spatial_conv(v_raw.reshape(frames, S, heads * d), w["short_conv.v_sp.weight"], gh, gw),
        w["short_conv.v_tm.weight"],
    )
    k_t = torch.zeros(frames, S, heads, d, dtype=DT)
    v_t = torch.zeros(frames, S, heads, d, dtype=DT)
    beta = torch.zeros(frames, S, heads, dtype=DT)
    for f in range(frames):
        for s in range(S):
            for h in range(heads):
                k_t[f, s, h] = l2(silu(k_conv[f, s, h * d : (h + 1) * d]))
                v_t[f, s, h] = silu(v_conv[f, s, h * d : (h + 1) * d])
                beta[f, s, h] = torch.sigmoid(w["beta_proj.weight"][h] @ x[f * S + s])
    A = torch.zeros(frames, heads, d, d, dtype=DT)
    B = torch.zeros(frames, heads, d, d, dtype=DT)
    alpha = torch.zeros(frames, heads, d, dtype=DT)
    for f in range(frames):
        mean = x[f * S : (f + 1) * S].sum(0) / S
        delta = w["alpha.up.weight"] @ (w["alpha.down.weight"] @ mean) + w["alpha.dt_bias"]
        for h in range(heads):
            A[f, h], B[f, h] = frame_sums(
                [k_t[f, s, h] for s in range(S)], [v_t[f, s, h] for s in range(S)], [beta[f, s, h] for s in range(S)]
            )
            alpha[f, h] = torch.exp(-torch.exp(w["alpha.A_log"][h]) * softplus(delta[h * d : (h + 1) * d]))
    return alpha, A, B, k_t, v_t, beta


def oracle_linear_branch(w, x, q_raw, k_raw, v_raw, grid, bounds, seed=None):
    """The branch readout ``[F·S, H·d]`` (before ``to_out_linear``) for video rows ``x`` and raw q, k, v
    ``[F·S, H, d]``; ``bounds`` are each frame's inclusive, unclamped window; ``seed`` the scans' start state
    ``[H, d, d]`` (zero when None)."""
    frames = len(bounds)
    gh, gw = grid
    S = gh * gw
    heads, d = q_raw.shape[1], q_raw.shape[2]
    alpha, A, B, _, _, _ = oracle_states(w, x, k_raw, v_raw, grid, frames)
    if seed is None:
        seed = torch.zeros(heads, d, d, dtype=DT)
    P = torch.zeros(frames, heads, d, d, dtype=DT)  # P[t]: state after frames 0..t
    Q = torch.zeros(frames, heads, d, d, dtype=DT)  # Q[t]: state after frames F−1 down to t
    for h in range(heads):
        state = seed[h]
        for f in range(frames):
            state = delta_update(state, alpha[f, h], A[f, h], B[f, h])
            P[f, h] = state
        state = seed[h]
        for f in reversed(range(frames)):
            state = delta_update(state, alpha[f, h], A[f, h], B[f, h])
            Q[f, h] = state
    out = torch.zeros(frames * S, heads * d, dtype=DT)
    for t, (lo, hi) in enumerate(bounds):
        for h in range(heads):
            before = P[lo - 1, h] if lo - 1 >= 0 else seed[h]
            after = Q[hi + 1, h] if hi + 1 <= frames - 1 else seed[h]
            bridge_before = torch.ones(d, dtype=DT)
            for u in range(max(lo, 0), t + 1):
                bridge_before = bridge_before * alpha[u, h]
            bridge_after = torch.ones(d, dtype=DT)
            for u in range(t, min(hi, frames - 1) + 1):
                bridge_after = bridge_after * alpha[u, h]
            S_lin = before @ torch.diag(bridge_before) + after @ torch.diag(bridge_after)  # on the d_k axis
            for s in range(S):
                row = t * S + s
                o = S_lin @ l2(silu(q_raw[row, h]))
                o = o / torch.sqrt((o * o).sum() / d + EPS) * w["norm.weight"]
                logits = w["output_gate.up.weight"][h * d : (h + 1) * d] @ (w["output_gate.down.weight"] @ x[row])
                gate = torch.sigmoid(logits + w["output_gate.up.bias"][h * d : (h + 1) * d])
                out[row, h * d : (h + 1) * d] = o * gate
    return out


def oracle_window_bounds(frames, radius, chunk):
    """§4: chunk 0 → [t − r, t + r]; chunk K → [(c − r)·K, (c + r + 1)·K − 1] with c = ⌊t / K⌋; unclamped."""
    if chunk == 0:
        return [(t - radius, t + radius) for t in range(frames)]
    return [((t // chunk - radius) * chunk, (t // chunk + radius + 1) * chunk - 1) for t in range(frames)]


def oracle_keep(T, video_start, frames, S, bounds, anchors):
    """§4's mask: a pair is dropped only when both rows are video rows and the key's frame lies outside the
    query frame's window; anchor columns add frames 0 and F−1 as keys, anchor rows let them query all."""
    keep = torch.ones(T, T, dtype=torch.bool)
    ends = {0, frames - 1}
    for i in range(video_start, T):
        t = (i - video_start) // S
        lo, hi = bounds[t]
        for j in range(video_start, T):
            u = (j - video_start) // S
            inside = lo <= u <= hi
            column = anchors in ("columns", "both") and u in ends
            row = anchors in ("rows", "both") and t in ends
            keep[i, j] = inside or column or row
    return keep


def rms_norm(z, weight, eps):
    return z / torch.sqrt((z * z).mean(-1, keepdim=True) + eps) * weight


def rotate_half(z, cos, sin):
    """Rotate-half RoPE on the first ``cos.shape[-1]`` channels of z ``[T, H, d]``, the rest passed through."""
    n = cos.shape[-1]
    half = n // 2
    rot = z[..., :n]
    turned = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos[:, None] + turned * sin[:, None], z[..., n:]], dim=-1)


def oracle_hybrid(w, x, cos, sin, *, heads, d, text, audio, frames, grid, window):
    """§2's output: out_proj(σ(W_sg x + b) ⊙ WindowSoftmax) + 1_video · to_out_linear(LinearBranch(...)),
    the softmax as a dense masked softmax over normed, rotated q, k; the branch on raw q, k, v."""
    radius, chunk, anchors = window
    gh, gw = grid
    S = gh * gw
    video_start = text + audio
    T = x.shape[0]
    inner = heads * d
    qkv = w["qkv_proj.weight"]
    q_raw = (x @ qkv[:inner].T).view(T, heads, d)
    k_raw = (x @ qkv[inner : 2 * inner].T).view(T, heads, d)
    v = (x @ qkv[2 * inner :].T).view(T, heads, d)
    q = rotate_half(rms_norm(q_raw, w["q_norm.weight"], w["q_norm.eps"]), cos, sin)
    k = rotate_half(rms_norm(k_raw, w["k_norm.weight"], w["k_norm.eps"]), cos, sin)
    bounds = oracle_window_bounds(frames, radius, chunk)
    keep = oracle_keep(T, video_start, frames, S, bounds, anchors)
    soft = torch.zeros(T, heads, d, dtype=DT)
    for h in range(heads):
        scores = (q[:, h] @ k[:, h].T) * d**-0.5
        scores = scores.masked_fill(~keep, float("-inf"))
        p = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
        soft[:, h] = (p / p.sum(dim=1, keepdim=True)) @ v[:, h]
    gate = torch.sigmoid(x @ w["softmax_gate.up.weight"].T + w["softmax_gate.up.bias"])  # [T, H]
    out = (soft * gate[..., None]).reshape(T, inner) @ w["out_proj.weight"].T
    full_cover = all(lo <= 0 and hi >= frames - 1 for lo, hi in bounds)
    if anchors == "both":  # frames 0 and F−1 leave the branch; bounds rebased onto frames 1..F−2
        first, branch_bounds = 1, [(lo - 1, hi - 1) for lo, hi in bounds[1 : frames - 1]]
    else:
        first, branch_bounds = 0, list(bounds)
    if not full_cover and branch_bounds:
        lin = {k.removeprefix("linear_attention."): t for k, t in w.items() if k.startswith("linear_attention.")}
        seed = oracle_text_state(lin, x[:text], k_raw[:text], v[:text]) if text else None
        r0 = video_start + first * S
        r1 = r0 + len(branch_bounds) * S
        readout = oracle_linear_branch(lin, x[r0:r1], q_raw[r0:r1], k_raw[r0:r1], v[r0:r1], grid, branch_bounds, seed)
        out[r0:r1] = out[r0:r1] + readout @ w["to_out_linear.weight"].T
    return out


# ----------------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------------

HIDDEN, GRID, TEXT = 20, (3, 4), 5


def randomize(module, seed):
    """Every parameter drawn from N(0, 0.3²), the decay's A_log around −1 so that α stays well inside (0, 1)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.normal_(0, 0.3)
            if name.endswith("A_log"):
                p.add_(-1.0)
    return module


def weights(module):
    """The module's parameters by name, as fp64 plain tensors."""
    return {name: t.detach().to(DT).clone() for name, t in module.state_dict().items()}


def branch_case(heads, d, frames, dtype=DT, seed=0):
    """A random ``LinearBranch`` and random video rows, raw q, k, v and text rows, all in ``dtype``."""
    branch = randomize(LinearBranch(HIDDEN, heads, d, bottleneck=6), seed).to(dtype)
    S = GRID[0] * GRID[1]
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(frames * S, HIDDEN, generator=g, dtype=DT)
    q, k, v = (torch.randn(frames * S, heads, d, generator=g, dtype=DT) for _ in range(3))
    text_x = torch.randn(TEXT, HIDDEN, generator=g, dtype=DT)
    text_k, text_v = (torch.randn(TEXT, heads, d, generator=g, dtype=DT) for _ in range(2))
    inputs = [t.to(dtype) for t in (x, q, k, v, text_x, text_k, text_v)]
    return branch, inputs


def relative_error(got, want):
    return float((got.to(DT) - want).abs().max() / want.abs().max())


# ----------------------------------------------------------------------------------------------------------------
# The linear branch
# ----------------------------------------------------------------------------------------------------------------


def test_oracle_update_is_the_implicit_delta_rule():
    """The oracle's solved state satisfies S_f = S_{f−1}·diag(α_f) + Σ_s β_s (ṽ_s − S_f k̃_s) k̃_sᵀ, token by token
    (§3's reading of ``vdn_solve``), and the solve is from the right (an orientation check of the oracle)."""
    torch.manual_seed(0)
    branch, (x, _, k, v, *_) = branch_case(heads=2, d=6, frames=3)
    alpha, A, B, k_t, v_t, beta = oracle_states(weights(branch), x, k, v, GRID, 3)
    prev = torch.randn(6, 6, dtype=DT)
    for f in range(3):
        for h in range(2):
            new = delta_update(prev, alpha[f, h], A[f, h], B[f, h])
            implicit = prev @ torch.diag(alpha[f, h])
            for s in range(GRID[0] * GRID[1]):
                implicit = implicit + beta[f, s, h] * torch.outer(v_t[f, s, h] - new @ k_t[f, s, h], k_t[f, s, h])
            assert (implicit - new).abs().max() <= 1e-12 * new.abs().max()
            assert (
                new - (prev @ torch.diag(alpha[f, h]) + B[f, h]) @ torch.linalg.inv(torch.eye(6, dtype=DT) + A[f, h])
            ).abs().max() <= 1e-12 * new.abs().max()


BOUNDS = {
    "per-frame r1": oracle_window_bounds(7, 1, 0),
    "chunk 2 r1": oracle_window_bounds(7, 1, 2),  # shared windows, lo < 0 and hi ≥ F unclamped
    "own frame only": oracle_window_bounds(7, 0, 0),
    "rebased chunk 3": [(lo - 1, hi - 1) for lo, hi in oracle_window_bounds(9, 0, 3)[1:8]],
}


@pytest.mark.parametrize("d", [8, 40])  # 40: the inverse by halves recurses twice (blocks of 16 at most)
@pytest.mark.parametrize("bounds", list(BOUNDS), ids=list(BOUNDS))
def test_plain_branch_matches_the_oracle_with_the_text_seed(bounds, d):
    """``LinearBranch.forward`` (plain ops, fp64) seeded by ``LinearBranch.text_state`` equals the oracle run
    end to end (text state, features, statistics, decay, solve, both scans, bridged gather, readout)."""
    torch.manual_seed(0)
    bounds = BOUNDS[bounds]
    heads, frames = 3, len(bounds)
    branch, (x, q, k, v, text_x, text_k, text_v) = branch_case(heads, d, frames)
    w = weights(branch)
    seed_want = oracle_text_state(w, text_x, text_k, text_v)
    want = oracle_linear_branch(w, x, q, k, v, GRID, bounds, seed_want)
    with torch.no_grad():
        seed = branch.text_state(text_x, text_k, text_v)
        got = branch(x, q, k, v, GRID, bounds, seed)
    assert got.shape == (frames * GRID[0] * GRID[1], heads * d) and got.dtype == DT
    assert relative_error(seed, seed_want) <= TOL
    assert relative_error(got, want) <= TOL


def test_branch_without_a_text_state_starts_from_zero():
    """Without a seed the scans start from zero and missing boundary states are zero (§3)."""
    torch.manual_seed(0)
    bounds = BOUNDS["chunk 2 r1"]
    branch, (x, q, k, v, *_) = branch_case(3, 8, len(bounds))
    want = oracle_linear_branch(weights(branch), x, q, k, v, GRID, bounds, None)
    with torch.no_grad():
        got = branch(x, q, k, v, GRID, bounds)
    assert relative_error(got, want) <= TOL


@contextlib.contextmanager
def _mode(mode):
    """The ``RunOptions`` of one of the branch's CPU paths, yielded within the context it runs in."""
    if mode == "fused, as written":
        with fused_written(blocks=False) as run:
            yield run
        return
    with torch.no_grad():
        yield RunOptions(branch_frames=2) if mode == "statistics in chunks of 2 frames" else PLAIN


MODES = ["plain", "statistics in chunks of 2 frames", "fused, as written"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("heads", [None, slice(1, 3)], ids=["all heads", "heads 1-2"])
def test_every_cpu_path_of_the_branch_matches_the_oracle(mode, heads):
    """The plain path, the statistics in chunks of frames and the fused functions as written (``"compiled"``
    with compilation off), on all heads and on a head range (the low-memory head groups), in fp64, against the
    oracle's columns of those heads."""
    torch.manual_seed(0)
    bounds = BOUNDS["chunk 2 r1"]
    d = 8
    branch, (x, q, k, v, text_x, text_k, text_v) = branch_case(4, d, len(bounds), seed=3)
    w = weights(branch)
    want = oracle_linear_branch(w, x, q, k, v, GRID, bounds, oracle_text_state(w, text_x, text_k, text_v))
    cols = slice(0, 4 * d) if heads is None else slice(heads.start * d, heads.stop * d)
    part = slice(None) if heads is None else heads
    with _mode(mode) as run, torch.no_grad():
        seed = branch.text_state(text_x, text_k[:, part], text_v[:, part], heads, run=run)
        qkv = (t[:, part].contiguous() for t in (q, k, v))
        got = branch(x, *qkv, GRID, bounds, seed, heads, run=run)
    assert relative_error(got, want[:, cols]) <= TOL


INTERPRETED = textwrap.dedent(
    """
    import torch
    torch.compile = lambda fn, **kwargs: fn  # the functions without a Triton form run as written
    from h3_core.models import branch_fused
    from h3_core.models.linear_branch import LinearBranch
    from h3_core.models.options import RunOptions

    used = set()
    kernel_for = branch_fused.triton_kernel
    def recorded(name, device):
        kernel = kernel_for(name, device)
        if kernel is not None:
            used.add(name)
        return kernel
    branch_fused.triton_kernel = recorded
    case = torch.load({path!r})
    heads, d = case["heads"], case["d"]
    branch = LinearBranch(case["hidden"], heads, d, bottleneck=6)
    branch.load_state_dict(case["state"])
    run = RunOptions(branches_fused="compiled")
    x, q, k, v, text_x, text_k, text_v = case["inputs"]
    with torch.no_grad():
        seed = branch.text_state(text_x, text_k, text_v, run=run)
        out = branch(x, q, k, v, tuple(case["grid"]), case["bounds"], seed, run=run)
    torch.save({{"out": out, "seed": seed, "used": sorted(used)}}, {out!r})
    print("OK")
    """
)


def test_compiled_branch_kernels_under_the_triton_interpreter_match_the_oracle(tmp_path):
    """The ``"compiled"`` path with its hand-written Triton kernels (features, small inverse, scans, gather,
    readout), run by Triton's CPU interpreter in fp32, against the fp64 oracle on the same fp32 inputs and
    weights, to 1e-5 of the output's scale (fp32 sums and solves of systems whose eigenvalues are ≥ 1)."""
    from triton_interpreter import run_interpreted

    torch.manual_seed(0)
    heads, d = 2, 16  # the state kernels take d a power of two of at least 16
    bounds = oracle_window_bounds(5, 1, 0)
    branch, inputs = branch_case(heads, d, len(bounds), dtype=torch.float32, seed=5)
    case = tmp_path / "case.pt"
    result = tmp_path / "out.pt"
    torch.save(
        {
            "heads": heads,
            "d": d,
            "hidden": HIDDEN,
            "grid": list(GRID),
            "bounds": bounds,
            "state": branch.state_dict(),
            "inputs": inputs,
        },
        case,
    )
    assert run_interpreted(INTERPRETED.format(path=str(case), out=str(result))).split()[-1] == "OK"
    got = torch.load(result)
    kernels = {"conv_features", "spatial_conv", "small_inverse", "scan", "gather", "readout", "shifted_gram"}
    assert set(got["used"]) == kernels
    w = weights(branch)
    x, q, k, v, text_x, text_k, text_v = (t.to(DT) for t in inputs)
    seed_want = oracle_text_state(w, text_x, text_k, text_v)
    want = oracle_linear_branch(w, x, q, k, v, GRID, bounds, seed_want)
    assert got["out"].dtype == torch.float32
    assert relative_error(got["seed"], seed_want) <= 1e-5
    assert relative_error(got["out"], want) <= 1e-5


# ----------------------------------------------------------------------------------------------------------------
# The hybrid block
# ----------------------------------------------------------------------------------------------------------------

HEADS, HEAD_DIM, AUDIO, ROTARY = 3, 8, 3, 6


def hybrid_case(frames, seed=0):
    cfg = DiTConfig(hidden=HIDDEN, layers=1, heads=HEADS, head_dim=HEAD_DIM, hybrid=True)
    attn = randomize(HybridAttention(cfg), seed).to(DT).eval()
    layout = SequenceLayout.packed(frames=frames, frame_h=GRID[0], frame_w=GRID[1], text=TEXT, audio=AUDIO)
    g = torch.Generator().manual_seed(seed + 1)
    T = layout.seq_len
    x = torch.randn(T, HIDDEN, generator=g, dtype=DT)
    angles = torch.randn(T, ROTARY // 2, generator=g, dtype=DT) * 3
    angles = torch.cat([angles, angles], dim=-1)  # the rotate-half pairs i and i + n/2 share an angle
    return attn, layout, x, angles.cos(), angles.sin()


HYBRID_CASES = {
    "release rule c2 r1 anchors both": (8, (1, 2, "both")),
    "per-frame r1 no anchors": (6, (1, 0, "none")),
    "per-frame r1 anchor columns": (6, (1, 0, "columns")),
    "per-frame r1 anchor rows": (6, (1, 0, "rows")),
    "full cover: dense, no branch": (4, (1, 5, "both")),
}


@pytest.mark.parametrize("case", list(HYBRID_CASES), ids=list(HYBRID_CASES))
def test_hybrid_block_matches_the_oracle(case):
    """``HybridAttention`` with a ``HybridContext`` (text rows 0..L) on the ``ref`` window backend equals the
    oracle: gated dense masked softmax through ``out_proj`` plus the branch through ``to_out_linear`` on the
    branch's video rows only."""
    frames, window = HYBRID_CASES[case]
    attn, layout, x, cos, sin = hybrid_case(frames)
    w = weights(attn)
    w["q_norm.eps"], w["k_norm.eps"] = attn.q_norm.eps, attn.k_norm.eps
    assert attn.out_proj.bias is None  # the oracle's out_proj has no bias
    want = oracle_hybrid(
        w, x, cos, sin, heads=HEADS, d=HEAD_DIM, text=TEXT, audio=AUDIO, frames=frames, grid=GRID, window=window
    )
    with torch.no_grad():
        got = attn(x, (cos, sin), HybridContext(layout, WindowSpec(*window), "ref", (0, TEXT)))
    assert relative_error(got, want) <= TOL


@pytest.mark.parametrize("backend", ["ref", "decomposed"])
@pytest.mark.parametrize("setup", ["plain", "two head groups", "fused, as written"])
def test_hybrid_block_paths_match_the_oracle(setup, backend):
    """The release-like window (chunk 2, radius 1, anchors both) through the other CPU paths of the block:
    the decomposed window backend, heads run in two groups (``head_groups``), and the block and branch fused
    functions as written (``"compiled"`` with compilation off)."""
    frames, window = HYBRID_CASES["release rule c2 r1 anchors both"]
    attn, layout, x, cos, sin = hybrid_case(frames, seed=7)
    w = weights(attn)
    w["q_norm.eps"], w["k_norm.eps"] = attn.q_norm.eps, attn.k_norm.eps
    want = oracle_hybrid(
        w, x, cos, sin, heads=HEADS, d=HEAD_DIM, text=TEXT, audio=AUDIO, frames=frames, grid=GRID, window=window
    )
    if setup == "fused, as written":
        path = fused_written()
    else:
        path = contextlib.nullcontext(RunOptions(head_groups=2) if setup == "two head groups" else PLAIN)
    with path as run, torch.no_grad():
        got = attn(x, (cos, sin), HybridContext(layout, WindowSpec(*window), backend, (0, TEXT)), run=run)
    assert relative_error(got, want) <= TOL


def test_window_rule_is_the_documented_one():
    """The window bounds the block uses (``h3_core.attention.layout.window_bounds``) are §4's formula, and the
    released c1 window at 102 frames gives chunk 0 frames 0–9 and chunk 20 frames 95–101 once clamped."""
    from h3_core.attention.layout import window_bounds

    for frames, radius, chunk in ((102, 1, 5), (8, 1, 2), (6, 1, 0), (9, 2, 3), (5, 0, 0)):
        assert list(window_bounds(frames, radius, chunk)) == oracle_window_bounds(frames, radius, chunk)
    bounds = oracle_window_bounds(102, 1, 5)
    assert (max(bounds[0][0], 0), min(bounds[0][1], 101)) == (0, 9)
    assert (max(bounds[100][0], 0), min(bounds[100][1], 101)) == (95, 101)


# ----------------------------------------------------------------------------------------------------------------
# The branch file's keys
# ----------------------------------------------------------------------------------------------------------------

# §2 "Added weights per block" (prefix transformer_blocks.{i}.attn.), at the released sizes: D = 5376, 56 heads of
# 128 (7168 channels), bottleneck 128, 50 blocks.
DOCUMENTED = {
    "softmax_gate.up.weight": (56, 5376),
    "softmax_gate.up.bias": (56,),
    "to_out_linear.weight": (5376, 7168),
    "linear_attention.beta_proj.weight": (56, 5376),
    "linear_attention.alpha.down.weight": (128, 5376),
    "linear_attention.alpha.up.weight": (7168, 128),
    "linear_attention.alpha.A_log": (56,),
    "linear_attention.alpha.dt_bias": (7168,),
    "linear_attention.output_gate.down.weight": (128, 5376),
    "linear_attention.output_gate.up.weight": (7168, 128),
    "linear_attention.output_gate.up.bias": (7168,),
    "linear_attention.norm.weight": (128,),
    "linear_attention.short_conv.k_sp.weight": (7168, 1, 5, 5),
    "linear_attention.short_conv.v_sp.weight": (7168, 1, 5, 5),
    "linear_attention.short_conv.k_tm.weight": (7168, 1, 5),
    "linear_attention.short_conv.v_tm.weight": (7168, 1, 5),
}
BLOCKS = 50
# Pre-v2 aliases (checkpoints/key_mapping.py as §2 gives them): old → new, the first that applies.
ALIASES = (
    (".attn.far.gate.", ".attn.linear_attention.output_gate."),
    (".attn.far.", ".attn.linear_attention."),
    (".attn.local_gate.", ".attn.softmax_gate."),
    (".attn.w_o_far.", ".attn.to_out_linear."),
)


def documented_keys(blocks=BLOCKS):
    return {f"transformer_blocks.{i}.attn.{name}": shape for i in range(blocks) for name, shape in DOCUMENTED.items()}


def pre_v2(key):
    """The pre-v2 name of a v2 key: the alias whose new form the key holds, the more specific one first."""
    for old, new in ALIASES:
        if new in key:
            return key.replace(new, old)
    raise AssertionError(key)


def v2(key):
    for old, new in ALIASES:
        if old in key:
            return key.replace(old, new)
    return key


def test_documented_aliases_round_trip():
    """The documented alias table maps the pre-v2 names back to the v2 names one to one."""
    keys = documented_keys()
    old = {pre_v2(k) for k in keys}
    assert len(old) == len(keys) and not old & set(keys)
    assert {v2(k) for k in old} == set(keys)


def test_branch_weights_have_the_documented_names_and_shapes():
    """``BranchWeights`` at the released sizes holds exactly the documented keys and shapes, ≈42.8 M parameters a
    block; the v2 key map reads each under its own name and the pre-v2 map under its documented alias."""
    with torch.device("meta"):
        module = BranchWeights(DiTConfig())
    shapes = {k: tuple(t.shape) for k, t in module.state_dict().items()}
    assert shapes == documented_keys()
    per_block = sum(torch.Size(s).numel() for s in DOCUMENTED.values())
    assert round(per_block / 1e6, 1) == 42.8
    current, old = branch_layouts()
    assert {current.sources_for(k) for k in shapes} == {((k,), None) for k in documented_keys()}
    assert {old.sources_for(k)[0] for k in shapes} == {(pre_v2(k),) for k in documented_keys()}


def _sparse_safetensors(path, shapes, metadata=None):
    """A safetensors file whose header lists ``shapes`` as bf16 tensors and whose data is a hole of the right
    size (the header is all a description reads)."""
    header, offset = {}, 0
    for key, shape in shapes.items():
        size = 2 * torch.Size(shape).numel()
        header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        fh.truncate(8 + len(raw) + offset)


@pytest.mark.parametrize("naming", ["v2", "pre-v2"])
def test_a_released_size_branch_file_with_documented_names_is_recognised(tmp_path, naming):
    """``describe_dit_checkpoint`` on ``linear_branch/model.safetensors`` whose header holds the documented 50 × 16
    keys and shapes (or their pre-v2 aliases) says it is a branch file in the matching layout; one key renamed
    outside the documented set is refused."""
    keys = documented_keys()
    if naming == "pre-v2":
        keys = {pre_v2(k): s for k, s in keys.items()}
    folder = tmp_path / "linear_branch"
    folder.mkdir()
    _sparse_safetensors(folder / "model.safetensors", keys)
    info = describe_dit_checkpoint(folder / "model.safetensors")
    assert info.is_branch and info.layout == {"v2": "VDN-H3 v2", "pre-v2": "VDN-H3 pre-v2"}[naming]
    renamed = dict(keys)
    renamed["transformer_blocks.3.attn.linear_attention.alpha.a_log"] = renamed.pop(
        next(k for k in keys if k.startswith("transformer_blocks.3.") and k.endswith("A_log"))
    )
    _sparse_safetensors(tmp_path / "renamed.safetensors", renamed)
    with pytest.raises(H3InputError, match="a_log"):
        describe_dit_checkpoint(tmp_path / "renamed.safetensors")


@pytest.mark.parametrize("naming", ["v2", "pre-v2"])
def test_branch_file_values_land_under_the_documented_names(tmp_path, naming):
    """A small branch file written under the documented names (or their aliases) loads through the branch key
    maps into ``BranchWeights`` with every tensor at the v2 name the notes give it."""
    torch.manual_seed(0)
    cfg = DiTConfig(hidden=HIDDEN, layers=2, heads=HEADS, head_dim=HEAD_DIM)
    inner, bottleneck = HEADS * HEAD_DIM, 128
    small = {
        "softmax_gate.up.weight": (HEADS, HIDDEN),
        "softmax_gate.up.bias": (HEADS,),
        "to_out_linear.weight": (HIDDEN, inner),
        "linear_attention.beta_proj.weight": (HEADS, HIDDEN),
        "linear_attention.alpha.down.weight": (bottleneck, HIDDEN),
        "linear_attention.alpha.up.weight": (inner, bottleneck),
        "linear_attention.alpha.A_log": (HEADS,),
        "linear_attention.alpha.dt_bias": (inner,),
        "linear_attention.output_gate.down.weight": (bottleneck, HIDDEN),
        "linear_attention.output_gate.up.weight": (inner, bottleneck),
        "linear_attention.output_gate.up.bias": (inner,),
        "linear_attention.norm.weight": (HEAD_DIM,),
        "linear_attention.short_conv.k_sp.weight": (inner, 1, 5, 5),
        "linear_attention.short_conv.v_sp.weight": (inner, 1, 5, 5),
        "linear_attention.short_conv.k_tm.weight": (inner, 1, 5),
        "linear_attention.short_conv.v_tm.weight": (inner, 1, 5),
    }
    assert set(small) == set(DOCUMENTED)
    tensors = {f"transformer_blocks.{i}.attn.{n}": torch.randn(s) for i in range(2) for n, s in small.items()}
    stored = tensors if naming == "v2" else {pre_v2(k): t for k, t in tensors.items()}
    save_file(stored, tmp_path / "model.safetensors")
    with torch.device("meta"):
        module = BranchWeights(cfg)
    layout = load_into(
        module, tmp_path / "model.safetensors", branch_layouts(), what="VDN-H3 linear branch", dtype=torch.float32
    )
    assert layout == {"v2": "VDN-H3 v2", "pre-v2": "VDN-H3 pre-v2"}[naming]
    state = module.state_dict()
    assert set(state) == set(tensors)
    for key, value in tensors.items():
        assert torch.equal(state[key], value), key
