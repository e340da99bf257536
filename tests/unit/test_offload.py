"""Block offload (h3_core.memory.offload) on the CPU: the same images, slots and prefetch schedule as on a GPU,
with plain copies instead of a side stream. A streamed model must give the plain model's outputs bit for bit."""

import pytest
import torch
import torch.nn as nn

from h3_core.attention import WindowSpec
from h3_core.errors import H3InputError
from h3_core.memory.offload import offload_blocks
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.models.fp8_linear import quantize_linears
from h3_core.models.hybrid import HybridContext
from h3_core.models.precision import keeps_fp32
from h3_core.pipeline.packing import pack_sequence

LAYERS = 5
CFG = dict(
    hidden=32,
    layers=LAYERS,
    heads=2,
    head_dim=16,
    ffn=48,
    text_dim=20,
    freq_dim=8,
    time_hidden=12,
    time_embed=10,
    rope_freqs=2,
)
# dense: plain H3 in fp32. hybrid: VDN-H3 blocks (softmax gate, to_out_linear, linear branch) in fp64.
# mixed: hybrid, pruned AdaLN curves and fp8 linears in bf16, so one block holds e4m3 codes, fp32 scales and
# fp32 AdaLN linears beside bf16 matrices — every dtype a released block can hold.
KINDS = ("dense", "hybrid", "mixed")


def build(kind):
    """A random tiny H3DiT of ``kind`` and the keyword arguments of one evaluation (8 latent frames, a window
    narrow enough that the linear branch runs)."""
    hybrid, mixed = kind != "dense", kind == "mixed"
    cfg = DiTConfig(**CFG, hybrid=hybrid, adaln_curve_grid=4 if mixed else 0)
    torch.manual_seed(0)
    model = H3DiT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        if kind == "hybrid":
            model.double()
        if mixed:
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if not keeps_fp32(name, curve=True):
                    tensor.data = tensor.data.to(torch.bfloat16)
            quantize_linears(model)
    dtype = torch.float64 if kind == "hybrid" else torch.float32
    packed = pack_sequence(torch.ones(4, dtype=torch.long), 8, 4, 4, 3)
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        video_rows=torch.randn(packed.video_index.numel(), 96, generator=g, dtype=dtype),
        audio_rows=torch.randn(packed.audio_index.numel(), 32, generator=g, dtype=dtype),
        text_rows=torch.randn(4, 20, generator=g, dtype=dtype),
        timesteps=torch.tensor([0.4, 0.7], dtype=dtype),
        timestep_index=(packed.tags == 2).long(),
        tags=packed.tags,
        positions=packed.positions,
        video_index=packed.video_index,
        audio_index=packed.audio_index,
        text_index=packed.text_index,
        hybrid=HybridContext(packed.layout, WindowSpec(1, 2, "both"), "ref", (0, 4)) if hybrid else None,
    )
    return model, inputs


def evaluate(model, inputs):
    with torch.no_grad():
        return model(**inputs)


def assert_bit_equal(got, want):
    for name, a, b in zip(("video", "audio"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name} differs by {(a.double() - b.double()).abs().max()}"


def weight_bytes(modules):
    tensors = {id(t): t for m in modules for t in (*m.parameters(), *m.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def slot_of(slots, tensor):
    """Index of the slot (a byte buffer of ``slots``) whose bytes hold ``tensor``, or None."""
    first, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    for i, slot in enumerate(slots):
        if slot.data_ptr() <= first and end <= slot.data_ptr() + slot.numel():
            return i
    return None


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("resident", [LAYERS, 2, 0], ids=["all-resident", "2-resident", "all-streamed"])
@pytest.mark.parametrize("kind", KINDS)
def test_streamed_model_equals_the_plain_model(kind, resident, prefetch):
    model, inputs = build(kind)
    want = evaluate(model, inputs)
    handle = offload_blocks(model, device="cpu", resident_blocks=resident, prefetch=prefetch)
    assert_bit_equal(evaluate(model, inputs), want)
    assert_bit_equal(evaluate(model, inputs), want)  # the slots' leftovers from the first evaluation do not leak in
    handle.remove()
    assert_bit_equal(evaluate(model, inputs), want)


def test_in_place_edits_between_evaluations_are_picked_up():
    plain, inputs = build("dense")
    model, _ = build("dense")
    # Every streamed block has a slot of its own, so a stale slot would go unnoticed by the schedule.
    offload_blocks(model, device="cpu", resident_blocks=0, prefetch=LAYERS)
    evaluate(model, inputs)
    with torch.no_grad():
        for m in (plain, model):
            m.blocks[-1].mlp.fc2.weight.mul_(0.5)  # as a LoRA merge would, into the host image
    assert_bit_equal(evaluate(model, inputs), evaluate(plain, inputs))


def test_inference_mode_gives_the_same_outputs():
    model, inputs = build("mixed")
    want = evaluate(model, inputs)
    offload_blocks(model, device="cpu", resident_blocks=1, prefetch=2)
    with torch.inference_mode():
        got = model(**inputs)
    assert_bit_equal(got, want)


@pytest.mark.parametrize("resident, prefetch", [(0, 1), (2, 2), (1, 9)])
def test_each_streamed_block_is_copied_once_per_evaluation(resident, prefetch):
    model, inputs = build("dense")
    handle = offload_blocks(model, device="cpu", resident_blocks=resident, prefetch=prefetch)
    streamed = LAYERS - resident
    assert handle.copies == 0 and len(handle.slots) == min(prefetch + 1, streamed)
    for evaluations in (1, 2, 3):
        evaluate(model, inputs)
        assert handle.copies == evaluations * streamed


def test_a_streamed_block_runs_from_its_slot_and_rests_in_host_memory():
    model, inputs = build("mixed")
    resident, prefetch = 1, 2
    handle = offload_blocks(model, device="cpu", resident_blocks=resident, prefetch=prefetch)
    seen = {}

    def record(index):
        def hook(block, args):
            tensors = [*block.parameters(), *block.buffers()]
            seen[index] = ({slot_of(handle.slots, t) for t in tensors}, {t.dtype for t in tensors})

        return hook

    # Appended after offload's own (prepended) pre-hook, so these see the block as it runs.
    hooks = [block.register_forward_pre_hook(record(i)) for i, block in enumerate(model.blocks)]
    evaluate(model, inputs)
    for hook in hooks:
        hook.remove()
    slots = prefetch + 1
    for index in range(LAYERS):
        used, dtypes = seen[index]
        assert used == ({None} if index < resident else {(index - resident) % slots}), index
        assert dtypes == {torch.float8_e4m3fn, torch.float32, torch.bfloat16}
        block = model.blocks[index]
        assert {slot_of(handle.slots, t) for t in (*block.parameters(), *block.buffers())} == {None}, index


def test_an_error_inside_a_streamed_block_leaves_the_model_usable():
    model, inputs = build("hybrid")
    want = evaluate(model, inputs)
    handle = offload_blocks(model, device="cpu", resident_blocks=1, prefetch=1)

    def fail(block, args):
        raise RuntimeError("stop inside block 3")

    hook = model.blocks[3].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="stop inside block 3"):
        evaluate(model, inputs)
    hook.remove()
    assert all(slot_of(handle.slots, p) is None for p in model.blocks[3].parameters())
    assert_bit_equal(evaluate(model, inputs), want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("resident, prefetch", [(0, 1), (3, 1), (2, 5), (LAYERS, 1)])
def test_stats_count_what_stays_and_what_streams(kind, resident, prefetch):
    model, _ = build(kind)
    total, streamed = weight_bytes([model]), weight_bytes(model.blocks[resident:])
    largest = max((weight_bytes([b]) for b in model.blocks[resident:]), default=0)
    tensors = sum(1 for b in model.blocks[resident:] for _ in (*b.parameters(), *b.buffers()))
    stats = offload_blocks(model, device="cpu", resident_blocks=resident, prefetch=prefetch).stats
    slots = min(prefetch + 1, LAYERS - resident)
    assert (stats.blocks, stats.resident_blocks, stats.streamed_blocks) == (LAYERS, resident, LAYERS - resident)
    assert stats.streamed_bytes == streamed and stats.resident_bytes == total - streamed
    # Images add at most 511 bytes of alignment after each tensor.
    assert streamed <= stats.copied_bytes <= streamed + 511 * tensors
    assert slots * largest <= stats.slot_bytes <= slots * (largest + 512 * tensors)
    assert stats.slot_bytes % 512 == 0 and stats.host_bytes >= stats.copied_bytes
    assert not stats.pinned  # page-locking is for GPUs only


def test_fully_resident_installs_nothing():
    model, inputs = build("dense")
    want = evaluate(model, inputs)
    handle = offload_blocks(model, device="cpu", resident_blocks=LAYERS)
    assert not any(b._forward_pre_hooks or b._forward_hooks for b in model.blocks)
    assert handle.slots == () and handle.stats.slot_bytes == handle.stats.copied_bytes == 0
    assert_bit_equal(evaluate(model, inputs), want)
    assert handle.copies == 0


@pytest.mark.parametrize("to", [None, "cpu"])
def test_remove_restores_a_plain_model(to):
    model, inputs = build("mixed")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in model.state_dict().values())
    parameters = list(model.parameters())
    handle = offload_blocks(model, device="cpu", resident_blocks=2, prefetch=1)
    evaluate(model, inputs)
    slots = handle.slots
    handle.remove(to)
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
    assert list(model.parameters()) == parameters  # the same Parameter objects, now with storage of their own
    assert not any(b._forward_pre_hooks or b._forward_hooks for b in model.blocks)
    assert handle.slots == () and not hasattr(model, "_h3_block_offload")
    assert all(slot_of(slots, t) is None for t in model.state_dict().values())
    # Storage of their own, as before offloading: not views into the host arena.
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in model.state_dict().values())
    handle.remove()  # a second remove does nothing
    again = offload_blocks(model, device="cpu", resident_blocks=0, prefetch=2)
    assert again.stats.streamed_blocks == LAYERS


def test_streaming_more_blocks_keeps_the_outputs():
    """remove(streamed_to=...) then a new offload with fewer resident blocks: how a holder frees device memory
    a block at a time; the model gives the same numbers at every step."""
    model, inputs = build("mixed")
    want = evaluate(model, inputs)
    for resident in (4, 2, 0):
        handle = offload_blocks(model, device="cpu", resident_blocks=resident, prefetch=1)
        assert handle.stats.resident_blocks == resident
        assert_bit_equal(evaluate(model, inputs), want)
        handle.remove(streamed_to="cpu")
        assert not hasattr(model, "_h3_block_offload")
    assert_bit_equal(evaluate(model, inputs), want)


class NoBlocks(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        if blocks is not None:
            self.blocks = blocks


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(resident_blocks=-1), r"resident_blocks must be an integer from 0 \(stream every block\) to 5 .* got -1"),
        (dict(resident_blocks=6), r"resident_blocks must be an integer from 0 .* to 5 .* got 6"),
        (dict(resident_blocks=2.0), r"resident_blocks must be an integer .* got 2\.0"),
        (dict(resident_blocks=True), r"resident_blocks must be an integer .* got True"),
        (dict(resident_blocks=1, prefetch=0), r"prefetch must be an integer of at least 1 .* got 0"),
        (dict(resident_blocks=1, prefetch=1.5), r"prefetch must be an integer of at least 1 .* got 1\.5"),
        (
            dict(resident_blocks=1, device="gpu0"),
            r"device must be a torch device such as 'cuda', 'cuda:1' or 'cpu', "
            r"got 'gpu0'",
        ),
    ],
)
def test_bad_arguments_are_refused_by_name(arguments, message):
    model, _ = build("dense")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(H3InputError, match=message):
        offload_blocks(model, **{"device": "cpu", **arguments})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # refused before touching it
    assert not any(b._forward_pre_hooks for b in model.blocks)


@pytest.mark.parametrize(
    "model, found",
    [
        (nn.Linear(2, 2), r"a Linear with no `blocks`"),
        (NoBlocks(None), r"a NoBlocks with no `blocks`"),
        (NoBlocks(nn.ModuleList()), r"a NoBlocks with an empty `blocks` list"),
        (NoBlocks(nn.Sequential(nn.Linear(2, 2))), r"a NoBlocks with `blocks` of type Sequential"),
    ],
)
def test_a_model_without_blocks_is_refused(model, found):
    with pytest.raises(
        H3InputError,
        match=r"model must hold its transformer blocks in a non-empty nn\.ModuleList "
        r"`blocks` \(an H3DiT\), got " + found,
    ):
        offload_blocks(model, device="cpu", resident_blocks=0)


def test_an_offloaded_model_is_not_offloaded_twice():
    model, _ = build("dense")
    offload_blocks(model, device="cpu", resident_blocks=1)
    with pytest.raises(H3InputError, match=r"model is already offloaded: call remove\(\)"):
        offload_blocks(model, device="cpu", resident_blocks=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda_is_refused():
    model, _ = build("dense")
    with pytest.raises(H3InputError, match=r"device 'cuda' needs CUDA, which is not available here"):
        offload_blocks(model, device="cuda", resident_blocks=0)


def test_adaln_projections_kept_on_the_host_are_neither_streamed_nor_moved():
    from h3_core.models.adaln_tables import keep_adaln_on_host, prepare_adaln_tables

    plain = _tiny_for_adaln()
    hosted = _tiny_for_adaln()
    keep_adaln_on_host(hosted)
    handle = offload_blocks(hosted, device="cpu", resident_blocks=0, prefetch=1)
    adaln = sum(p.numel() * p.element_size() for b in hosted.blocks for p in b.adaln_proj.parameters())
    full = sum(p.numel() * p.element_size() for b in plain.blocks for p in b.parameters())
    assert handle.stats.streamed_bytes == full - adaln
    timesteps = torch.tensor([0.3, 0.9])
    prepare_adaln_tables(hosted, [timesteps], "cpu")
    args = _adaln_inputs(plain, timesteps)
    with torch.no_grad():
        want, got = plain(*args), hosted(*args)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    handle.remove()
    assert all(p.device.type == "cpu" for b in hosted.blocks for p in b.adaln_proj.parameters())


def _tiny_for_adaln():
    torch.manual_seed(0)
    m = H3DiT(
        DiTConfig(
            hidden=32,
            layers=3,
            heads=2,
            head_dim=16,
            ffn=48,
            text_dim=20,
            freq_dim=8,
            time_hidden=16,
            time_embed=12,
            rope_freqs=2,
        )
    ).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    return m


def _adaln_inputs(m, timesteps):
    packed = pack_sequence(torch.ones(4, dtype=torch.long), 3, 2, 4, 3)
    g = torch.Generator().manual_seed(1)
    T = packed.positions.shape[0]
    return (
        torch.randn(packed.video_index.numel(), 96, generator=g),
        torch.randn(packed.audio_index.numel(), 32, generator=g),
        torch.randn(4, 20, generator=g),
        timesteps,
        (torch.arange(T) % 2),
        packed.tags,
        packed.positions,
        packed.video_index,
        packed.audio_index,
        packed.text_index,
    )
