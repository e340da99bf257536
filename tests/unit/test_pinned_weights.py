"""A module's host weights copied into registered chunks (h3_core.memory.pinned_weights), the logic on the CPU: the
page lock itself needs CUDA (tests/gpu/test_pinned_weights_cuda.py), so here registering records the chunks it is
given. The copies equal the weights they were made from; ``swap_in`` points the module at them and leaves tensors
replaced since, quantised subclasses and pinned tensors alone; chunks hold whole tensors at aligned offsets, none
past its size unless one tensor is bigger; a refused registration or a stop gives back what was registered."""

import torch
from torch import nn

from h3_core.memory.pinned_weights import copy_to_pinned, host_tensors, pinnable_bytes


class Registry:
    def __init__(self, refuse_after=None):
        self.registered, self.released, self.refuse_after = [], [], refuse_after

    def register(self, chunk):
        if self.refuse_after is not None and len(self.registered) >= self.refuse_after:
            return False
        self.registered.append(chunk.data_ptr())
        return True

    def unregister(self, chunk):
        self.released.append(chunk.data_ptr())


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.LayerNorm(96), nn.Linear(96, 33, bias=False)).half()
    model.register_buffer("table", torch.arange(10, dtype=torch.int64))
    model[0].weight.requires_grad_(False)
    return model


def test_copies_equal_the_weights_and_swap_in_points_the_module_at_them():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    registry = Registry()
    pinned = copy_to_pinned(model, chunk_bytes=8 << 10, register=registry.register, unregister=registry.unregister)
    assert pinned is not None and len(pinned.chunks) == len(registry.registered) > 1
    # nothing moved until swap_in
    for (owner, name, is_parameter, source, copy), _ in zip(pinned.entries, range(100)):
        assert (owner._parameters if is_parameter else owner._buffers)[name] is source
        assert torch.equal(copy, source) and copy.data_ptr() != source.data_ptr()
    params = {name: p for name, p in model.named_parameters()}
    assert pinned.swap_in() == len(before)
    chunk_ranges = [(c.data_ptr(), c.data_ptr() + c.numel()) for c in pinned.chunks]
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
        start, end = value.data_ptr(), value.data_ptr() + value.numel() * value.element_size()
        (base,) = [lo for lo, hi in chunk_ranges if lo <= start and end <= hi]
        assert (start - base) % 256 == 0
    # parameters stay the same Parameter objects (optimisers, the host's patches keep their references)
    assert all(params[name] is p for name, p in model.named_parameters())
    assert model[0].weight.requires_grad is False and model[2].weight.requires_grad is True
    pinned.release()
    assert sorted(registry.released) == sorted(registry.registered)
    assert pinned.chunks == [] and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_chunks_hold_whole_tensors_within_their_size():
    model = nn.ModuleList([nn.Linear(32, 32) for _ in range(6)])  # 4 KiB weights, 128 B biases
    registry = Registry()
    pinned = copy_to_pinned(model, chunk_bytes=9000, register=registry.register, unregister=registry.unregister)
    assert all(c.numel() <= 9000 for c in pinned.chunks)
    assert len(pinned.chunks) == 3  # two layers (2 × (4096 + 256)) per chunk
    big = nn.Linear(256, 256)  # one tensor over the chunk size gets a chunk of its own
    pinned_big = copy_to_pinned(big, chunk_bytes=1024, register=registry.register, unregister=registry.unregister)
    assert sorted(c.numel() for c in pinned_big.chunks) == [1024, 256 * 256 * 4]


def test_only_plain_unpinned_host_tensors_and_each_once():
    model = _model()
    model.shared = model[0]  # the same layer under two names
    assert len(host_tensors(model)) == len(model.state_dict()) - 2
    assert pinnable_bytes(model) == sum(v.numel() * v.element_size() for v in _model().state_dict().values())

    class Marked(torch.Tensor):
        pass

    model.register_buffer("marked", torch.zeros(4).as_subclass(Marked))
    model.register_buffer("empty", torch.zeros(0))
    names = {name for _, name, _ in host_tensors(model)}
    assert "marked" not in names and "empty" not in names


def test_a_tensor_replaced_after_the_copy_is_left_as_it_is():
    model = _model()
    registry = Registry()
    pinned = copy_to_pinned(model, register=registry.register, unregister=registry.unregister)
    replacement = nn.Parameter(torch.ones_like(model[2].weight))
    model[2].weight = replacement
    assert pinned.swap_in() == len(model.state_dict()) - 1
    assert model[2].weight is replacement and torch.equal(model[2].weight, torch.ones_like(replacement))


def test_a_refused_registration_or_a_stop_gives_back_what_was_registered():
    refusing = Registry(refuse_after=2)
    assert (
        copy_to_pinned(_model(), chunk_bytes=4096, register=refusing.register, unregister=refusing.unregister) is None
    )
    assert len(refusing.registered) == 2 and sorted(refusing.released) == sorted(refusing.registered)
    stopping, calls = Registry(), []

    def stop():
        calls.append(1)
        return len(calls) > 1

    assert (
        copy_to_pinned(
            _model(), chunk_bytes=4096, register=stopping.register, unregister=stopping.unregister, should_stop=stop
        )
        is None
    )
    assert len(stopping.registered) == 1 and stopping.released == stopping.registered
