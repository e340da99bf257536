"""The evaluation and the decode across GPUs (NCCL), each GPU one rank (skipped with fewer than two CUDA devices):
a VDN-H3 DiT in bf16 with its blocks on row shards, plain Ulysses and the branch split, equals one GPU's evaluation
within bf16 rounding for the T2VA and Ref2VA layouts; the video decode with its tile batches shared among the GPUs
equals one GPU's decode bit for bit. Run on a machine of several GPUs with ``python -m pytest
tests/gpu/test_parallel_cuda.py``."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rank_checks import decode_check

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two or more CUDA devices"
)

BF16_BOUND = 3e-2  # relative to the largest velocity: the shards' GEMMs and exchanges round differently


def evaluation_check(device, world, backend="auto"):
    """Every rank's share of an evaluation against the whole evaluation on the same device."""
    from h3_core.attention import WindowSpec
    from h3_core.models.dit import DiTConfig, H3DiT
    from h3_core.models.hybrid import HybridContext
    from h3_core.parallel import SequenceShards
    from h3_core.pipeline.packing import Reference, pack_ref2va, pack_sequence

    cfg = DiTConfig(
        hidden=256, layers=2, heads=8, head_dim=64, ffn=512, text_dim=64, freq_dim=32, time_hidden=64,
        time_embed=32, rope_freqs=8, hybrid=True,
    )  # fmt: skip
    torch.manual_seed(6)
    model = H3DiT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model = model.to(device=device, dtype=torch.bfloat16)
    text = torch.ones(8, dtype=torch.long)
    layouts = {
        "T2VA": pack_sequence(text, 9, 4, 8, 5),
        "Ref2VA": pack_ref2va(text, [Reference("image", 0, 4, 8)], 9, 4, 8, 5),
    }
    g = torch.Generator().manual_seed(8)
    for name, packed in layouts.items():
        T = packed.positions.shape[0]
        args = [
            torch.randn(packed.video_index.numel(), 96, generator=g),
            torch.randn(packed.audio_index.numel(), 32, generator=g),
            torch.randn(8, 64, generator=g),
            torch.tensor([0.3, 0.999]),
            torch.arange(T) % 2,
            *packed.model_inputs("cpu"),
        ]
        args = [a.to(device=device, dtype=torch.bfloat16) if a.is_floating_point() else a.to(device) for a in args]
        ctx = HybridContext(packed.layout, WindowSpec(1, 2, "both"), backend, (0, 8))
        with torch.no_grad():
            whole = model(*args, hybrid=ctx)
            for softmax_ranks in (0, world - 1):
                shards = SequenceShards.of(T, cfg.heads, inner=ctx, softmax_ranks=softmax_ranks)
                part = model(*args, hybrid=shards)
                for a, b in zip(part, whole):
                    err = float((a.float() - b.float()).abs().max() / b.float().abs().max())
                    assert a.shape == b.shape and err <= BF16_BOUND, (name, softmax_ranks, err)


def _rank(rank, world, store):
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        evaluation_check(device, world)
        decode_check(device, torch.float16)
    finally:
        dist.destroy_process_group()


def test_the_evaluation_and_the_decode_across_gpus_equal_one_gpus():
    world = min(torch.cuda.device_count(), 8)
    handle, store = tempfile.mkstemp(prefix="h3_nccl_")
    os.close(handle)
    os.unlink(store)
    mp.spawn(_rank, args=(world, store), nprocs=world)
