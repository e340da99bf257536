"""What ptxas gives a Triton kernel on the H200 (sm_90), found on any machine: Triton compiles the kernel for
that target with the toolchain in its wheel, no GPU needed, and ``cuobjdump`` reads the registers a thread,
the stack (spilled registers and local arrays, bytes a thread) and the static shared memory off the cubin;
the PTX shows how wide its global loads and stores are.

A thread with more than 255 registers' worth of live values spills to the stack, and registers above 128
(64 K a multiprocessor) leave room for fewer than four warps of 128 threads — both slow a memory-bound kernel
that needs many loads in flight. ``usage(kernel, signature, constexprs, divisible, warps)`` compiles one
launch: ``signature`` the non-constexpr arguments' Triton types in order (``"*bf16"``, ``"i32"``, ...),
``divisible`` the names of those the launch specialises as multiples of 16 (pointers from PyTorch, strides
like 7168) as Triton does at run time. ``python3 bench/kernel_registers.py`` lists the library's hand-written
kernels at their release-size launches (``LIBRARY``), and the spatial conv candidate's.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)


def usage(kernel, signature: dict[str, str], constexprs: dict, divisible=(), warps: int = 4, target=H200) -> dict:
    """Registers a thread, stack bytes a thread and static shared bytes of ``kernel`` compiled for ``target``, and
    its global loads and stores as written in the PTX, counted by kind and width (whether loads vectorise)."""
    names = list(signature) + [n for n in constexprs if n not in signature]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    sig = dict(signature, **{n: "constexpr" for n in constexprs})
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                              target=target, options={"num_warps": warps})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        text = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    line = next(line for line in text.splitlines() if "REG:" in line)
    fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    # global loads and stores in the PTX by width (b16/b32: one element or pair a thread; v2/v4: 8/16 bytes)
    accesses = collections.Counter(re.findall(r"\b((?:ld|st)\.global(?:\.\w+)*)", compiled.asm["ptx"]))
    return dict(registers=int(fields["REG"]), stack=int(fields["STACK"]), shared=int(fields["SHARED"]),
                global_accesses=dict(sorted(accesses.items())))


def available() -> bool:
    """Whether this Triton can compile for the H200 here (its wheel's ptxas and cuobjdump present)."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return all(os.access(bin_dir / tool, os.X_OK) for tool in ("ptxas", "cuobjdump"))


def _kernel(module: str, name: str):
    import importlib

    return getattr(importlib.import_module(module), name)


# The library's hand-written kernels at the launches the release size gets (bf16 rows, head_dim 128, hidden
# 5,376, inner 7,168, ffn 14,336, 1,008 tokens a frame): (label, module, kernel, {argument: Triton type},
# constexprs, arguments specialised as multiples of 16, warps).
BR, BL, FP = "h3_core.models.branch_triton", "h3_core.models.block_triton", "h3_core.models.fp8_triton"
LIBRARY = (
    ("conv features (k: L2, √β)", BR, "_conv_features_rolling_kernel",
     dict(src="*bf16", taps="*bf16", beta="*bf16", dst="*bf16", n_frames="i32", n_tokens="i32", heads="i32",
          eps="fp32"), dict(HEAD_DIM=128, NORMALIZE=True, HAS_BETA=True, BLOCK_S=32, BLOCK_D=128),
     ("src", "taps", "beta", "dst", "n_tokens"), 4),
    ("readout", BR, "_readout_kernel",
     dict(q_raw="*bf16", state="*bf16", norm_weight="*bf16", logits="*bf16", dst="*bf16", n_tokens="i32",
          heads="i32", s_frame="i32", s_token="i32", eps="fp32"),
     dict(HEAD_DIM=128, BLOCK_S=64, BLOCK_D=128, IEEE=False),
     ("q_raw", "state", "norm_weight", "logits", "dst", "n_tokens", "s_frame", "s_token"), 4),
    ("scan", BR, "_scan_kernel",
     dict(transitions="*fp32", injections="*fp32", seed="*fp32", out="*fp32", n_frames="i32", heads="i32"),
     dict(D=128, BLOCK_V=32, PRECISION="tf32x3"), ("transitions", "injections", "seed", "out"), 8),
    ("leaf inverse (16 rows)", BR, "_small_inverse_kernel",
     dict(src="*fp32", dst="*fp32", n_mats="i32", n="i32", s_sb="i32", s_sr="i32", s_sc="i32", s_db="i32",
          s_dr="i32", s_dc="i32"), dict(N=16, BLOCK_M=16), ("src", "dst", "n", "s_sr", "s_dr"), 4),
    ("q/k norm + RoPE", BL, "_qk_norm_rope_kernel",
     dict(src="*bf16", dst="*bf16", weight="*bf16", cos="*fp32", sin="*fp32", n_rows="i32", heads="i32",
          heads_per_program="i32", n_rot="i32", s_row="i32", s_head="i32", eps="fp32"),
     dict(HEAD_DIM=128, ROTATE=True, BLOCK_T=8, BLOCK_D=128), ("src", "dst", "weight", "cos", "sin", "n_rot",
                                                                "s_row", "s_head"), 4),
    ("residual + norm + modulation + quantise (fc1's input)", BL, "_block_norm_kernel",
     dict(x="*bf16", y="*bf16", gate="*bf16", weight="*bf16", shift="*bf16", scale="*bf16", table_rows="*i64",
          out="*fp8e4nv", scales="*fp32", hidden="i32", eps="fp32", smallest="fp32"),
     dict(BLOCK_K=512, RESIDUAL=True, QUANTIZE=True),
     ("x", "y", "gate", "weight", "shift", "scale", "table_rows", "out", "scales", "hidden"), 4),
    ("SiLU·up in place (bf16 FFN)", BL, "_swiglu_kernel",
     dict(gate_up="*bf16", n_rows="i32", ffn="i32", s_row="i32"), dict(BLOCK_R=4, BLOCK_C=1024),
     ("gate_up", "ffn", "s_row"), 4),
    ("softmax gate + quantise (out_proj's input)", FP, "_quantize_chunked_kernel",
     dict(src="*bf16", gate="*bf16", codes="*fp8e4nv", scales="*fp32", n_cols="i32", s_row="i32", s_gate="i32",
          head_dim="i32", smallest="fp32"), dict(BLOCK_K=1024, GATED=True),
     ("src", "gate", "codes", "scales", "n_cols", "s_row", "head_dim"), 4),
    ("SiLU·up + quantise (fc2's input)", FP, "_swiglu_quantize_kernel",
     dict(src="*bf16", codes="*fp8e4nv", scales="*fp32", ffn="i32", s_row="i32", smallest="fp32"),
     dict(BLOCK=16384), ("src", "codes", "scales", "ffn", "s_row"), 32),
    ("fp16 staging (scaled, saturated)", "h3_core.attention.convert_triton", "_convert_kernel",
     dict(src="*bf16", dst="*fp16", scale="*fp32", n_rows="i32", head_dim="i32", s_sn="i32", s_sh="i32",
          s_dn="i32", s_dh="i32", limit="fp32"), dict(HAS_SCALE=True, SATURATE=True, BLOCK_N=32, BLOCK_D=128),
     ("src", "dst", "scale", "head_dim", "s_sn", "s_sh", "s_dn", "s_dh"), 4),
)


def library_launches():
    for label, module, name, signature, constexprs, divisible, warps in LIBRARY:
        yield label, _kernel(module, name), signature, constexprs, divisible, warps


def spatial_conv_launches():
    """The spatial conv candidate at the launches ``branch_stages.py`` times."""
    import candidate_kernels

    signature = {"src": "*bf16", "weight": "*fp32", "dst": "*bf16", "grid_h": "i32", "grid_w": "i32",
                 "channels": "i32", "s_frame": "i32", "s_token": "i32"}
    divisible = ("src", "weight", "dst", "channels", "s_frame", "s_token")
    for block_x, block_c, warps, hoist in candidate_kernels.SPATIAL_CONV_LAUNCHES:
        weights = "held" if hoist else "in the walk"
        name = f"spatial conv candidate, {block_x} × {block_c}, {warps} warps, weights {weights}"
        yield name, candidate_kernels._spatial_conv_rolling_kernel, signature, dict(
            BLOCK_X=block_x, BLOCK_C=block_c, HOIST=hoist), divisible, warps


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = dict(record.header("kernel_registers.py", argv), triton=triton.__version__, target="cuda sm_90 (H200)",
                  kernels={})
    for name, kernel, signature, constexprs, divisible, warps in (*library_launches(), *spatial_conv_launches()):
        result["kernels"][name] = usage(kernel, signature, constexprs, divisible, warps)
    print(record.write(result, args.out))
    return result


if __name__ == "__main__":
    main()
