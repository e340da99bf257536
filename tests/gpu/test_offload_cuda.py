"""Block offload (h3_core.memory.offload) on a CUDA GPU (skipped without one): a reduced DiT (hidden 1024, 8 heads
of 128, 6 blocks) in bf16, with and without fp8 linears, dense and hybrid, streamed from page-locked host memory
through a side stream, gives the resident model's outputs bit for bit; and streaming lowers the peak device
memory by at least the streamed blocks' bytes minus the slot pool.

That the copies overlap compute is a timing property and is not asserted here. To check it, profile one
streamed evaluation of a model whose blocks take longer than their copies (e.g. the released size with
``resident_blocks=0``):

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        model(**inputs); torch.cuda.synchronize()
    prof.export_chrome_trace("offload.json")   # open in https://ui.perfetto.dev

and look at the GPU rows: each "Memcpy HtoD (Pinned -> Device)" runs on the copy stream while the previous
block's GEMMs run on the compute stream, and the compute stream shows no gap waiting for it except before the
first streamed block. "Pageable -> Device" instead of "Pinned" means the arena could not be page-locked (a
warning is logged, ``stats.pinned`` is False) and the copies serialise with compute. ``nsys profile -t cuda``
shows the same on its per-stream CUDA HW rows.
"""

import copy
import functools
import gc

import pytest
import torch

from h3_core.attention import WindowSpec
from h3_core.memory.offload import offload_blocks
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.models.fp8_linear import quantize_linears
from h3_core.models.hybrid import HybridContext
from h3_core.models.precision import keeps_fp32
from h3_core.pipeline.packing import pack_sequence

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = torch.device("cuda")
LAYERS = 6
CFG = dict(
    hidden=1024,
    layers=LAYERS,
    heads=8,
    head_dim=128,
    ffn=4096,
    text_dim=256,
    freq_dim=256,
    time_hidden=512,
    time_embed=256,
    rope_freqs=16,
)
TEXT_ROWS = 64


@functools.cache
def host_model(hybrid: bool, fp8: bool) -> H3DiT:
    """The reduced DiT on the host, random weights at unit-variance scale, bf16 with the released fp32 islands,
    and fp8 linears if asked; tests take deep copies."""
    g = torch.Generator().manual_seed(0)
    model = H3DiT(DiTConfig(**CFG, hybrid=hybrid)).eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name != "rope.inv_freq":
                fan_in = tensor.shape[-1] if tensor.dim() > 1 else 1
                tensor.copy_(torch.randn(tensor.shape, generator=g) / fan_in**0.5)
            if not keeps_fp32(name):
                tensor.data = tensor.data.to(torch.bfloat16)
        if fp8:
            quantize_linears(model)
    return model


def sequence(hybrid: bool) -> dict:
    """One T2VA-like evaluation on 9 latent frames of 32×32 (T = 2488 rows), audio at its own timestep; for the
    hybrid model a window narrow enough that the linear branch runs."""
    packed = pack_sequence(torch.ones(TEXT_ROWS, dtype=torch.long), 9, 32, 32, 60)
    g = torch.Generator().manual_seed(1)
    return dict(
        video_rows=torch.randn(packed.video_index.numel(), 96, generator=g).to(DEV),
        audio_rows=torch.randn(packed.audio_index.numel(), 32, generator=g).to(DEV),
        text_rows=torch.randn(TEXT_ROWS, CFG["text_dim"], generator=g).to(DEV),
        timesteps=torch.tensor([0.4, 0.7], device=DEV),
        timestep_index=(packed.tags == 2).long().to(DEV),
        tags=packed.tags.to(DEV),
        positions=packed.positions.to(DEV),
        video_index=packed.video_index.to(DEV),
        audio_index=packed.audio_index.to(DEV),
        text_index=packed.text_index.to(DEV),
        hybrid=HybridContext(packed.layout, WindowSpec(1, 2, "both"), "auto", (0, TEXT_ROWS)) if hybrid else None,
    )


def evaluate(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    torch.cuda.synchronize()
    return out


def assert_bit_equal(got, want, what="the streamed model differs from the resident one"):
    for name, a, b in zip(("video", "audio"), got, want):
        assert torch.equal(a, b), f"{what}: {name} by up to {(a.float() - b.float()).abs().max().item()}"


def peak_during(model, inputs) -> int:
    """The most device memory allocated at any time of one evaluation, everything already allocated included."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = evaluate(model, inputs)
    peak = torch.cuda.max_memory_allocated()
    del out
    return peak


@pytest.mark.parametrize("resident, prefetch", [(0, 1), (2, 2)], ids=["all-streamed", "2-resident-prefetch-2"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_streamed_outputs_equal_the_resident_model(hybrid, fp8, resident, prefetch):
    inputs = sequence(hybrid)
    model = copy.deepcopy(host_model(hybrid, fp8)).to(DEV)
    want = evaluate(model, inputs)
    # The control: without it a nondeterministic kernel would read as an offload bug.
    assert_bit_equal(evaluate(model, inputs), want, "the resident model is not deterministic")
    del model
    model = copy.deepcopy(host_model(hybrid, fp8))
    handle = offload_blocks(model, device="cuda", resident_blocks=resident, prefetch=prefetch)
    assert handle.stats.pinned and handle.stats.streamed_blocks == LAYERS - resident
    assert_bit_equal(evaluate(model, inputs), want)
    assert_bit_equal(evaluate(model, inputs), want)
    assert handle.copies == 2 * (LAYERS - resident)
    handle.remove()
    assert all(t.device.type == "cuda" for t in model.state_dict().values())
    assert_bit_equal(evaluate(model, inputs), want, "the model after remove() differs from the resident one")


def test_streaming_lowers_the_peak_by_the_streamed_blocks_minus_the_slot_pool():
    inputs = sequence(hybrid=False)
    model = copy.deepcopy(host_model(False, False)).to(DEV)
    evaluate(model, inputs)  # warm-up: cuBLAS workspaces and other one-time allocations happen before measuring
    resident_peak = peak_during(model, inputs)
    del model
    model = copy.deepcopy(host_model(False, False))
    handle = offload_blocks(model, device="cuda", resident_blocks=1, prefetch=1)
    streamed_peak = peak_during(model, inputs)
    stats = handle.stats
    assert stats.streamed_blocks == LAYERS - 1 and len(handle.slots) == 2
    # The activations are the same in both runs, and the allocator rounds each resident weight up to 512 bytes
    # just as the images pad each tensor to 512, so the whole difference is the weights: streamed minus slots.
    saved = stats.streamed_bytes - stats.slot_bytes
    assert saved > 0
    assert resident_peak - streamed_peak >= saved, (
        f"resident peak {resident_peak / 2**20:.1f} MiB, streamed peak {streamed_peak / 2**20:.1f} MiB, "
        f"streamed blocks {stats.streamed_bytes / 2**20:.1f} MiB, slot pool {stats.slot_bytes / 2**20:.1f} MiB"
    )


def test_streamed_blocks_rest_in_page_locked_host_memory():
    model = copy.deepcopy(host_model(False, True))
    handle = offload_blocks(model, device="cuda", resident_blocks=4)
    assert handle.stats.pinned
    for index, block in enumerate(model.blocks):
        for tensor in (*block.parameters(), *block.buffers()):
            if index < 4:
                assert tensor.device.type == "cuda", index
            else:
                assert tensor.device.type == "cpu" and tensor.is_pinned(), index
    outside = [model.token_refiner, model.final_layer, model.time_embedder, model.condition_proj]
    assert all(t.device.type == "cuda" for m in outside for t in (*m.parameters(), *m.buffers()))
    handle.remove(device="cpu")
    assert all(t.device.type == "cpu" and not t.is_pinned() for t in model.state_dict().values())
