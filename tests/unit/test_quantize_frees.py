"""``quantize_linears`` lets go of each bf16 weight as its layer is swapped, so quantising a bf16 model on a
device needs the model plus one layer's fp8 codes, not the model plus every layer's (on an 80 GB card the
full-size DiT's fp8 bench ran out of memory while building). Checked on the CPU with weak references to the
original weights' storages, read each time a layer is quantised, with the garbage collector off: each weight
must be gone when its layer has been swapped, by reference counting alone. The codes stay bit-identical to
``quantize_rows_reference`` of the weight."""

from __future__ import annotations

import gc

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

from h3_core.models.fp8_linear import Fp8Linear, quantize_linears, quantize_rows_reference

SIZE = 1024  # [1024, 1024] bf16: 2 MiB a weight, 1 MiB of codes
BLOCKS = 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(SIZE, SIZE, bias=True, dtype=torch.bfloat16)
        self.fc2 = nn.Linear(SIZE, SIZE, bias=False, dtype=torch.bfloat16)
        self.gate = nn.Linear(SIZE, 16, dtype=torch.bfloat16)  # not an FP8_LAYERS name: kept as it is


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.blocks[3].fc2 = self.blocks[2].fc2  # one Linear held by two parents: freed with the second swap


def build():
    """The model, a weak reference to each target weight's storage (by the first name that holds it), each
    weight's size and the codes, scales and bias its layer must get. Nothing returned holds a weight."""
    torch.manual_seed(0)
    model = Model()
    storages, sizes, expected = {}, {}, {}
    seen = set()
    for name, module in model.named_modules(remove_duplicate=False):
        if name.rsplit(".", 1)[-1] not in ("fc1", "fc2") or id(module) in seen:
            continue
        seen.add(id(module))
        weight = module.weight.detach()
        storages[name] = StorageWeakRef(weight.untyped_storage())
        sizes[name] = weight.untyped_storage().nbytes()
        codes, scale = quantize_rows_reference(weight.clone())
        bias = None if module.bias is None else module.bias.detach().clone()
        expected[name] = (codes, scale.view(-1), bias)
    return model, storages, sizes, expected


def alive(storages) -> list[str]:
    return [name for name, ref in storages.items() if not ref.expired()]


def test_each_bf16_weight_is_freed_as_its_layer_is_swapped(monkeypatch):
    model, storages, sizes, expected = build()
    gate_weights = [StorageWeakRef(b.gate.weight.untyped_storage()) for b in model.blocks]
    order = list(storages)  # the model's order, the order quantize_linears swaps in
    assert order == [f"blocks.{i}.fc{j}" for i in range(3) for j in (1, 2)] + ["blocks.3.fc1"]
    calls: list[list[str]] = []  # which original weights are alive as each layer is quantised
    peak = [0]  # bytes of original weights alive plus codes made, right after each layer is quantised
    made = [0]
    real = Fp8Linear.from_linear.__func__

    def from_linear(cls, linear, *args, **kwargs):
        calls.append(alive(storages))
        layer = real(cls, linear, *args, **kwargs)
        made[0] += layer.weight.untyped_storage().nbytes() + layer.weight_scale.untyped_storage().nbytes()
        peak[0] = max(peak[0], sum(sizes[name] for name in alive(storages)) + made[0])
        return layer

    monkeypatch.setattr(Fp8Linear, "from_linear", classmethod(from_linear))
    collecting = gc.isenabled()
    gc.disable()  # freed by reference counting, at once, not by a later collection
    try:
        assert quantize_linears(model) == 2 * BLOCKS
        left = alive(storages)
    finally:
        if collecting:
            gc.enable()

    # When layer k is quantised, the weights of the layers swapped before it are gone; the shared fc2 of block 2
    # stays while block 3 still holds it (block 3's fc1 comes before its fc2).
    want = [order[k:] for k in range(len(order))]
    want[-1] = ["blocks.2.fc2", "blocks.3.fc1"]
    assert calls == want
    assert left == []
    one_layer = SIZE * SIZE + 4 * SIZE  # codes and scales of one layer
    assert peak[0] <= sum(sizes.values()) + one_layer
    assert all(not ref.expired() for ref in gate_weights)

    # The layers are the ones the code always made: codes and scales bit for bit, the bias as it was.
    for name, (codes, scale, bias) in expected.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, Fp8Linear), name
        assert torch.equal(layer.weight.view(torch.uint8), codes.view(torch.uint8)), name
        assert torch.equal(layer.weight_scale, scale), name
        assert (layer.bias is None) == (bias is None), name
        if bias is not None:
            assert layer.bias.dtype == torch.bfloat16 and torch.equal(layer.bias, bias), name
    assert model.blocks[3].fc2 is model.blocks[2].fc2  # still one layer for both parents
    assert all(type(b.gate) is nn.Linear for b in model.blocks)
