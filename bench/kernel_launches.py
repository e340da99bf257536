"""The library's hand-written Triton kernels at the release size, each under several launches (tile sizes and
warps) beside the launch the library makes, timed (median of ``--reps`` CUDA-event timings after a warm-up)
and checked against it. The numbers of a kernel do not depend
on its launch, so the fastest launch can be adopted from this table alone. ``--tiny`` runs every launch on a
small geometry on the CPU, for Triton's interpreter (``TRITON_INTERPRET=1``): a dry run of the code.
``--only`` runs some of the parts (``PARTS``): the kernels' inputs at the release size take most of a run.

    python3 bench/kernel_launches.py --out results.json
    python3 bench/kernel_launches.py --only readout --out results.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

from h3_core.attention.layout import window_bounds
from h3_core.models import block_triton as _block_triton
from h3_core.models import branch_triton as _branch_triton
from h3_core.models.fp8_linear import _SMALLEST_SCALE
from h3_core.models.fp8_triton import gate_heads_quantize_triton, quantize_rows_triton, swiglu_quantize_triton

# rows, heads, head size, hidden and FFN widths; the branch's frames (all but the two anchors) and their tokens
RELEASE = dict(rows=104266, heads=56, head_dim=128, hidden=5376, ffn=14336, frames=100, tokens=1008)
TINY = dict(rows=40, heads=2, head_dim=16, hidden=48, ffn=40, frames=4, tokens=20)
PARTS = ("rope", "conv", "readout", "states", "quantisers")


def max_diff(a, b) -> float:
    a = a if isinstance(a, torch.Tensor) else torch.cat([t.flatten().float() for t in a])
    b = b if isinstance(b, torch.Tensor) else torch.cat([t.flatten().float() for t in b])
    return float((a.float() - b.float()).abs().max())


def main(argv=None) -> dict:
    args, cuda = record.stage_arguments(__doc__.splitlines()[0], argv, PARTS)
    parts = args.only or PARTS
    if not cuda and not args.tiny:
        raise SystemExit("kernel_launches.py times CUDA kernels: run it on a GPU (or --tiny under the interpreter)")
    size = TINY if args.tiny else RELEASE
    ROWS, HEADS, HEAD_DIM, HIDDEN, FFN, FRAMES, TOKENS = (
        size[k] for k in ("rows", "heads", "head_dim", "hidden", "ffn", "frames", "tokens")
    )
    device = "cuda" if cuda else "cpu"
    time_it = record.timer(cuda, args.reps)
    result = dict(record.header("kernel_launches.py", argv), ms={}, max_diff={})
    ms, diff = result["ms"], result["max_diff"]
    g = torch.Generator().manual_seed(0)

    def variants(kernel: str, library, launches: dict):
        """Time the library's launch and each named alternative; record each one's difference from it."""
        want = library()
        ms[f"{kernel}: library"] = time_it(library)
        for name, launch in launches.items():
            ms[f"{kernel}: {name}"] = time_it(launch)
            diff[f"{kernel}: {name}"] = max_diff(launch(), want)

    def randn(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    with torch.no_grad():
        if "rope" in parts:
            # q/k norm + RoPE on q of the projection, 96 of 128 channels rotated
            q = randn(ROWS, HEADS, HEAD_DIM, scale=3.0)
            weight = randn(HEAD_DIM)
            angles = torch.randn(ROWS, HEAD_DIM * 3 // 8, generator=g).repeat(1, 2)
            cos, sin = angles.cos().to(device), angles.sin().to(device)
            rope = lambda **kw: _block_triton.qk_norm_rope_triton(q, weight, cos, sin, 1e-6, **kw)  # noqa: E731
            variants(
                "q/k norm + RoPE",
                rope,
                {
                    f"{t} rows, {w} warps": (lambda t=t, w=w: rope(block_t=t, warps=w))
                    for t, w in ((16, 4), (4, 4), (8, 8), (32, 8))
                },
            )
            del q

        if "conv" in parts:
            # the branch's temporal conv + SiLU + L2 + √β on k
            y = randn(FRAMES, TOKENS, HEADS * HEAD_DIM)
            taps = randn(HEADS * HEAD_DIM, 1, 5, scale=0.5)
            beta = torch.sigmoid(torch.randn(FRAMES, TOKENS, HEADS, generator=g)).to(device, torch.bfloat16)
            conv = lambda **kw: _branch_triton.conv_features_triton(y, taps, HEADS, True, beta, **kw)  # noqa: E731
            variants(
                "conv features",
                conv,
                {
                    f"{s} tokens, {w} warps": (lambda s=s, w=w: conv(block_s=s, warps=w))
                    for s, w in ((8, 4), (32, 4), (32, 8), (64, 8))
                },
            )
            del y

        if "readout" in parts:
            # the readout from q of the projection, each frame's state and the gate's pre-activations
            q_raw = randn(FRAMES * TOKENS, 3, HEADS, HEAD_DIM)[:, 0].view(FRAMES, TOKENS, HEADS, HEAD_DIM)
            state = torch.randn(FRAMES, HEADS, HEAD_DIM, HEAD_DIM, generator=g).to(device) / 8
            norm_weight, logits = randn(HEAD_DIM), randn(FRAMES * TOKENS, HEADS * HEAD_DIM)
            readout = lambda **kw: _branch_triton.readout_triton(q_raw, state, norm_weight, logits, **kw)  # noqa: E731
            variants(
                "readout",
                readout,
                {
                    f"{s} tokens, {w} warps": (lambda s=s, w=w: readout(block_s=s, warps=w))
                    for s, w in ((32, 4), (64, 8), (128, 8))
                },
            )
            del q_raw, logits

        if "states" in parts:
            # the scans and the gather on fp32 states
            T = torch.randn(FRAMES, HEADS, HEAD_DIM, HEAD_DIM, generator=g).to(device) / HEAD_DIM
            J = torch.randn(FRAMES, HEADS, HEAD_DIM, HEAD_DIM, generator=g).to(device)
            seed = torch.randn(HEADS, HEAD_DIM, HEAD_DIM, generator=g).to(device)
            variants(
                "scans",
                lambda: _branch_triton.scan_triton(T, J, seed),
                {
                    f"{v} rows, {w} warps": (lambda v=v, w=w: _branch_triton.scan_triton(T, J, seed, v, w))
                    for v, w in ((16, 8), (32, 16))
                },
            )
            alpha = (torch.rand(FRAMES, HEADS, HEAD_DIM, generator=g) * 0.3 + 0.7).to(device)
            bounds = [(lo - 1, hi - 1) for lo, hi in window_bounds(FRAMES + 2, 1, 5)[1 : FRAMES + 1]]
            variants(
                "gather",
                lambda: _branch_triton.gather_triton(T, J, alpha, bounds, seed),
                {
                    f"{v} rows, {w} warps": (
                        lambda v=v, w=w: _branch_triton.gather_triton(T, J, alpha, bounds, seed, v, w)
                    )
                    for v, w in ((16, 4), (32, 4), (16, 8), (64, 8))
                },
            )
            del T, J

        if "quantisers" in parts:
            # the row quantisers: plain rows at the hidden width, the FFN's input normed and modulated, out_proj's
            # input gated per head; each in chunks, and with the whole row in one chunk (as the earlier row-at-once
            # kernels held it)
            chunks = ((256, 2), (512, 4), (1024, 4), (1024, 8), (2048, 8), (8192, 8), (8192, 16))

            def chunked(kernel):  # the launches of a chunked kernel that takes block_k and warps
                return {f"{k} × {w} warps": (lambda k=k, w=w: kernel(block_k=k, warps=w)) for k, w in chunks}

            x = randn(ROWS, HIDDEN)
            rows = lambda **kw: quantize_rows_triton(x, _SMALLEST_SCALE, **kw)  # noqa: E731
            variants("quantise rows (5,376)", rows, chunked(rows))
            weight, shift, scale = randn(HIDDEN), randn(6, HIDDEN), randn(6, HIDDEN)
            table_rows = torch.randint(0, 6, (ROWS,), generator=g).to(device)
            norm = lambda **kw: _block_triton.block_norm_triton(  # noqa: E731
                x, weight, shift, scale, table_rows, 1e-6, smallest=_SMALLEST_SCALE, **kw
            )
            variants("norm + modulation + quantise (5,376)", norm, chunked(norm))
            plain_norm = lambda **kw: _block_triton.block_norm_triton(  # noqa: E731
                x, weight, shift, scale, table_rows, 1e-6, **kw
            )
            variants("norm + modulation (5,376)", plain_norm, chunked(plain_norm))
            # after the residual, which the kernel writes into y: each call on a copy of y (its time included)
            y, gate1 = randn(ROWS, HIDDEN), randn(6, HIDDEN)
            residual = lambda **kw: _block_triton.block_norm_triton(  # noqa: E731
                x, weight, shift, scale, table_rows, 1e-6, y.clone(), gate1, smallest=_SMALLEST_SCALE, **kw
            )
            variants("residual + norm + modulation + quantise (5,376, with a copy of y)", residual, chunked(residual))
            del x, y
            soft, gate = randn(ROWS, HEADS, HEAD_DIM), randn(ROWS, HEADS)
            gated = lambda **kw: gate_heads_quantize_triton(soft, gate, _SMALLEST_SCALE, **kw)  # noqa: E731
            variants("softmax gate + quantise (7,168)", gated, chunked(gated))
            del soft
            gate_up = randn(ROWS, 2 * FFN)
            variants(
                "SiLU·up + quantise",
                lambda: swiglu_quantize_triton(gate_up, _SMALLEST_SCALE),
                {
                    f"{w} warps": (lambda w=w: swiglu_quantize_triton(gate_up, _SMALLEST_SCALE, warps=w))
                    for w in (8, 16)
                },
            )
    return record.finish(result, args.out, cuda)


if __name__ == "__main__":
    main()
