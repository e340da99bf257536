"""What the library chooses per GPU architecture, the capability given explicitly (sm80, sm86, sm89, sm90, sm100,
sm120): how an fp8 layer multiplies (``fp8_linear.linear_form``: the cards without fp8 tensor cores keep the codes
and multiply in bf16), and which hand-written kernels run with which launch (``launch_table``)."""

import dataclasses
import importlib
import inspect
import re
from pathlib import Path
from types import MappingProxyType

import pytest
import torch

import h3_core
from h3_core import launch_table, triton_forms
from h3_core.memory.speed import has_fp8_matmul
from h3_core.models import block_ops, fp8_linear
from h3_core.models.block_ops import FusedBlockOps
from h3_core.models.fp8_linear import Fp8Linear, fp8_linear_weights_only, linear_form, quantize_input
from h3_core.models.video_vae import EAGER_BLOCKS

CAPABILITIES = {"sm80": (8, 0), "sm86": (8, 6), "sm89": (8, 9), "sm90": (9, 0), "sm100": (10, 0), "sm120": (12, 0)}


def test_cards_without_fp8_tensor_cores_multiply_fp8_layers_in_their_compute_dtype():
    forms = {name: linear_form(c) for name, c in CAPABILITIES.items()}
    assert forms == {
        "sm80": "weights only",
        "sm86": "weights only",
        "sm89": "fp8",
        "sm90": "fp8",
        "sm100": "fp8",
        "sm120": "fp8",
    }
    assert linear_form(None) == "reference"
    # the memory plan's speed model reads the same rule
    assert all(has_fp8_matmul(c) == (forms[name] == "fp8") for name, c in CAPABILITIES.items())


def fp64_product(x, codes, scale, bias=None):
    y = x.double() @ (codes.double() * scale.double()[:, None]).t()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_weights_only_product_is_the_dequantised_layers_within_one_rounding(dtype):
    g = torch.Generator().manual_seed(3)
    codes = (torch.randn(48, 64, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(48, generator=g) * 0.01 + 1e-3
    x, bias = torch.randn(5, 7, 64, generator=g).to(dtype), torch.randn(48, generator=g).to(dtype)
    y = fp8_linear_weights_only(x, codes, scale, bias, dtype)
    assert y.shape == (5, 7, 48) and y.dtype == dtype
    want = fp64_product(x.reshape(-1, 64), codes, scale, bias).reshape(5, 7, 48)
    # the weight rounded once to dtype, the product accumulated in fp32 and rounded once
    eps = torch.finfo(dtype).eps
    bound = 2 * eps * (x.double().abs() @ (codes.double().abs() * scale.double()[:, None]).t() + bias.double().abs())
    assert ((y.double() - want).abs() <= bound.reshape(5, 7, 48) + 1e-6).all()
    # rows that arrive quantised are dequantised and multiplied the same way
    rows = quantize_input(x)
    dequantised = (rows.codes.double() * rows.scale.double()).to(dtype).reshape(x.shape)
    from_rows = fp8_linear_weights_only(rows, codes, scale, None, dtype)
    assert torch.equal(from_rows, fp8_linear_weights_only(dequantised, codes, scale, None, dtype))


def test_on_a_card_without_fp8_matmuls_an_fp8_layer_reads_its_input_unquantised(monkeypatch):
    """A card without fp8 tensor cores stands in as this CPU, its form forced to "weights only": the layer
    multiplies in bf16 and the block never quantises its inputs for it."""
    g = torch.Generator().manual_seed(5)
    dense = torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    layer = Fp8Linear.from_linear(dense)
    x = torch.randn(9, 64, generator=g).to(torch.bfloat16)
    cpu = torch.device("cpu")
    assert fp8_linear.reads_quantized_rows(layer, cpu) and FusedBlockOps("compiled").gates_while_quantizing(layer, cpu)
    reference = layer(x)  # the fp32 reference, activations quantised
    monkeypatch.setattr(fp8_linear, "capability_of", lambda device: (8, 6))  # an sm86 card's choices
    assert not fp8_linear.reads_quantized_rows(layer, cpu)
    assert not FusedBlockOps("compiled").gates_while_quantizing(layer, cpu)
    assert not block_ops.reads_quantized_rows(layer, cpu)
    y = layer(x)
    assert torch.equal(y, fp8_linear_weights_only(x, layer.weight, layer.weight_scale, None, torch.bfloat16))
    assert not torch.equal(y, reference)  # no activation quantisation on this path
    assert (y.float() - reference.float()).abs().max() <= 0.1 * reference.float().abs().max()
    # the head-group path's slices take the same form
    assert torch.equal(layer.part(x, rows=slice(0, 16)), y[:, :16])


def kernel_names():
    return [(module, name) for module, names in launch_table.KERNELS.items() for name in names]


@pytest.mark.parametrize("module, name", kernel_names())
def test_every_kernel_in_the_table_is_a_launch_wrapper_of_its_module(module, name):
    kernels = importlib.import_module(f"h3_core.{module}")
    wrapper = getattr(kernels, name)
    assert callable(wrapper) and not hasattr(wrapper, "run"), name  # the Python wrapper, not the jitted kernel
    written = {p.name for p in inspect.signature(wrapper).parameters.values() if p.default is not p.empty}
    for arch in launch_table.ARCHITECTURES.values():
        assert set(arch.launches.get(name, {})) <= written, (name, arch)


def test_the_table_names_every_kernel_the_library_hands_out():
    """The wrappers named where kernels are handed out (``"…_triton"`` names in the library's sources, and the
    decoder's two halves) are exactly the table's."""
    root = Path(h3_core.__file__).parent
    named = set()
    for path in root.rglob("*.py"):
        if path.stem.endswith("_triton") or path.name == "launch_table.py":
            continue
        named |= set(re.findall(r'"([a-z_]+_triton)"', path.read_text()))
    named |= set(EAGER_BLOCKS)
    assert named == {name for _, name in kernel_names()}


@pytest.mark.parametrize("card", list(CAPABILITIES))
def test_the_launch_per_architecture(card):
    capability = CAPABILITIES[card]
    arch = launch_table.architecture(capability)
    measured = card == "sm90"
    assert bool(arch.measured_on) == measured
    for _, name in kernel_names():
        chosen = launch_table.launch(name, capability)
        if not measured:  # not measured there: every kernel with its written launch
            assert chosen == {}, (card, name)
        elif name in arch.dropped:
            assert chosen is None
        else:
            assert chosen == arch.launches.get(name, {})
    # Triton's interpreter (no capability) runs every kernel as written
    assert all(launch_table.launch(name, None) == {} for _, name in kernel_names())


def test_a_kernel_dropped_on_an_architecture_is_not_handed_out_there(monkeypatch):
    from h3_core.models import block_triton

    table = dict(launch_table.ARCHITECTURES)
    table[(8, 9)] = launch_table.Architecture(
        measured_on=("a card",), dropped=frozenset({"swiglu_triton"}), launches={"gate_heads_triton": {"warps": 8}}
    )
    monkeypatch.setattr(launch_table, "ARCHITECTURES", MappingProxyType(table))
    triton_forms._launched.cache_clear()
    monkeypatch.setattr(triton_forms, "capability_of", lambda device: (8, 9))
    try:
        assert triton_forms.triton_form(block_triton, "swiglu_triton", "cpu") is None
        gate = triton_forms.triton_form(block_triton, "gate_heads_triton", "cpu")
        assert gate.keywords == {"warps": 8}
        assert triton_forms.triton_form(block_triton, "gated_residual_triton", "cpu") is not None
        with triton_forms.plain_path():
            assert triton_forms.triton_form(block_triton, "gate_heads_triton", "cpu") is None
    finally:
        triton_forms._launched.cache_clear()


def test_the_table_refuses_a_kernel_it_does_not_know():
    with pytest.raises(ValueError, match="no kernel named"):
        launch_table.Architecture(dropped=frozenset({"swiglu"}))
    with pytest.raises(ValueError, match="no kernel named"):
        launch_table.launch("swiglu", (9, 0))


def test_the_memory_plan_counts_an_fp8_layer_on_a_card_without_fp8_matmuls_as_it_runs_there(monkeypatch):
    """One byte a weight held, no quantised activations, and each layer's weight dequantised while it runs."""
    from tiny_dit import CFG

    from h3_core.memory.predict import WEIGHTS_ONLY, BlockShape, ModelForm, block_peaks, weight_bytes
    from h3_core.models.dit import H3DiT
    from h3_core.models.low_memory import LowMemory
    from h3_core.pipeline.packing import pack_sequence

    cfg = dataclasses.replace(CFG, hybrid=True)
    model = H3DiT(cfg)
    model.fp8_layers = {"blocks.0.mlp.fc1": "quantised here"}
    cpu = torch.device("cpu")
    assert ModelForm.of(model).linears == "fp8" and ModelForm.of(model, device=cpu).linears == "fp8"
    monkeypatch.setattr(fp8_linear, "capability_of", lambda device: (8, 6))  # an sm86 card's choices
    form = ModelForm.of(model, device=cpu)
    assert form.linears == WEIGHTS_ONLY and ModelForm.of(model).linears == "fp8"
    assert weight_bytes(cfg, linears=WEIGHTS_ONLY) == weight_bytes(cfg, linears="fp8")
    shape = BlockShape.of(cfg, pack_sequence(torch.ones(12, dtype=torch.long), 5, 4, 6, 20))
    e = shape.element
    for groups in (1, 2):
        options = LowMemory(head_groups=groups)
        fp8 = block_peaks(shape, options, hybrid=True, linears="fp8")
        plain = block_peaks(shape, options, hybrid=True, linears="dtype")
        weights_only = block_peaks(shape, options, hybrid=True, linears=WEIGHTS_ONLY)
        assert weights_only["ffn"] == plain["ffn"] + 2 * shape.ffn * shape.hidden * e
        assert weights_only["attention"] == plain["attention"] + 3 * shape.inner * shape.hidden * e
        assert fp8["attention"] >= plain["attention"]  # fp8's own: the quantised projection input with groups
