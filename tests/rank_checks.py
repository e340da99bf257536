"""Checks every rank of a ``torch.distributed`` group runs alike, shared by the gloo tests on the CPU
(tests/unit/test_parallel_exchange.py) and the NCCL ones on GPUs (tests/gpu/test_parallel_cuda.py)."""

import torch
import torch.distributed as dist


def decode_check(device, dtype=torch.float32) -> None:
    """A tiny random video VAE's decode with each window's tile batches shared among the ranks: rank 0's frames are
    the one-rank decode's, bit for bit; the other ranks return None."""
    from h3_core.media.tiling import Tiling, decode_video
    from h3_core.models.video_vae import VideoVAE, VideoVAEConfig

    cfg = VideoVAEConfig(
        decoder_layers=1, decoder_heads=2, decoder_head_dim=16, block_out_channels=(8,) * 6, norm_groups=4
    )
    torch.manual_seed(4)
    vae = VideoVAE(cfg).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.normal_(0, 0.05)
    vae = vae.to(device=device, dtype=dtype)
    # 2 windows, 2 x 3 tiles of 64 px
    z = torch.randn(24, 12, 6, 10, generator=torch.Generator().manual_seed(5)).to(device)
    options = dict(tiling=Tiling(tile_px=64, overlap_px=32, tiles_per_batch=2), compile="off")
    shared = decode_video(vae, z, group=dist.group.WORLD, **options)
    if dist.get_rank() != 0:
        assert shared is None
        return
    assert torch.equal(shared, decode_video(vae, z, **options))
