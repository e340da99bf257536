"""The block's hand-written Triton kernels on a CUDA GPU (skipped without one) against the written functions
of h3_core.models.block_fused, at the model's head size."""

import pytest
import torch

from h3_core.models import block_fused

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary", [96, None])
def test_triton_qk_norm_rope_matches_the_written_function(dtype, rotary):
    if block_fused._triton_kernel("qk_norm_rope") is None:
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(1500, 3, 8, 128, generator=g) * 3).to(DEV, dtype)
    weight = torch.randn(128, generator=g).to(DEV, dtype)
    cos = sin = None
    if rotary:
        angles = torch.randn(1500, rotary // 2, generator=g).repeat(1, 2)
        cos, sin = angles.cos().to(DEV), angles.sin().to(DEV)
    for x in (qkv[:, 0], qkv[:, 1]):
        got = block_fused.run("compiled", "qk_norm_rope", x, weight, cos, sin, 1e-6)
        want = block_fused.run("eager", "qk_norm_rope", x, weight, cos, sin, 1e-6)
        assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
        if dtype == torch.float32:
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        else:  # one fp32 result rounded once by both: one bf16 step apart, or fp32 roundoff where the
            # rotation's two products cancel
            got, want = got.float(), want.float()
            assert ((got - want).abs() <= want.abs() * 2**-7 + 1e-5 * want.abs().max()).all()
