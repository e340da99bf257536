"""The library's hand-written Triton kernels at the release size, each under several launches (tile sizes and
warps) beside the launch the library makes on this card (``h3_core.launch_table``) and beside its plain form (what
runs where the kernel is not kept: the ``torch.compile``d function, cuDNN's convolution, the library's batched
inverse), timed (median of ``--reps`` CUDA-event timings after a warm-up) and checked against the library's
launch. The numbers of a kernel do not depend on its launch, so the fastest launch can be adopted from this table
alone; ``row`` ends the output: per kernel the fastest launch and whether it beat the plain form, the entry
``launch_table.ARCHITECTURES`` takes for this card's capability. ``--tiny`` runs every launch on a small geometry
on the CPU, for Triton's interpreter (``TRITON_INTERPRET=1``): a dry run of the code. ``--only`` runs some of the
parts (``PARTS``). Not timed here: the decoder's halves (``bench/decoder_paths.py``) and the attention's
scale-and-convert pass (``bench/fp8_attention.py``).

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

from h3_core import launch_table
from h3_core.attention.layout import window_bounds
from h3_core.models import block_fused, branch_fused, branch_math
from h3_core.models import block_triton as _block_triton
from h3_core.models import branch_triton as _branch_triton
from h3_core.models import fp8_triton as _fp8_triton
from h3_core.models.fp8_linear import _SMALLEST_SCALE, quantize_input, quantize_rows_reference

# rows, heads, head size, hidden and FFN widths; the branch's frames (all but the two anchors), their tokens and
# grid; the solve's leaves (16 × 16 blocks of each frame's and head's 128 × 128 matrix)
RELEASE = dict(rows=104266, heads=56, head_dim=128, hidden=5376, ffn=14336, frames=100, tokens=1008, grid=(24, 42))
TINY = dict(rows=40, heads=2, head_dim=16, hidden=48, ffn=40, frames=4, tokens=20, grid=(4, 5))
PARTS = ("rope", "conv", "readout", "states", "solve", "quantisers", "block")
SAME = 0.03  # a launch is taken over the written one only when it is this much faster


def max_diff(a, b) -> float:
    a = a if isinstance(a, torch.Tensor) else torch.cat([t.flatten().float() for t in a])
    b = b if isinstance(b, torch.Tensor) else torch.cat([t.flatten().float() for t in b])
    return float((a.float() - b.float()).abs().max())


def compiled(fn):
    """``fn`` through ``torch.compile`` as ``"compiled"`` mode runs it where no kernel is handed out (on the CPU
    dry run, as written)."""
    mode = "compiled" if torch.cuda.is_available() else None
    return lambda *args: branch_fused.call(mode, fn, *args)


def main(argv=None) -> dict:
    args, cuda = record.stage_arguments(__doc__.splitlines()[0], argv, PARTS)
    parts = args.only or PARTS
    if not cuda and not args.tiny:
        raise SystemExit("kernel_launches.py times CUDA kernels: run it on a GPU (or --tiny under the interpreter)")
    size = TINY if args.tiny else RELEASE
    ROWS, HEADS, HEAD_DIM, HIDDEN, FFN, FRAMES, TOKENS, GRID = (
        size[k] for k in ("rows", "heads", "head_dim", "hidden", "ffn", "frames", "tokens", "grid")
    )
    device = "cuda" if cuda else "cpu"
    capability = tuple(torch.cuda.get_device_capability()) if cuda else None
    time_it = record.timer(cuda, args.reps)
    result = dict(record.header("kernel_launches.py", argv), capability=capability, ms={}, max_diff={}, row={})
    ms, diff, row = result["ms"], result["max_diff"], result["row"]
    g = torch.Generator().manual_seed(0)

    def variants(label: str, kernel: str, call, launches: dict, plain=None):
        """Time ``call`` under the library's launch on this card and under each of ``launches`` (name → keyword
        arguments), each one's difference from the library's, then ``plain``; note the kernel's row."""
        library = dict(launch_table.launch(kernel.split(" (")[0], capability) or {})
        want = call(**library)
        ms[f"{label}: library"] = library_ms = time_it(lambda: call(**library))
        best, best_ms = library, library_ms
        for name, launch in launches.items():
            ms[f"{label}: {name}"] = t = time_it(lambda launch=launch: call(**launch))
            diff[f"{label}: {name}"] = max_diff(call(**launch), want)
            if t < best_ms * (1 - SAME) and diff[f"{label}: {name}"] == 0:
                best, best_ms = launch, t
        plain_ms = ms[f"{label}: plain"] = time_it(plain) if plain is not None else None
        row[kernel] = dict(
            launch=best, ms=best_ms, plain_ms=plain_ms, kept=plain_ms is None or best_ms < plain_ms, label=label
        )
        if args.out is not None:  # what is measured so far survives a run stopped before its end
            record.write(dict(result, table_row=table_row(row)), args.out)

    def randn(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    def chunked(widths=((256, 2), (512, 4), (1024, 4), (1024, 8), (2048, 8), (8192, 8), (8192, 16))):
        return {f"{k} × {w} warps": dict(block_k=k, warps=w) for k, w in widths}

    with torch.no_grad():
        if "rope" in parts:
            # q/k norm + RoPE on q of the projection, 96 of 128 channels rotated
            q = randn(ROWS, HEADS, HEAD_DIM, scale=3.0)
            weight = randn(HEAD_DIM)
            angles = torch.randn(ROWS, HEAD_DIM * 3 // 8, generator=g).repeat(1, 2)
            cos, sin = angles.cos().to(device), angles.sin().to(device)
            variants(
                "q/k norm + RoPE",
                "qk_norm_rope_triton",
                lambda **kw: _block_triton.qk_norm_rope_triton(q, weight, cos, sin, 1e-6, **kw),
                {f"{t} rows, {w} warps": dict(block_t=t, warps=w) for t, w in ((16, 4), (4, 4), (8, 8), (32, 8))},
                lambda: compiled(block_fused.qk_norm_rope)(q, weight, cos, sin, 1e-6),
            )
            del q

        if "conv" in parts:
            # the branch's temporal conv + SiLU + L2 + √β on k; the spatial 5×5 conv before it
            y = randn(FRAMES, TOKENS, HEADS * HEAD_DIM)
            taps = randn(HEADS * HEAD_DIM, 1, 5, scale=0.5)
            beta = torch.sigmoid(torch.randn(FRAMES, TOKENS, HEADS, generator=g)).to(device, torch.bfloat16)
            variants(
                "conv features",
                "conv_features_triton",
                lambda **kw: _branch_triton.conv_features_triton(y, taps, HEADS, True, beta, **kw),
                {f"{s} tokens, {w} warps": dict(block_s=s, warps=w) for s, w in ((8, 4), (32, 4), (32, 8), (64, 8))},
                lambda: compiled(branch_fused.conv_features)(y, taps, HEADS, True, beta),
            )
            spatial = randn(HEADS * HEAD_DIM, 1, 5, 5, scale=0.2)
            variants(
                "spatial 5×5 conv",
                "spatial_conv_triton",
                lambda **kw: _branch_triton.spatial_conv_triton(y, spatial, GRID, **kw),
                {f"{c} channels, {w} warps": dict(block_c=c, warps=w) for c, w in ((32, 1), (64, 2), (128, 4))},
                lambda: branch_fused.spatial_conv(y, spatial, GRID),
            )
            del y

        if "readout" in parts:
            # the readout from q of the projection, each frame's state and the gate's pre-activations
            q_raw = randn(FRAMES * TOKENS, 3, HEADS, HEAD_DIM)[:, 0].view(FRAMES, TOKENS, HEADS, HEAD_DIM)
            state = torch.randn(FRAMES, HEADS, HEAD_DIM, HEAD_DIM, generator=g).to(device) / 8
            norm_weight, logits = randn(HEAD_DIM), randn(FRAMES * TOKENS, HEADS * HEAD_DIM)
            variants(
                "readout",
                "readout_triton",
                lambda **kw: _branch_triton.readout_triton(q_raw, state, norm_weight, logits, **kw),
                {f"{s} tokens, {w} warps": dict(block_s=s, warps=w) for s, w in ((32, 4), (64, 8), (128, 8))},
                lambda: compiled(branch_fused.readout)(q_raw, state, norm_weight, logits),
            )
            del q_raw, logits

        if "states" in parts:
            # the scans and the gather on fp32 states
            T = torch.randn(FRAMES, HEADS, HEAD_DIM, HEAD_DIM, generator=g).to(device) / HEAD_DIM
            J = torch.randn(FRAMES, HEADS, HEAD_DIM, HEAD_DIM, generator=g).to(device)
            seed = torch.randn(HEADS, HEAD_DIM, HEAD_DIM, generator=g).to(device)
            variants(
                "scans",
                "scan_triton",
                lambda **kw: _branch_triton.scan_triton(T, J, seed, **kw),
                {f"{v} rows, {w} warps": dict(block_v=v, warps=w) for v, w in ((16, 8), (32, 16))},
                lambda: branch_math.scan(T, J, seed),
            )
            alpha = (torch.rand(FRAMES, HEADS, HEAD_DIM, generator=g) * 0.3 + 0.7).to(device)
            bounds = [(lo - 1, hi - 1) for lo, hi in window_bounds(FRAMES + 2, 1, 5)[1 : FRAMES + 1]]
            variants(
                "gather",
                "gather_triton",
                lambda **kw: _branch_triton.gather_triton(T, J, alpha, bounds, seed, **kw),
                {f"{v} rows, {w} warps": dict(block_v=v, warps=w) for v, w in ((16, 4), (32, 4), (16, 8), (64, 8))},
                lambda: branch_math.gather(T, J, alpha, bounds, seed),
            )
            del T, J

        if "solve" in parts:
            # I + ½(A + Aᵀ) of each frame's and head's Gram product; the inverses of the solve's 16 × 16 leaves
            A = torch.randn(FRAMES, HEADS, HEAD_DIM, HEAD_DIM, generator=g).to(device)
            variants(
                "shifted Gram",
                "shifted_gram_triton",
                lambda **kw: _branch_triton.shifted_gram_triton(A, **kw),
                {f"{b} tiles": dict(block=b) for b in (16, 64)},
                lambda: compiled(branch_fused.shifted_gram)(A),
            )
            leaves = torch.randn(FRAMES * HEADS * (HEAD_DIM // 16), 16, 16, generator=g)
            M = (leaves @ leaves.transpose(-1, -2) + 16 * torch.eye(16)).to(device)
            out = torch.empty_like(M)
            variants(
                "leaf inverses",
                "small_inverse_triton",
                lambda: _branch_triton.small_inverse_triton(M, out).clone(),
                {},
                lambda: torch.linalg.inv(M),
            )
            del A, M, out

        if "quantisers" in parts:
            # the row quantisers: plain rows at the hidden width, the FFN's input normed and modulated, out_proj's
            # input gated per head; each in chunks, and with the whole row in one chunk
            x = randn(ROWS, HIDDEN)
            variants(
                "quantise rows (5,376)",
                "quantize_rows_triton",
                lambda **kw: _fp8_triton.quantize_rows_triton(x, _SMALLEST_SCALE, **kw),
                chunked(),
                lambda: quantize_rows_reference(x),
            )
            weight, shift, scale = randn(HIDDEN), randn(6, HIDDEN), randn(6, HIDDEN)
            table_rows = torch.randint(0, 6, (ROWS,), generator=g).to(device)
            norm_args = (x, weight, shift, scale, table_rows, 1e-6)
            variants(
                "norm + modulation + quantise (5,376)",
                "block_norm_triton",
                lambda **kw: _block_triton.block_norm_triton(*norm_args, smallest=_SMALLEST_SCALE, **kw),
                chunked(),
                lambda: quantize_input(compiled(block_fused.norm_modulate)(*norm_args)),
            )
            soft, gate = randn(ROWS, HEADS, HEAD_DIM), randn(ROWS, HEADS)
            # the plain form gates in place: on a copy, its time included
            variants(
                "softmax gate + quantise (7,168)",
                "gate_heads_quantize_triton",
                lambda **kw: _fp8_triton.gate_heads_quantize_triton(soft, gate, _SMALLEST_SCALE, **kw),
                chunked(),
                lambda: quantize_input(compiled(block_fused.gate_heads_)(soft.clone(), gate).reshape(ROWS, -1)),
            )
            del soft
            gate_up = randn(ROWS, 2 * FFN)
            variants(
                "SiLU·up + quantise",
                "swiglu_quantize_triton",
                lambda **kw: _fp8_triton.swiglu_quantize_triton(gate_up, _SMALLEST_SCALE, **kw),
                {f"{w} warps": dict(warps=w) for w in (8, 16, 32)},
                lambda: quantize_input(compiled(block_fused.swiglu_)(gate_up.clone())),
            )
            del gate_up, x

        if "block" in parts:
            # the bf16 block's in-place passes, each on a copy of what it writes (the copy's time included in
            # every form); the norm unquantised, alone and after the residual
            x, y = randn(ROWS, HIDDEN), randn(ROWS, HIDDEN)
            weight, shift, scale, gate1 = randn(HIDDEN), randn(6, HIDDEN), randn(6, HIDDEN), randn(6, HIDDEN)
            table_rows = torch.randint(0, 6, (ROWS,), generator=g).to(device)
            norm_args = (x, weight, shift, scale, table_rows, 1e-6)
            variants(
                "norm + modulation (5,376)",
                "block_norm_triton (bf16)",
                lambda **kw: _block_triton.block_norm_triton(*norm_args, **kw),
                chunked(),
                lambda: compiled(block_fused.norm_modulate)(*norm_args),
            )
            variants(
                "residual, then norm + modulation (5,376)",
                "block_norm_triton (residual)",
                lambda **kw: _block_triton.block_norm_triton(*norm_args, y.clone(), gate1, **kw),
                chunked(),
                lambda: compiled(block_fused.norm_modulate)(
                    compiled(block_fused.gated_residual_)(x, y.clone(), gate1, table_rows), *norm_args[1:]
                ),
            )
            variants(
                "gated residual (5,376)",
                "gated_residual_triton",
                lambda **kw: _block_triton.gated_residual_triton(x, y.clone(), gate1, table_rows, **kw),
                {
                    f"{r} × {c}, {w} warps": dict(block_r=r, block_c=c, warps=w)
                    for r, c, w in ((8, 1024, 4), (4, 2048, 8))
                },
                lambda: compiled(block_fused.gated_residual_)(x, y.clone(), gate1, table_rows),
            )
            del y
            soft, gate = randn(ROWS, HEADS, HEAD_DIM), randn(ROWS, HEADS)
            variants(
                "softmax gate",
                "gate_heads_triton",
                lambda **kw: _block_triton.gate_heads_triton(soft.clone(), gate, **kw),
                {f"{r} rows, {w} warps": dict(block_r=r, warps=w) for r, w in ((8, 4), (32, 8))},
                lambda: compiled(block_fused.gate_heads_)(soft.clone(), gate),
            )
            del soft
            gate_up = randn(ROWS, 2 * FFN)
            variants(
                "SiLU·up",
                "swiglu_triton",
                lambda **kw: _block_triton.swiglu_triton(gate_up.clone(), **kw),
                {
                    f"{r} × {c}, {w} warps": dict(block_r=r, block_c=c, warps=w)
                    for r, c, w in ((8, 1024, 4), (4, 2048, 8))
                },
                lambda: compiled(block_fused.swiglu_)(gate_up.clone()),
            )
    result["table_row"] = table_row(row)
    return record.finish(result, args.out, cuda)


def table_row(row: dict) -> dict:
    """The entry ``launch_table.ARCHITECTURES`` takes from ``row``: the kernels that lost to their plain form and
    the launches that replace the written ones. A kernel timed in several uses (the block norm) is dropped only
    where it lost in every one, and keeps its written launch unless one launch won in all of them."""
    uses: dict[str, list[dict]] = {}
    for key, entry in row.items():
        uses.setdefault(key.split(" (")[0], []).append(entry)
    dropped = sorted(k for k, entries in uses.items() if not any(e["kept"] for e in entries))
    launches = {}
    for kernel, entries in uses.items():
        chosen = [e["launch"] for e in entries]
        if kernel not in dropped and chosen[0] and all(c == chosen[0] for c in chosen):
            launches[kernel] = chosen[0]
    return dict(dropped=dropped, launches=launches)


if __name__ == "__main__":
    main()
