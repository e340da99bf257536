"""On CUDA, AdaLN projections kept in host memory free their device memory and give the same run (skipped
without CUDA)."""

import pytest
import torch

from h3_core.models.adaln_tables import keep_adaln_on_host
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.pipeline.generate import generate
from h3_core.pipeline.prompt import from_conditioning
from h3_core.pipeline.request import ClipRequest, Runner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CFG = DiTConfig(
    hidden=512, layers=4, heads=4, head_dim=128, ffn=1024, time_embed=512, time_hidden=512, rope_freqs=16, hybrid=True
)


def model():
    torch.manual_seed(0)
    m = H3DiT(CFG).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.02)
    return m.cuda()


def test_projections_leave_the_device_and_the_run_is_unchanged():
    prompt = from_conditioning(torch.randn(1, 8, CFG.text_dim, generator=torch.Generator().manual_seed(1)))
    request, on_gpu = ClipRequest(frames=39, width=256, height=128, steps=3, seed=2), Runner(device="cuda")
    plain = model()
    with torch.no_grad():
        want = generate(plain, prompt, request, on_gpu)
    del plain
    hosted = model()
    before = torch.cuda.memory_allocated()
    moved = keep_adaln_on_host(hosted)
    torch.cuda.synchronize()
    expected = sum(p.numel() * p.element_size() for b in hosted.blocks for p in b.adaln_proj.parameters())
    assert moved == expected and before - torch.cuda.memory_allocated() >= expected
    assert all(p.device.type == "cpu" and p.is_pinned() for b in hosted.blocks for p in b.adaln_proj.parameters())
    with torch.no_grad():
        got = generate(hosted, prompt, request, on_gpu)
    # each projection visited the device to make the run's tables and went back to the host
    torch.cuda.synchronize()
    assert all(p.device.type == "cpu" and p.is_pinned() for b in hosted.blocks for p in b.adaln_proj.parameters())
    assert torch.cuda.memory_allocated() < before - expected + 2**20
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
