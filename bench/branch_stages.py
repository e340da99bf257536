"""The VDN-H3 linear branch stage by stage at the release size (100 branch frames of 24×42 tokens, 56 heads
of 128, bf16), the plain forms next to candidate faster ones, each timed (median of ``--reps`` CUDA-event
timings after a warm-up) and checked against the plain form.

Stages: features (spatial 5×5 through cuDNN — on a dense tensor and on the projection's slice, in its
benchmark mode, without cuDNN, channels-first; then the temporal 5-tap depthwise conv, SiLU, L2), frame
statistics (fp32, TF32, the Gram products of √β-scaled half-precision features with fp32 sums), the solve
(the library's inverse by halves at several block sizes, its blocks inverted by the library or by the
Triton leaf kernel; the Cholesky form it replaced, an explicit inverse, ``cholesky_inverse``), the scans
(per frame, and the library's one Triton kernel at several tile sizes), the gather (plain, and the fused
branch's one Triton pass), the readout (einsum + norm + gate, three passes — features, GEMM, finish — or
the library's one function: one Triton pass on CUDA); then the whole branch plain and fused
(``h3_core.models.branch_fused``). Also timed beside the library's: a Triton spatial conv
(``candidate_kernels.spatial_conv_rolling``; slower than cuDNN at every launch measured); the solve's input
(symmetrised Gram product + I) in the two library passes it took before, against the one compiled pass the
fused branch now makes (``branch_fused.shifted_gram``); the readout's bf16 ``to_out_linear`` accumulated into
the attention's output rows by its GEMM instead of added after it (slower than the GEMM and an add).
``--tiny`` runs the same code on a small geometry on the CPU (no compiled forms there).

    python3 bench/branch_stages.py --out results.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402

from h3_core.attention.layout import window_bounds  # noqa: E402
from h3_core.models import branch_fused, linear_branch as lb  # noqa: E402

RELEASE = dict(frames=100, grid=(24, 42), heads=56, head_dim=128, hidden=5376)
TINY = dict(frames=12, grid=(3, 5), heads=2, head_dim=16, hidden=32)


def max_diff(a, b) -> float:
    a = a if isinstance(a, torch.Tensor) else torch.cat([t.flatten() for t in a])
    b = b if isinstance(b, torch.Tensor) else torch.cat([t.flatten() for t in b])
    return float((a.double() - b.double()).abs().max())


def solve_cholesky(alpha, A, B):
    """``linear_branch.solve`` as it was: a Cholesky factor (no error check), its triangular inverse and the
    product of the two."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    chol, _ = torch.linalg.cholesky_ex(A + eye)
    linv = torch.linalg.solve_triangular(chol, eye.expand_as(A), upper=False)
    inv = linv.transpose(-1, -2) @ linv
    return alpha[..., None] * inv, B @ inv


def solve_cholesky_inverse(alpha, A, B):
    """The inverse of I + A from its Cholesky factor in one library call (``torch.cholesky_inverse``)."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    chol, _ = torch.linalg.cholesky_ex(A + eye)
    inv = torch.cholesky_inverse(chol)
    return alpha[..., None] * inv, B @ inv


def solve_blocked(alpha, A, B, base, leaf=None):
    """``linear_branch.solve`` with another block size at which the inverse by halves stops (its blocks
    inverted by ``leaf`` where given)."""
    inv = lb.spd_inverse(A + torch.eye(A.shape[-1], dtype=A.dtype, device=A.device), base, leaf=leaf)
    return alpha[..., None] * inv, B @ inv


def main(argv=None) -> dict:
    args, cuda = record.stage_arguments(__doc__.splitlines()[0], argv)
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    size = TINY if args.tiny else RELEASE
    frames, grid, H, d = size["frames"], size["grid"], size["heads"], size["head_dim"]
    S, C = grid[0] * grid[1], size["heads"] * size["head_dim"]
    time_it = record.timer(cuda, args.reps)
    result = dict(record.header("branch_stages.py", argv), size=size, ms={}, max_diff={})
    ms, diff = result["ms"], result["max_diff"]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        branch = lb.LinearBranch(size["hidden"], H, d).to(device, dtype)
        for p in branch.parameters():
            p.copy_((torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 1)).to(p.dtype))
        x = torch.randn(frames * S, size["hidden"], generator=g).to(device, dtype)
        q, k, v = (torch.randn(frames * S, H, d, generator=g).to(device, dtype) for _ in range(3))
        bounds = [(lo - 1, hi - 1) for lo, hi in window_bounds(frames + 2, 1, 5)[1 : frames + 1]]
        conv = branch.short_conv
        weights = (conv.k_sp.weight, conv.k_tm.weight, conv.v_sp.weight, conv.v_tm.weight)
        shape = (frames, S, H, d)

        # features
        ms["features plain (q, k, v)"] = time_it(lambda: lb.featurize(q.view(shape), k.view(shape), v.view(shape), grid, weights))
        plain_k = lb.featurize(q.view(shape), k.view(shape), v.view(shape), grid, weights)[1]
        spatial = branch_fused.spatial_conv(k.view(frames, S, C), weights[0], grid)
        ms["spatial conv (channels-last view)"] = time_it(lambda: branch_fused.spatial_conv(k.view(frames, S, C), weights[0], grid))
        # as the model reads it: k a strided slice of the fused projection [F·S, 3, C]
        k_strided = torch.stack([q, k, v], 1).view(frames, S, 3, C)[:, :, 1]
        ms["spatial conv of the projection's slice (cuDNN, after a dense copy)"] = time_it(
            lambda: branch_fused.spatial_conv(k_strided, weights[0], grid))
        dense_k = k.view(frames, S, C)
        with torch.backends.cudnn.flags(enabled=True, benchmark=True):  # cuDNN times its algorithms, keeps the best
            name = "spatial conv, cuDNN benchmark mode"
            ms[name] = time_it(lambda: branch_fused.spatial_conv(dense_k, weights[0], grid))
            diff[name + " vs cuDNN"] = max_diff(branch_fused.spatial_conv(dense_k, weights[0], grid), spatial)
        with torch.backends.cudnn.flags(enabled=False):  # PyTorch's own depthwise kernel
            name = "spatial conv without cuDNN"
            ms[name] = time_it(lambda: branch_fused.spatial_conv(dense_k, weights[0], grid))
            diff[name + " vs cuDNN"] = max_diff(branch_fused.spatial_conv(dense_k, weights[0], grid), spatial)
        # channels-first: the grid copied to [F, C, gh, gw] and back around the convolution
        name = "spatial conv channels-first (layout copies included)"
        first = lambda: torch.nn.functional.conv2d(  # noqa: E731
            dense_k.view(frames, *grid, C).permute(0, 3, 1, 2).contiguous(), weights[0].to(dtype), padding=2,
            groups=C).permute(0, 2, 3, 1).reshape(frames, S, C)
        ms[name] = time_it(first)
        diff[name + " vs cuDNN"] = max_diff(first(), spatial)
        modes = ["eager"] + (["compiled"] if cuda and branch_fused.compiled_branch_available() else [])
        if "compiled" in modes:  # a Triton candidate: rolling output rows over tiles of columns × channels
            import candidate_kernels

            for launch in candidate_kernels.SPATIAL_CONV_LAUNCHES:
                block_x, block_c, warps, hoist = launch
                name = (f"spatial conv, Triton candidate ({block_x} columns × {block_c} channels, {warps} warps, "
                        f"weights {'held' if hoist else 'loaded in the walk'})")
                candidate = lambda launch=launch: candidate_kernels.spatial_conv_rolling(  # noqa: E731
                    dense_k, weights[0], grid, *launch)
                ms[name] = time_it(candidate)
                diff[name + " vs cuDNN"] = max_diff(candidate(), spatial)
        for mode in modes:
            ms[f"temporal + SiLU + L2 ({mode})"] = time_it(
                lambda: branch_fused.run(mode, "conv_features", spatial, weights[1], H, True))
            fused_k = branch_fused.run(mode, "conv_features", spatial, weights[1], H, True)
            diff[f"k features {mode} vs plain"] = max_diff(fused_k.transpose(1, 2), plain_k)

        # frame statistics
        kt = plain_k.transpose(1, 2).contiguous().transpose(1, 2)
        vt = lb.featurize(q.view(shape), k.view(shape), v.view(shape), grid, weights)[2]
        beta = torch.sigmoid(torch.randn(frames, S, H, generator=g)).to(device, dtype)
        ms["statistics fp32"] = time_it(lambda: lb.frame_statistics(kt, vt, beta))
        ms["statistics fp32, 16 frames at a time"] = time_it(lambda: lb.frame_statistics(kt, vt, beta, 16))
        A, B = lb.frame_statistics(kt, vt, beta)
        root = beta.sqrt()[..., None]
        k_scaled, v_scaled = ((t * root).to(dtype).transpose(1, 2).contiguous() for t in (kt, vt))
        ms["statistics Gram of √β-scaled features (half precision, fp32 sums)"] = time_it(
            lambda: branch_fused.gram_statistics(k_scaled, v_scaled))
        diff["statistics Gram vs fp32"] = max_diff(branch_fused.gram_statistics(k_scaled, v_scaled), (A, B))
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = True
            ms["statistics TF32"] = time_it(lambda: lb.frame_statistics(kt, vt, beta))
            diff["statistics TF32 vs fp32"] = max_diff(lb.frame_statistics(kt, vt, beta), (A, B))
            torch.backends.cuda.matmul.allow_tf32 = False

        # the solve's input I + A: the Gram product symmetrised, then I added (two library passes, as it was),
        # against the one compiled pass the fused branch makes (branch_fused.shifted_gram)
        alpha = (torch.rand(frames, H, d, generator=g) * 0.5 + 0.5).to(device)
        eye = torch.eye(d, device=device)
        gram = A + 1e-3 * torch.randn(A.shape, generator=g).to(device)  # as a GEMM leaves it: not quite symmetric
        as_library = lambda: 0.5 * (gram + gram.transpose(-1, -2)) + eye  # noqa: E731
        ms["solve's input: symmetrise, then add I (two library passes, before)"] = time_it(as_library)
        if "compiled" in modes:
            one_pass = lambda m: branch_fused.call("compiled", branch_fused.shifted_gram, m)  # noqa: E731
            ms["solve's input: symmetrise and add I in one compiled pass (library)"] = time_it(lambda: one_pass(gram))
            diff["solve's input: one pass vs two"] = max_diff(one_pass(gram), as_library())
        ms["solve (library: inverse by halves, 16-row blocks)"] = time_it(lambda: lb.solve(alpha, A, B))
        T, J = lb.solve(alpha, A, B)
        T_ref, J_ref = lb.solve_reference(alpha.cpu(), A.cpu(), B.cpu())
        diff["solve (library) vs fp64 reference"] = max_diff((T.cpu(), J.cpu()), (T_ref, J_ref))
        ms["solve through Cholesky and a triangular inverse (before)"] = time_it(lambda: solve_cholesky(alpha, A, B))
        diff["solve through Cholesky vs fp64 reference"] = max_diff(
            [t.cpu() for t in solve_cholesky(alpha, A, B)], (T_ref, J_ref))
        ms["Cholesky alone"] = time_it(lambda: torch.linalg.cholesky_ex(A + eye))
        ms["explicit inverse (inv_ex)"] = time_it(lambda: torch.linalg.inv_ex(A + eye))
        ms["solve through cholesky_inverse"] = time_it(lambda: solve_cholesky_inverse(alpha, A, B))
        for base in (8, 32):
            ms[f"solve by halves, {base}-row blocks"] = time_it(lambda: solve_blocked(alpha, A, B, base))
            diff[f"solve by halves, {base}-row blocks vs library"] = max_diff(solve_blocked(alpha, A, B, base), (T, J))
        leaf = branch_fused.small_inverse("compiled") if cuda else None
        for base in (16, 32, 64) if leaf is not None else ():
            name = f"solve by halves, {base}-row blocks inverted by the Triton leaf kernel"
            with_leaf = lambda base=base: solve_blocked(alpha, A, B, base, leaf)  # noqa: E731
            ms[name] = time_it(with_leaf)
            diff[name + " vs fp64 reference"] = max_diff([t.cpu() for t in with_leaf()], (T_ref, J_ref))
        seed = torch.zeros(H, d, d, device=device)
        ms["scans (prefix + suffix)"] = time_it(lambda: lb.scan(T, J, seed))
        P, Q = lb.scan(T, J, seed)
        if cuda and branch_fused.triton_kernel("scan") is not None:
            from h3_core.models.branch_triton import scan_triton

            # (64 rows, 8 warps) asks for 320 KB of shared memory, over the H200's 227 KB
            for block_v, warps, precision in ((32, 8, "tf32x3"), (16, 4, "tf32x3"), (32, 4, "tf32x3"), (16, 8, "tf32x3"),
                                              (32, 8, "ieee")):
                name = f"scans in one Triton kernel ({block_v} rows, {warps} warps, {precision})"
                ms[name] = time_it(lambda: scan_triton(T, J, seed, block_v, warps, precision))
                diff[name + " vs plain"] = max_diff(scan_triton(T, J, seed, block_v, warps, precision), (P, Q))
        ms["gather"] = time_it(lambda: lb.gather(P, Q, alpha, bounds, seed))
        state = lb.gather(P, Q, alpha, bounds, seed)
        for mode in modes:
            ms[f"gather as the fused branch runs it ({mode})"] = time_it(
                lambda: branch_fused.gather(mode, P, Q, alpha, bounds, seed))
            diff[f"gather {mode} vs plain"] = max_diff(branch_fused.gather(mode, P, Q, alpha, bounds, seed), state)

        # readout
        q_plain = lb.featurize(q.view(shape), k.view(shape), v.view(shape), grid, weights)[0]
        ms["readout einsum (plain)"] = time_it(lambda: torch.einsum("fhvk,fshk->fshv", state.to(dtype), q_plain))
        q_head = q_plain.transpose(1, 2).contiguous()
        ms["readout GEMM on head-major features"] = time_it(lambda: torch.matmul(q_head, state.to(dtype).transpose(-1, -2)))
        logits = torch.randn(frames * S, C, generator=g).to(device, dtype)
        norm_weight = branch.norm.weight

        def three_pass_readout(mode):  # the fused branch's readout before it was one function
            features = branch_fused.run(mode, "query_features", q.view(shape))
            out = torch.matmul(features, state.to(features.dtype).transpose(-1, -2))
            return branch_fused.run(mode, "readout_finish", out, norm_weight, logits)

        for mode in modes:
            ms[f"readout in three passes ({mode}: features, GEMM, finish)"] = time_it(lambda: three_pass_readout(mode))
            ms[f"readout as the fused branch runs it ({mode})"] = time_it(
                lambda: branch_fused.run(mode, "readout", q.view(shape), state, norm_weight, logits))
            diff[f"readout {mode} vs three passes"] = max_diff(
                branch_fused.run(mode, "readout", q.view(shape), state, norm_weight, logits), three_pass_readout(mode))

        # the readout's to_out_linear (bf16) added into the attention's output rows: a GEMM then an add (library),
        # or the GEMM accumulating into the rows (β = 1)
        readout = torch.randn(frames * S, C, generator=g).to(device, dtype)
        to_out = torch.randn(size["hidden"], C, generator=g).div(C**0.5).to(device, dtype)
        attended = torch.randn(frames * S, size["hidden"], generator=g).to(device, dtype)
        ms["copy of the attention's output rows (inside the two to_out_linear timings)"] = time_it(
            lambda: attended.clone())
        then_add = lambda: attended.clone().add_(torch.nn.functional.linear(readout, to_out))  # noqa: E731
        accumulate = lambda: attended.clone().addmm_(readout, to_out.t())  # noqa: E731
        ms["to_out_linear, then added into the output rows (library)"] = time_it(then_add)
        ms["to_out_linear accumulated into the output rows (addmm, candidate)"] = time_it(accumulate)
        diff["to_out_linear accumulated vs added"] = max_diff(accumulate(), then_add())

        # the whole branch
        for mode in [None] + modes:
            branch.fused = mode
            ms[f"whole branch ({mode or 'plain'})"] = time_it(lambda: branch(x, q, k, v, grid, bounds))
        branch.fused = None
        plain = branch(x, q, k, v, grid, bounds)
        for mode in modes:
            branch.fused = mode
            diff[f"whole branch {mode} vs plain"] = max_diff(branch(x, q, k, v, grid, bounds), plain)
        branch.fused = None
    return record.finish(result, args.out, cuda)


if __name__ == "__main__":
    main()
