"""Host weights made page-locked for their move (h3_core.memory.pinned_weights) with CUDA's own registration
(skipped without a GPU): after ``swap_in`` every weight is pinned and equal to what it was; the move to the GPU
gives the same module as the move from pageable memory; ``release`` gives the page lock back. The video VAE
read from its file as the loader reads it (memory-mapped) decodes the same after its weights were swapped in."""

import pytest
import torch
from torch import nn

from h3_core.formats.video_vae import load_video_vae
from h3_core.memory.pinned_weights import copy_to_pinned
from h3_core.pipeline.tiny_checkpoints import write_tiny_checkpoints

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_swapped_in_weights_are_pinned_and_move_unchanged():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 256)).half()
    reference = {k: v.to("cuda") for k, v in model.state_dict().items()}
    pinned = copy_to_pinned(model, chunk_bytes=1 << 20)
    assert pinned is not None and pinned.bytes >= sum(v.numel() * v.element_size() for v in reference.values())
    pinned.swap_in()
    assert all(p.is_pinned() for p in model.parameters())
    moved = model.to("cuda")
    for key, value in moved.state_dict().items():
        assert torch.equal(value, reference[key]), key
    chunks = list(pinned.chunks)
    pinned.release()
    assert not any(chunk.is_pinned() for chunk in chunks)


def test_the_video_vae_decodes_the_same_from_page_locked_weights(tmp_path):
    files = write_tiny_checkpoints(tmp_path)
    plain = load_video_vae(files.video_vae, device="cpu", dtype=torch.float16, run_device="cuda")
    swapped = load_video_vae(files.video_vae, device="cpu", dtype=torch.float16, run_device="cuda")
    pinned = copy_to_pinned(swapped)
    assert pinned is not None and pinned.swap_in() > 0
    plain, swapped = plain.to("cuda"), swapped.to("cuda")
    pinned.release()
    for (key, a), (_, b) in zip(plain.state_dict().items(), swapped.state_dict().items()):
        assert torch.equal(a, b), key
