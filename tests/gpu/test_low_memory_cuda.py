"""On CUDA the lower-memory paths take less memory and give the plain block's output (skipped without CUDA)."""

import pytest
import torch

from h3_core.models.dit import Block, DiTConfig, rope_cos_sin, rope_inv_freq
from h3_core.models.hybrid import RELEASE_WINDOW, HybridContext
from h3_core.models.low_memory import LowMemory
from h3_core.models.run_options import PLAIN, RunOptions
from h3_core.pipeline.packing import pack_sequence

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = torch.device("cuda")
CFG = DiTConfig(hidden=1024, heads=8, head_dim=128, ffn=4096, time_embed=64, rope_freqs=16)


def setup(hybrid):
    """A block of the released head size on 27 frames of 48×64 latents (24×32 patches; T ≈ 21k rows)."""
    packed = pack_sequence(torch.ones(64, dtype=torch.long), 27, 48, 64, 120)
    g = torch.Generator().manual_seed(0)
    block = Block(DiTConfig(**{**CFG.__dict__, "hybrid": hybrid}))
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] if p.dim() > 1 else 1) ** 0.5)
    block = block.to(DEV, torch.bfloat16).eval()
    T = packed.positions.shape[0]
    x = torch.randn(T, CFG.hidden, generator=g).to(DEV, torch.bfloat16)
    temb = torch.randn(1, CFG.time_embed, generator=g).to(DEV)
    rope = rope_cos_sin(packed.positions.to(DEV), rope_inv_freq(CFG).to(DEV))
    ctx = HybridContext(packed.layout, RELEASE_WINDOW, "auto", (0, 64)) if hybrid else None
    return block, (x, temb, packed.tags.to(DEV), rope, ctx)


def extra_peak(block, args, run=PLAIN):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        out = block(*args, run=run)
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_head_groups_and_ffn_chunks_lower_the_peak_and_keep_the_output(hybrid):
    block, args = setup(hybrid)
    plain, plain_peak = extra_peak(block, args)
    low, low_peak = extra_peak(block, args, RunOptions().with_low_memory(LowMemory(ffn_chunk_rows=2048, head_groups=4)))
    x = args[0]
    update = (plain.float() - x.float()).norm()
    assert (low.float() - plain.float()).norm() <= 1e-2 * update
    assert low_peak <= 0.7 * plain_peak, (low_peak / 2**20, plain_peak / 2**20)
