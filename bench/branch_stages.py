"""The VDN-H3 linear branch stage by stage at the release size (100 branch frames of 24×42 tokens, 56 heads
of 128, bf16): each stage as the plain branch runs it and as the fused branch runs it in each mode
(``h3_core.models.branch_fused``), timed (median of ``--reps`` CUDA-event timings after a warm-up) and
checked against the plain form (the solve against its fp64 reference).

Stages: features (the plain depthwise 5×5 + 5-tap convs, SiLU and L2; the fused branch's spatial conv by cuDNN
and by the Triton pass at several launches, then its temporal conv + SiLU + L2 + √β), the frame statistics
(plain fp32, also a few frames at a time as ``LowMemory.branch_frames`` runs them; fused: the Gram products of
√β-scaled features with fp32 sums, and I + A in one pass), the solve (the inverse by halves; in ``compiled`` its
16-row leaves inverted by the Triton kernel), the scans, the gather, the readout, and the whole branch. On CUDA
``compiled`` runs the library's Triton kernels and ``torch.compile``'s passes; ``eager`` runs the fused functions
as written (``tests/fused_eager.py``); ``--tiny`` runs the plain and ``eager`` forms on a small geometry on the
CPU.

    python3 bench/branch_stages.py --out results.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fused functions as written
import record
from fused_eager import EAGER, mode_for

from h3_core.attention.layout import window_bounds
from h3_core.models import branch_fused
from h3_core.models import branch_math as lb
from h3_core.models.linear_branch import LinearBranch
from h3_core.models.run_options import PLAIN, RunOptions

RELEASE = dict(frames=100, grid=(24, 42), heads=56, head_dim=128, hidden=5376)
SPATIAL_LAUNCHES = ((128, 4), (64, 2), (32, 1), (256, 8), (256, 4), (128, 2), (64, 1))  # channels, warps
TINY = dict(frames=12, grid=(3, 5), heads=2, head_dim=16, hidden=32)


def in_mode(mode, fn, *args):
    """``fn(mode, *args)`` for a mode of ``modes``: the library's, or ``EAGER`` (the fused functions as written)."""
    library_mode, running = mode_for(mode)
    with running:
        return fn(library_mode, *args)


def whole_branch(branch, mode, *args):
    """``branch(*args)`` with its fused functions in ``mode`` (its ``RunOptions.branches_fused``)."""
    library_mode, running = mode_for(mode)
    with running:
        return branch(*args, run=RunOptions(branches_fused=library_mode))


def max_diff(a, b) -> float:
    a = a if isinstance(a, torch.Tensor) else torch.cat([t.flatten() for t in a])
    b = b if isinstance(b, torch.Tensor) else torch.cat([t.flatten() for t in b])
    return float((a.double() - b.double()).abs().max())


def main(argv=None) -> dict:
    args, cuda = record.stage_arguments(__doc__.splitlines()[0], argv)
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    size = TINY if args.tiny else RELEASE
    frames, grid, H, d = size["frames"], size["grid"], size["heads"], size["head_dim"]
    S, C = grid[0] * grid[1], size["heads"] * size["head_dim"]
    time_it = record.timer(cuda, args.reps)
    modes = [EAGER] + (["compiled"] if cuda and branch_fused.compiled_branch_available() else [])
    result = dict(record.header("branch_stages.py", argv), size=size, modes=modes, ms={}, max_diff={})
    ms, diff = result["ms"], result["max_diff"]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        branch = LinearBranch(size["hidden"], H, d).to(device, dtype)
        for p in branch.parameters():
            p.copy_((torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 1)).to(p.dtype))
        x = torch.randn(frames * S, size["hidden"], generator=g).to(device, dtype)
        q, k, v = (torch.randn(frames * S, H, d, generator=g).to(device, dtype) for _ in range(3))
        bounds = [(lo - 1, hi - 1) for lo, hi in window_bounds(frames + 2, 1, 5)[1 : frames + 1]]
        conv = branch.short_conv
        weights = (conv.k_sp.weight, conv.k_tm.weight, conv.v_sp.weight, conv.v_tm.weight)
        shape = (frames, S, H, d)

        # features: q̃, k̃, ṽ plain; the fused branch's spatial conv of k, then its temporal conv + SiLU + L2
        featurize = lambda: lb.featurize(q.view(shape), k.view(shape), v.view(shape), grid, weights)  # noqa: E731
        ms["features (plain: q, k, v)"] = time_it(featurize)
        q_plain, k_plain, v_plain = featurize()
        dense_k = k.view(frames, S, C)
        ms["spatial conv of k (fused: cuDNN)"] = time_it(lambda: branch_fused.spatial_conv(dense_k, weights[0], grid))
        spatial = branch_fused.spatial_conv(dense_k, weights[0], grid)
        kernel = branch_fused.triton_kernel("spatial_conv", "cuda") if cuda else None
        for block_c, warps in SPATIAL_LAUNCHES if kernel is not None else ():
            launch = lambda b=block_c, w=warps: kernel(dense_k, weights[0], grid, b, w)  # noqa: E731
            ms[f"spatial conv of k (Triton, {block_c} channels, {warps} warps)"] = time_it(launch)
            diff[f"spatial conv Triton {block_c}x{warps} vs cuDNN"] = max_diff(launch(), spatial)
        for mode in modes:
            conv_k = lambda mode=mode: in_mode(  # noqa: E731
                mode, branch_fused.run, "conv_features", spatial, weights[1], H, True
            )
            ms[f"temporal conv + SiLU + L2 of k ({mode})"] = time_it(conv_k)
            diff[f"k features {mode} vs plain"] = max_diff(conv_k().transpose(1, 2), k_plain)

        # frame statistics: A (symmetrised) and B in fp32; fused, of the √β-scaled features in the rows' dtype
        beta = torch.sigmoid(torch.randn(frames, S, H, generator=g)).to(device, dtype)
        kt = k_plain.transpose(1, 2).contiguous().transpose(1, 2)
        ms["statistics (plain, fp32)"] = time_it(lambda: lb.frame_statistics(kt, v_plain, beta))
        ms["statistics (plain, fp32, 16 frames at a time)"] = time_it(
            lambda: lb.frame_statistics(kt, v_plain, beta, 16)
        )
        A, B = lb.frame_statistics(kt, v_plain, beta)
        shifted = A + torch.eye(d, dtype=A.dtype, device=device)
        root = beta.sqrt()[..., None]
        k_scaled, v_scaled = ((t * root).to(dtype).transpose(1, 2).contiguous() for t in (kt, v_plain))
        for mode in modes:
            fused_statistics = lambda mode=mode: in_mode(mode, branch_fused.shifted_statistics, k_scaled, v_scaled)  # noqa: E731
            ms[f"statistics and I + A ({mode}: Gram products, fp32 sums)"] = time_it(fused_statistics)
            diff[f"statistics {mode} vs plain"] = max_diff(fused_statistics(), (shifted, B))

        # the solve: T = diag(α)(I + A)⁻¹, J = B (I + A)⁻¹, against the fp64 reference
        alpha = (torch.rand(frames, H, d, generator=g) * 0.5 + 0.5).to(device)
        T_ref, J_ref = lb.solve_reference(alpha.cpu(), A.cpu(), B.cpu())
        for mode in [None] + [m for m in modes if in_mode(m, branch_fused.small_inverse, device) is not None]:
            leaf = in_mode(mode, branch_fused.small_inverse, device)
            solve = lambda leaf=leaf: lb.solve_shifted(alpha, shifted, B, leaf)  # noqa: E731
            ms[f"solve ({mode or 'plain'})"] = time_it(solve)
            diff[f"solve {mode or 'plain'} vs fp64 reference"] = max_diff([t.cpu() for t in solve()], (T_ref, J_ref))
        T, J = lb.solve_shifted(alpha, shifted, B)

        # the scans and the gather on the fp32 frame states
        seed = torch.zeros(H, d, d, device=device)
        ms["scans, prefix + suffix (plain)"] = time_it(lambda: lb.scan(T, J, seed))
        P, Q = lb.scan(T, J, seed)
        for mode in modes:
            ms[f"scans ({mode})"] = time_it(lambda mode=mode: in_mode(mode, branch_fused.scan, T, J, seed))
            diff[f"scans {mode} vs plain"] = max_diff(in_mode(mode, branch_fused.scan, T, J, seed), (P, Q))
        ms["gather (plain)"] = time_it(lambda: lb.gather(P, Q, alpha, bounds, seed))
        state = lb.gather(P, Q, alpha, bounds, seed)
        for mode in modes:
            gather = lambda mode=mode: in_mode(mode, branch_fused.gather, P, Q, alpha, bounds, seed)  # noqa: E731
            ms[f"gather ({mode})"] = time_it(gather)
            diff[f"gather {mode} vs plain"] = max_diff(gather(), state)

        # the readout: plain, the state product of q̃ (the norm and gate follow); fused, all of it in one function
        ms["readout's state product (plain)"] = time_it(
            lambda: torch.einsum("fhvk,fshk->fshv", state.to(dtype), q_plain)
        )
        logits = torch.randn(frames * S, C, generator=g).to(device, dtype)
        readout = lambda mode: in_mode(  # noqa: E731
            mode, branch_fused.run, "readout", q.view(shape), state, branch.norm.weight, logits
        )
        for mode in modes:
            ms[f"readout ({mode}: q̃, state product, norm, gate)"] = time_it(lambda mode=mode: readout(mode))
            if mode != EAGER:
                diff[f"readout {mode} vs eager"] = max_diff(readout(mode), readout(EAGER))

        # the whole branch
        for mode in [None] + modes:
            ms[f"whole branch ({mode or 'plain'})"] = time_it(
                lambda mode=mode: whole_branch(branch, mode, x, q, k, v, grid, bounds)
            )
        plain = branch(x, q, k, v, grid, bounds, run=PLAIN)
        for mode in modes:
            diff[f"whole branch {mode} vs plain"] = max_diff(
                whole_branch(branch, mode, x, q, k, v, grid, bounds), plain
            )
    return record.finish(result, args.out, cuda)


if __name__ == "__main__":
    main()
