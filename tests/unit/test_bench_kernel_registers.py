"""bench/kernel_registers.py: Triton kernels compiled for the H200 on this machine, their registers read back."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import kernel_registers  # noqa: E402

pytestmark = pytest.mark.skipif(not kernel_registers.available(), reason="needs Triton's NVIDIA toolchain")


def test_a_library_kernel_and_the_spilling_candidate_launch():
    label, kernel, signature, constexprs, divisible, warps = next(
        launch for launch in kernel_registers.library_launches() if launch[0].startswith("SiLU·up in place"))
    small = kernel_registers.usage(kernel, signature, constexprs, divisible, warps)
    assert 0 < small["registers"] <= 128 and small["stack"] == 0
    # 4 rows × 1,024 columns of bf16 over 128 threads: 16-byte loads and stores
    accesses = small["global_accesses"]
    assert accesses.get("ld.global.v4.b32", 0) > 0 and accesses.get("st.global.v4.b32", 0) > 0
    # eight channels a thread at one column hold 200 registers of weights: the candidate's first launch spills
    name, kernel, signature, constexprs, divisible, warps = next(kernel_registers.spatial_conv_launches())
    assert constexprs == dict(BLOCK_X=16, BLOCK_C=64, HOIST=True) and warps == 4
    held = kernel_registers.usage(kernel, signature, constexprs, divisible, warps)
    assert held["registers"] == 255 and held["stack"] > 0
    # the same walk with its weights loaded as used and a thread over fewer channels does not
    lean = kernel_registers.usage(kernel, signature, dict(BLOCK_X=16, BLOCK_C=16, HOIST=False), divisible, 4)
    assert lean["registers"] < 128 and lean["stack"] == 0
