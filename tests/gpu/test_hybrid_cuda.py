"""GPU checks of the VDN-H3 hybrid block (h3_core.models.hybrid) on random data (skipped without CUDA).

Run on a CUDA machine with ``python -m pytest tests/gpu/test_hybrid_cuda.py``. The geometries are small but not
trivial: 10-17 latent frames on a 4x6 or 6x8 token grid (8x12 / 12x16 latents under the 2x2 patch), a few text
rows and stereo audio latents, 2-4 heads of 64 or 128 channels, and windows that leave frames out (so the
linear branch runs) next to windows that cover everything (so it must not).

Every precision reads the same numbers: weights and inputs are rounded to bf16 once and the fp32 / fp64
references are upcasts of those, so the errors measured are those of the arithmetic, not of the inputs.
TF32 is switched off for the duration of each test so that the fp32 references are fp32.
"""

import copy
from dataclasses import dataclass, replace

import fused_eager
import pytest
import torch

from h3_core.attention import (
    WindowSpec,
    dense_attention,
    is_full_cover,
    resolve_kernel,
    resolve_window_backend,
    window_bounds,
)
from h3_core.models.branch_math import (
    featurize,
    frame_statistics,
    gather,
    gather_reference,
    scan,
    scan_reference,
    solve,
    solve_reference,
)
from h3_core.models.dit import Block, DiTConfig, rope_cos_sin, rope_inv_freq
from h3_core.models.hybrid import RELEASE_WINDOW, HybridContext
from h3_core.models.linear_branch import LinearBranch
from h3_core.models.low_memory import LowMemory
from h3_core.models.run_options import PLAIN, RunOptions
from h3_core.pipeline.packing import pack_sequence

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = torch.device("cuda")
CPU = torch.device("cpu")
BACKENDS = ("ref", "flex", "decomposed", "auto")

# Bounds, from the unit roundoff u of the format (bf16: u = 2^-9 ~ 2.0e-3; fp32: u = 2^-24 ~ 6.0e-8).
# bf16 block vs fp32 reference: every matmul output, norm and the attention probabilities of a fused kernel are
# rounded to bf16 (~u/sqrt(3) ~ 1.1e-3 rms each); a dozen or so such roundings in series (qkv, q/k norm, RoPE's
# bf16 cos/sin and product, attention, gate product, out_proj, the branch's features, state and readout, the
# AdaLN modulations, the MLP) add in quadrature to ~5e-3 in each sublayer and ~9e-3 of the block's update
# (measured 8.6-9.2e-3 on an H200 for every backend, the same on the CPU). 2e-2 leaves a margin of ~2x; a wrong
# mask, a dropped window group or a broken branch costs O(1) (the branch alone is asserted to carry > 30% of the
# update, so losing it fails the bound by far).
BF16_BLOCK = 2e-2
# Two bf16 window backends round the same softmax differently (the doc's "a few 1e-3"); the difference grows
# through the gates and the MLP to 4.1-5.4e-3 of the update (H200: flex on Triton vs decomposed on cuDNN).
BF16_BACKEND_PAIR = 1e-2
# fp32 reference on CUDA vs fp64 on the CPU: fp32 roundoff through sums of <= ~850 terms and a Cholesky of a
# well-conditioned matrix: measured 5-6e-7 (H200 and CPU). 1e-5 still shows it; TF32 anywhere would not pass.
FP32_BLOCK = 1e-5

RUNS = []  # what each window softmax ran, in order (the contexts made here report to it)


def rel(a, b):
    """Norm-wise relative error of ``a`` against ``b``, in fp64 on the CPU."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm()).item()


def update_err(out, ref, x):
    """``|out - ref| / |ref - x|``: the error relative to what the block adds to its input ``x`` (measured against
    the output itself, the residual would hide it)."""
    out, ref, x = (t.detach().double().cpu() for t in (out, ref, x))
    return ((out - ref).norm() / (ref - x).norm()).item()


@pytest.fixture(autouse=True)
def _no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@dataclass(frozen=True)
class Case:
    frames: int
    height: int  # latent rows and columns; the token grid is height/2 x width/2
    width: int
    text: int
    audio: int  # latents per channel (stereo: twice as many rows)
    heads: int
    head_dim: int
    window: WindowSpec

    def cfg(self) -> DiTConfig:
        # rope_freqs = head_dim / 8: 6 * 16 = 96 of 128 channels rotated (as released), 48 of 64; the rest pass.
        return DiTConfig(
            hidden=192,
            layers=1,
            heads=self.heads,
            head_dim=self.head_dim,
            ffn=256,
            time_embed=16,
            rope_freqs=self.head_dim // 8,
            hybrid=True,
        )

    def context(self, packed, backend) -> HybridContext:
        return HybridContext(packed.layout, self.window, backend, (0, self.text), RUNS.append)


def fill(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights, rounded to bf16 (so every copy of the module holds the same numbers): matrices and conv
    taps ~ N(0, 1/fan_in), vectors ~ N(0, 1); the decay rates A_log ~ -2 ± 0.3, which with dt_bias ~ N(0, 1) gives
    alpha ~ 0.7-0.99 per frame (trained-like), so the branch carries state across whole windows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            fan_in = p[0].numel() if p.dim() > 1 else 1
            value = torch.randn(p.shape, generator=g, dtype=torch.float64) / fan_in**0.5
            if name.endswith("alpha.A_log"):
                value = value * 0.3 - 2.0
            p.copy_(value.to(torch.bfloat16))
    return module


def shared_block(cfg: DiTConfig, seed: int = 1) -> Block:
    """A CPU fp32 block holding bf16-exact weights; ``on`` makes the copies that run."""
    return fill(Block(cfg), seed).eval()


def on(module, device, dtype):
    return copy.deepcopy(module).to(device, dtype)


def inputs(case: Case, cfg: DiTConfig, seed: int = 0):
    """The packed layout and bf16-exact block inputs: x [T, hidden], one timestep's embedding, the AdaLN rows
    (timestep 0, by modality) and RoPE from the packed positions."""
    packed = pack_sequence(torch.ones(case.text, dtype=torch.long), case.frames, case.height, case.width, case.audio)
    g = torch.Generator().manual_seed(seed)
    T = packed.positions.shape[0]
    x = torch.randn(T, cfg.hidden, generator=g).to(torch.bfloat16)
    temb = torch.randn(1, cfg.time_embed, generator=g)
    rope = rope_cos_sin(packed.positions, rope_inv_freq(cfg))
    return packed, x, temb, packed.tags.clone(), rope


def forward(block, inp, ctx, device, dtype, run=PLAIN):
    _, x, temb, rows, rope = inp
    with torch.no_grad():
        return block(
            x.to(device, dtype), temb.to(device), rows.to(device), tuple(r.to(device) for r in rope), ctx, run=run
        )


# ---- 1. the hybrid block in bf16 on every window backend against fp32 -----------------------------------

CASES = {
    # chunk 3, one chunk either side, anchor frames both ways: the branch runs on frames 1..11
    "13f-4x6-4h64-c3r1-both": Case(13, 8, 12, text=7, audio=5, heads=4, head_dim=64, window=WindowSpec(1, 3, "both")),
    # the released window (chunk 5, radius 1, anchors both) at 17 > 10 frames, so it leaves frames out
    "17f-6x8-2h128-release": Case(17, 12, 16, text=9, audio=6, heads=2, head_dim=128, window=RELEASE_WINDOW),
    # per-frame windows of radius 2 with anchor columns only: the branch runs on every frame
    "12f-4x6-2h128-r2-columns": Case(
        12, 8, 12, text=5, audio=4, heads=2, head_dim=128, window=WindowSpec(2, 0, "columns")
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_hybrid_block_bf16_matches_fp32_reference_on_every_backend(case):
    cfg = case.cfg()
    F = case.frames
    assert not is_full_cover(window_bounds(F, case.window.radius, case.window.chunk), F)
    base = shared_block(cfg)
    inp = inputs(case, cfg)
    packed, x = inp[0], inp[1]

    ref = forward(on(base, DEV, torch.float32), inp, case.context(packed, "ref"), DEV, torch.float32)
    gold = forward(on(base, CPU, torch.float64), inp, case.context(packed, "ref"), CPU, torch.float64)
    assert update_err(ref, gold, x) <= FP32_BLOCK
    # The branch must matter, or a broken one would pass: without to_out_linear the update moves by > 30%.
    cut = on(base, DEV, torch.float32)
    with torch.no_grad():
        cut.attn.to_out_linear.weight.zero_()
    no_branch = forward(cut, inp, case.context(packed, "ref"), DEV, torch.float32)
    assert update_err(no_branch, ref, x) > 0.3

    fast = on(base, DEV, torch.bfloat16)
    resolved = resolve_window_backend("auto", DEV, torch.bfloat16, case.head_dim)
    # the documented rule: decomposed when a fused dense kernel with log-sum-exp exists, else flex
    assert resolved == ("decomposed" if resolve_kernel(DEV, torch.bfloat16, case.head_dim) != "math" else "flex")
    outs, errs = {}, {}
    for backend in BACKENDS:
        out = forward(fast, inp, case.context(packed, backend), DEV, torch.bfloat16)
        run = RUNS[-1]
        assert run.requested == backend and run.backend == (resolved if backend == "auto" else backend), run
        assert out.dtype == torch.bfloat16 and out.shape == x.shape and torch.isfinite(out).all(), backend
        outs[backend], errs[backend] = out, update_err(out, ref, x)
    assert max(errs.values()) <= BF16_BLOCK, errs
    assert torch.equal(outs["auto"], outs[resolved])  # auto ran exactly what it resolved to
    assert update_err(outs["decomposed"], outs["flex"], x) <= BF16_BACKEND_PAIR, errs
    # The lower-memory path (heads in groups, FFN in row chunks) rounds only the sum of the groups' shares.
    low_memory = RunOptions().with_low_memory(LowMemory(ffn_chunk_rows=37, head_groups=2))
    grouped = forward(fast, inp, case.context(packed, "decomposed"), DEV, torch.bfloat16, low_memory)
    assert update_err(grouped, ref, x) <= BF16_BLOCK
    assert update_err(grouped, outs["decomposed"], x) <= BF16_BACKEND_PAIR


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_fused_hybrid_block_in_bf16_is_as_close_to_fp32_as_the_plain_block(case, mode):
    from h3_core.models.branch_fused import compiled_branch_available

    if mode == "compiled" and not compiled_branch_available(DEV):
        pytest.skip("needs Triton")
    cfg = case.cfg()
    base = shared_block(cfg)
    inp = inputs(case, cfg)
    packed, x = inp[0], inp[1]
    ctx = case.context(packed, "decomposed")
    ref = forward(on(base, DEV, torch.float32), inp, case.context(packed, "ref"), DEV, torch.float32)
    fast = on(base, DEV, torch.bfloat16)
    plain = forward(fast, inp, ctx, DEV, torch.bfloat16)
    library_mode, running = fused_eager.mode_for(mode)  # "eager": the fused functions as written
    with running:
        fused = forward(fast, inp, ctx, DEV, torch.bfloat16, RunOptions().fused(library_mode))
    assert fused.dtype == torch.bfloat16 and torch.isfinite(fused).all()
    # one rounding per fused chain instead of one per op: no worse than the plain block
    assert update_err(fused, ref, x) <= 1.1 * update_err(plain, ref, x) + 1e-4
    assert update_err(fused, ref, x) <= BF16_BLOCK


# ---- 2. the linear branch's fp32 fast path against its fp64 references -----------------------------------

# fp32 stage bounds. Frame statistics: sums of S = 48 products, ~sqrt(S) u ~ 4e-7. Solve: a Cholesky of I + A
# (A positive semidefinite, so ||(I + A)^-1|| <= 1; condition 1 + lambda_max(A) ~ 5 here) and a triangular
# inverse: ~ cond * sqrt(d) * u ~ 3e-6 at worst. Scans: every transition has norm <= max alpha < 1, so errors
# do not grow along the frames. Gather: exp of differences of a cumsum of log alpha, ~ F * |log alpha| * u.
# Measured on an H200 (and the CPU): at most 6.6e-7 at any stage. 1e-5 sits ~15x above; an error of the algorithm
# (a wrong bound, a skipped or repeated frame, the wrong seed) costs O(1).
FP32_STAGE = 1e-5
# the whole branch (convs, features, the chain above, readout RMSNorm and gate) in fp32 vs fp64: measured
# 3.7e-7 on an H200 (3.5e-7 on the CPU); its bf16 run is held to BF16_BLOCK (measured 5.6e-3)
FP32_BRANCH = 2e-5


def branch_stage_inputs(frames, tokens, heads, head_dim, dtype, seed):
    """k~, v~ (SiLU + L2 features of random raw k, v), beta in (0, 1), alpha in (0.5, 1) and the text seed
    0.5 * B_txt (I + A_txt)^-1 of 11 text rows: each rounded to what the GPU path holds (features and beta in
    ``dtype``, alpha and the seed in fp32), then returned in fp64 on the CPU."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    shape = (frames, tokens, heads, head_dim)
    _, k, v = featurize(rnd(*shape), rnd(*shape), rnd(*shape), None)
    beta = torch.sigmoid(rnd(frames, tokens, heads))
    alpha = 0.5 + 0.5 * torch.sigmoid(rnd(frames, heads, head_dim) + 2)
    _, tk, tv = featurize(rnd(1, 11, heads, head_dim), rnd(1, 11, heads, head_dim), rnd(1, 11, heads, head_dim), None)
    A_txt, B_txt = frame_statistics(tk, tv, torch.sigmoid(rnd(1, 11, heads)))
    seed_state = 0.5 * solve_reference(torch.ones(1, heads, head_dim, dtype=torch.float64), A_txt, B_txt)[1][0]
    k, v, beta = (t.to(dtype).double() for t in (k, v, beta))
    alpha, seed_state = (t.float().double() for t in (alpha, seed_state))
    return k, v, beta, alpha, seed_state


@pytest.mark.parametrize("features", [torch.bfloat16, torch.float32], ids=["bf16-features", "fp32-features"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_linear_branch_fast_path_matches_fp64_reference(head_dim, features):
    frames, heads = 15, 2
    k, v, beta, alpha, seed_state = branch_stage_inputs(frames, 48, heads, head_dim, features, seed=head_dim)
    bounds = window_bounds(frames, 1, 3)  # both ends reach past the clip: the seed stands in there

    # fp64 references on the CPU (frame_statistics in fp64 is checked against explicit sums in the unit tests)
    A_r, B_r = frame_statistics(k, v, beta)
    T_r, J_r = solve_reference(alpha, A_r, B_r)
    P_r, Q_r = scan_reference(T_r, J_r, seed_state)
    S_r = gather_reference(P_r, Q_r, alpha, bounds, seed_state)

    def dev32(t):
        return t.to(DEV, torch.float32)

    a32, s32 = dev32(alpha), dev32(seed_state)
    # the chain as the model runs it on the GPU: features in ``features``, fp32 from the statistics on
    A, B = frame_statistics(k.to(DEV, features), v.to(DEV, features), beta.to(DEV, features))
    T, J = solve(a32, A, B)
    P, Q = scan(T, J, s32)
    S = gather(P, Q, a32, bounds, s32)
    for t in (A, B, T, J, P, Q, S):
        assert t.device.type == DEV.type and t.dtype == torch.float32 and torch.isfinite(t).all()
    chain = dict(
        A=rel(A, A_r), B=rel(B, B_r), T=rel(T, T_r), J=rel(J, J_r), P=rel(P, P_r), Q=rel(Q, Q_r), S=rel(S, S_r)
    )
    assert max(chain.values()) <= FP32_STAGE, chain

    # each stage alone, from the reference's own inputs (an error cannot hide behind an earlier one)
    T1, J1 = solve(a32, dev32(A_r), dev32(B_r))
    P1, Q1 = scan(dev32(T_r), dev32(J_r), s32)
    S1 = gather(dev32(P_r), dev32(Q_r), a32, bounds, s32)
    stages = dict(T=rel(T1, T_r), J=rel(J1, J_r), P=rel(P1, P_r), Q=rel(Q1, Q_r), S=rel(S1, S_r))
    assert max(stages.values()) <= FP32_STAGE, stages


def branch_case(heads, head_dim, grid, seed, frames=14, hidden=96, text=6):
    """A CPU linear branch with bf16-exact random weights and bf16 inputs over ``frames`` frames on ``grid``:
    the video rows' x, q, k, v, the text rows' x, k, v, and windows of one 3-frame chunk either side."""
    rows = frames * grid[0] * grid[1]
    branch = fill(LinearBranch(hidden, heads, head_dim, bottleneck=32), seed=seed).eval()
    g = torch.Generator().manual_seed(seed + 1)
    x, tx = (torch.randn(n, hidden, generator=g).to(torch.bfloat16) for n in (rows, text))
    q, k, v, tk, tv = (
        torch.randn(n, heads, head_dim, generator=g).to(torch.bfloat16) for n in (rows, rows, rows, text, text)
    )
    return branch, (x, q, k, v), (tx, tk, tv), window_bounds(frames, 1, 3)


def test_linear_branch_module_fp32_on_cuda_matches_fp64_on_cpu():
    grid = (4, 6)
    branch, (x, q, k, v), (tx, tk, tv), bounds = branch_case(2, 64, grid, seed=3)

    def run(device, dtype):
        module = on(branch, device, dtype)
        with torch.no_grad():
            seed_state = module.text_state(*(t.to(device, dtype) for t in (tx, tk, tv)))
            out = module(*(t.to(device, dtype) for t in (x, q, k, v)), grid, bounds, seed_state)
        return out, seed_state

    gold, gold_seed = run(CPU, torch.float64)
    out, seed_state = run(DEV, torch.float32)
    assert out.dtype == torch.float32 and seed_state.dtype == torch.float32 and torch.isfinite(out).all()
    assert rel(seed_state, gold_seed) <= FP32_STAGE
    assert rel(out, gold) <= FP32_BRANCH
    # and as the block runs it: bf16 activations, fp32 statistics, solve and scans
    half, half_seed = run(DEV, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half_seed.dtype == torch.float32 and torch.isfinite(half).all()
    assert rel(half, gold) <= BF16_BLOCK


def test_gram_statistics_of_bf16_features_on_cuda_sum_in_fp32():
    from h3_core.models.branch_fused import gram_statistics

    g = torch.Generator().manual_seed(9)
    k, v = (
        torch.nn.functional.normalize(torch.randn(6, 4, 1008, 128, generator=g), dim=-1).to(torch.bfloat16)
        for _ in range(2)
    )
    A, B = gram_statistics(k.to(DEV), v.to(DEV))
    wide_k, wide_v = k.double(), v.double()
    assert A.dtype == B.dtype == torch.float32
    # the bf16 features are exact in fp64: only the fp32 sums differ
    assert rel(A.cpu(), wide_k.transpose(-1, -2) @ wide_k) <= FP32_STAGE
    assert rel(B.cpu(), wide_v.transpose(-1, -2) @ wide_k) <= FP32_STAGE
    assert torch.equal(A, A.transpose(-1, -2))


def test_shifted_statistics_compiled_on_cuda_equal_the_eager_pass():
    from h3_core.models.branch_fused import compiled_branch_available, shifted_statistics

    if not compiled_branch_available():
        pytest.skip("Triton is not importable here")
    g = torch.Generator().manual_seed(10)
    k, v = (
        torch.nn.functional.normalize(torch.randn(6, 4, 1008, 128, generator=g), dim=-1).to(torch.bfloat16).to(DEV)
        for _ in range(2)
    )
    shifted, B = shifted_statistics("compiled", k, v)
    want, want_B = fused_eager.written(shifted_statistics, k, v)
    assert shifted.dtype == torch.float32 and torch.equal(B, want_B)
    # ½(a + b) + 1 in fp32 either way: the generated kernel may contract it into one fma
    assert (shifted - want).abs().max() <= 1e-6 * want.abs().max()
    assert torch.equal(shifted, shifted.transpose(-1, -2))


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_fused_branch_on_cuda_is_as_close_to_fp64_as_the_plain_branch(mode):
    from h3_core.models.branch_fused import compiled_branch_available

    if mode == "compiled" and not compiled_branch_available(DEV):
        pytest.skip("needs Triton")
    heads, grid = 4, (6, 8)
    branch, (x, q, k, v), (tx, tk, tv), bounds = branch_case(heads, 128, grid, seed=5)

    def run(device, dtype, fused, heads_run=None):
        module = on(branch, device, dtype)
        fused, running = fused_eager.mode_for(fused)  # "eager": the fused functions as written
        options = RunOptions(branches_fused=fused)
        sl = slice(0, heads) if heads_run is None else heads_run
        with running, torch.no_grad():
            text = (t.to(device, dtype) for t in (tx, tk[:, sl], tv[:, sl]))
            seed_state = module.text_state(*text, heads_run, run=options)
            rows = (t.to(device, dtype) for t in (x, q[:, sl], k[:, sl], v[:, sl]))
            return module(*rows, grid, bounds, seed_state, heads_run, run=options)

    gold = run(CPU, torch.float64, None)
    plain = run(DEV, torch.bfloat16, None)
    fused = run(DEV, torch.bfloat16, mode)
    assert fused.dtype == torch.bfloat16 and torch.isfinite(fused).all()
    assert rel(fused, gold) <= 1.1 * rel(plain, gold)
    # a head group runs the same kernels on fewer heads
    group = slice(1, 3)
    assert rel(run(DEV, torch.bfloat16, mode, group), run(CPU, torch.float64, None, group)) <= BF16_BLOCK


# ---- 3. full cover: the dense block, branch off ---------------------------------------------------------

FULL_COVER = {
    # the released window covers every frame up to 10 frames (chunk 0 sees 0-9)
    "10f-4x6-release": Case(10, 8, 12, text=6, audio=4, heads=2, head_dim=64, window=RELEASE_WINDOW),
    "13f-4x6-r12-both": Case(13, 8, 12, text=6, audio=4, heads=4, head_dim=64, window=WindowSpec(12, 0, "both")),
    "13f-6x8-c7r1-none": Case(13, 12, 16, text=6, audio=4, heads=2, head_dim=128, window=WindowSpec(1, 7, "none")),
}


def rotate_half(x, cos, sin):
    """RoPE as ``rope_cos_sin`` documents it, written out here: channel i < n/2 of the first n = cos.shape[-1] pairs
    with channel i + n/2, (a, b) -> (a cos - b sin, b cos + a sin); the channels past n pass through."""
    n = cos.shape[-1]
    h = n // 2
    cos, sin = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]
    a, b = x[..., :h], x[..., h:n]
    return torch.cat([a * cos[..., :h] - b * sin[..., :h], b * cos[..., h:] + a * sin[..., h:], x[..., n:]], dim=-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", FULL_COVER.values(), ids=FULL_COVER.keys())
def test_full_cover_is_dense_attention_gated_and_without_the_branch(case, backend):
    """tests/unit/test_hybrid.py's full-cover check, on CUDA and in fp64 as there (to 1e-12): the hybrid attention
    is out_proj(softmax_gate * dense attention), and changing the branch's weights changes nothing."""
    cfg = case.cfg()
    F = case.frames
    assert is_full_cover(window_bounds(F, case.window.radius, case.window.chunk), F)
    packed, x, _, _, rope = inputs(case, cfg)
    attn = on(shared_block(cfg).attn, DEV, torch.float64)
    x, rope = x.to(DEV, torch.float64), tuple(r.to(DEV) for r in rope)
    ctx = case.context(packed, backend)
    T, H, d = x.shape[0], cfg.heads, cfg.head_dim
    with torch.no_grad():
        got = attn(x, rope, ctx)
        run = RUNS[-1]
        q, k, v = attn.qkv_proj(x).view(T, 3, H, d).unbind(1)
        q, k = rotate_half(attn.q_norm(q), *rope), rotate_half(attn.k_norm(k), *rope)
        gated = dense_attention(q, k, v).out * attn.softmax_gate(x)[..., None]
        want = attn.out_proj(gated.reshape(T, -1))
        for p in [*attn.linear_attention.parameters(), attn.to_out_linear.weight]:
            p.mul_(-3.0).add_(0.25)
        again = attn(x, rope, ctx)
    assert run.requested == backend and run.backend == resolve_window_backend(backend, DEV, torch.float64, d), run
    assert got.device.type == DEV.type and got.dtype == torch.float64
    assert (got - want).abs().max() <= 1e-12
    assert torch.equal(got, again)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", FULL_COVER.values(), ids=FULL_COVER.keys())
def test_full_cover_hybrid_block_in_bf16_is_the_dense_block(case, backend):
    """The whole block in bf16 with the fast kernels: with the softmax gate held at exactly 1 (weight 0, bias 40:
    sigmoid(40) rounds to 1 in fp32 and bf16), the hybrid block under a full-cover window is the dense H3 block
    (cfg.hybrid=False) with the shared weights. Every backend but ``ref`` takes the one dense call, the same call
    the dense block makes, so the two agree bit for bit; ``ref`` attends frame by frame through SDPA, a different
    bf16 kernel (two attention roundings of ~2e-3; measured 4.8e-3 of the update on an H200: bound 1e-2)."""
    cfg = case.cfg()
    base = shared_block(cfg)
    with torch.no_grad():
        base.attn.softmax_gate.up.weight.zero_()
        base.attn.softmax_gate.up.bias.fill_(40.0)
    dense = Block(replace(cfg, hybrid=False)).eval()
    names = dense.state_dict().keys()
    dense.load_state_dict({n: p for n, p in base.state_dict().items() if n in names})
    inp = inputs(case, cfg)
    packed, x = inp[0], inp[1]
    hybrid = on(base, DEV, torch.bfloat16)
    out = forward(hybrid, inp, case.context(packed, backend), DEV, torch.bfloat16)
    run = RUNS[-1]
    plain = forward(on(dense, DEV, torch.bfloat16), inp, None, DEV, torch.bfloat16)
    expected = resolve_window_backend(backend, DEV, torch.bfloat16, cfg.head_dim)
    assert run.requested == backend and run.backend == expected, run
    assert torch.isfinite(out).all() and out.dtype == torch.bfloat16
    if run.backend == "ref":
        assert update_err(out, plain, x) <= BF16_BACKEND_PAIR
    else:
        assert run.kernel == resolve_kernel(DEV, torch.bfloat16, cfg.head_dim)
        assert torch.equal(out, plain)
    with torch.no_grad():  # the branch is off: its weights do not reach the output
        for p in [*hybrid.attn.linear_attention.parameters(), hybrid.attn.to_out_linear.weight]:
            p.mul_(-3.0).add_(0.25)
    assert torch.equal(forward(hybrid, inp, case.context(packed, backend), DEV, torch.bfloat16), out)
