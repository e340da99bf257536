"""Reading ComfyUI's quantised checkpoints (h3_core.formats.quantized_files, h3_core.formats.kitchen) on files
written the way
the host writes them: each layer quantised by comfy-kitchen's own ``QuantizedTensor.from_float`` and stored
through its ``state_dict`` (``<layer>.weight``, ``weight_scale``, ``weight_scale_2``), beside the
``comfy_quant`` JSON bytes ComfyUI's ``_quantized_weight_state_dict`` writes. comfy-kitchen is the oracle: what
the reader returns must equal the library's own dequantisation of the same tensors bit for bit.

Formats: int8 ConvRot (the DiT and VAE files), int8 per tensor and per row without rotation (the text
encoder's embedding), nvfp4 and nvfp4 with AWQ ``pre_quant_scale`` (the text encoder), fp8 (the older path).
The comfy-kitchen layer path runs here on comfy-kitchen's eager backend, the device policy (which allows it on
GPUs only) replaced by one that allows the CPU.
"""

import dataclasses
import json
import logging

import pytest
import torch
import torch.nn.functional as F
from comfy_kitchen.tensor import QuantizedTensor
from safetensors.torch import save_file

from h3_core.errors import H3BackendUnavailable, H3InputError
from h3_core.formats import kitchen
from h3_core.formats.files import CheckpointFiles
from h3_core.formats.quant_layers import layer_quants
from h3_core.formats.quantized_files import QuantizedView, quantized_view, read_state_dict

GROUP = 16  # a ConvRot group size (a power of 4) that tiny layers can hold
INT8_CONVROT = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": GROUP}


def comfy_quant(spec: dict) -> torch.Tensor:
    """The sidecar as comfy/ops.py ``_quantized_weight_state_dict`` writes it."""
    return torch.tensor(list(json.dumps(spec).encode("utf-8")), dtype=torch.uint8)


def quantize(weight: torch.Tensor, spec: dict) -> QuantizedTensor:
    """``weight`` quantised by comfy-kitchen into the layout ``spec`` (a comfy_quant dict) names."""
    if spec["format"] == "nvfp4":
        return QuantizedTensor.from_float(weight, "TensorCoreNVFP4Layout")
    convrot = bool(spec.get("convrot"))
    return QuantizedTensor.from_float(
        weight,
        "TensorWiseINT8Layout",
        per_channel=spec.get("per_channel", convrot),
        convrot=convrot,
        convrot_groupsize=spec.get("convrot_groupsize", 256),
    )


def quantized_layer(
    layer: str, weight: torch.Tensor, spec: dict, extra: dict | None = None
) -> tuple[dict, QuantizedTensor]:
    """One layer's tensors in ComfyUI's file layout, and the ``QuantizedTensor`` they came from."""
    qt = quantize(weight, spec)
    marker = {k: v for k, v in spec.items() if k != "per_channel"}
    return {**qt.state_dict(f"{layer}.weight"), f"{layer}.comfy_quant": comfy_quant(marker), **(extra or {})}, qt


def randn(*shape, seed=0, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """One file holding a layer of every format, a plain tensor, and the QuantizedTensors they came from."""
    state, oracle = {"plain.weight": randn(8, 8, seed=9)}, {}
    layers = {
        "convrot.0": (randn(48, 64, seed=1), INT8_CONVROT, None),
        "tensorwise.0": (randn(24, 32, seed=2), {"format": "int8_tensorwise"}, None),
        "rowwise.0": (randn(24, 32, seed=3), {"format": "int8_tensorwise", "per_channel": True}, None),
        "nvfp4.0": (randn(48, 64, seed=4), {"format": "nvfp4"}, None),
        "awq.0": (
            randn(32, 48, seed=5),
            {"format": "nvfp4", "full_precision_matrix_mult": True},
            {"awq.0.pre_quant_scale": torch.linspace(0.5, 1.5, 48).to(torch.bfloat16)},
        ),
    }
    for layer, (weight, spec, extra) in layers.items():
        tensors, oracle[f"{layer}.weight"] = quantized_layer(layer, weight, spec, extra)
        state.update(tensors)
    scale = torch.tensor(0.01)
    state["fp8.0.weight"] = (randn(16, 16, seed=6, dtype=torch.float32) / scale).to(torch.float8_e4m3fn)
    state["fp8.0.weight_scale"] = scale
    state["fp8.0.comfy_quant"] = comfy_quant({"format": "float8_e4m3fn"})
    path = tmp_path_factory.mktemp("quantized") / "mixed.safetensors"
    save_file(state, str(path))
    return path, oracle


@pytest.fixture
def allow_cpu_kernels(monkeypatch):
    """The device policy replaced: comfy-kitchen layers allowed on the CPU, where its eager backend runs them."""
    monkeypatch.setattr(
        kitchen, "kitchen_support", lambda fmt, kind, dtype, device: (True, "comfy-kitchen's eager backend (test)")
    )


def test_formats_come_from_the_header_and_the_sidecars_only(mixed, monkeypatch):
    path, _ = mixed
    files = CheckpointFiles(path)
    reads = []
    original = CheckpointFiles.get
    monkeypatch.setattr(CheckpointFiles, "get", lambda self, key: reads.append(key) or original(self, key))
    view = quantized_view(files)
    assert all(key.endswith(".comfy_quant") for key in reads) and len(reads) == 6
    assert isinstance(view, QuantizedView)
    assert view.formats() == {"float8_e4m3fn": 1, "int8_convrot": 1, "int8_tensorwise": 2, "nvfp4": 1, "nvfp4_awq": 1}
    quants = layer_quants(files)
    assert quants["convrot.0.weight"].group == GROUP and quants["awq.0.weight"].full_precision
    assert view.keys == {"plain.weight"} | {
        f"{layer}.weight" for layer in ("convrot.0", "tensorwise.0", "rowwise.0", "nvfp4.0", "awq.0", "fp8.0")
    }
    assert view.shape("nvfp4.0.weight") == (48, 64) and view.shape("convrot.0.weight") == (48, 64)
    assert view.dtypes["convrot.0.weight"] == "F32" and view.dtypes["plain.weight"] == "BF16"


def test_dequantised_weights_equal_comfy_kitchens_dequantisation_bit_for_bit(mixed, caplog):
    path, oracle = mixed
    keys = list(oracle) + ["plain.weight"]
    with caplog.at_level(logging.INFO, logger="h3_core.formats.kitchen"):
        read = read_state_dict(path, keys, dtype=torch.bfloat16)
    for key, qt in oracle.items():
        assert torch.equal(read.state[key], qt.dequantize()), key  # qt stands for a bf16 weight
    assert read.state["awq.0.pre_quant_scale"].dtype == torch.bfloat16
    assert torch.equal(read.state["plain.weight"], randn(8, 8, seed=9))
    assert read.kept == () and len(read.dequantised) == 5
    assert read.report in caplog.text
    assert "dequantised on load to bfloat16: comfy-kitchen has no int8_convrot kernels for cpu" in read.report


def test_the_view_dequantises_in_fp32_as_comfy_kitchen_does(mixed):
    path, oracle = mixed
    view = quantized_view(CheckpointFiles(path))
    for key, qt in oracle.items():
        fp32 = QuantizedTensor(
            qt.layout_cls.get_plain_tensors(qt)[0],
            qt.layout_cls.__name__,
            dataclasses.replace(qt.params, orig_dtype=torch.float32),
        )
        assert torch.equal(view.get(key), fp32.dequantize()), key
    fp8 = CheckpointFiles(path)
    assert torch.equal(view.get("fp8.0.weight"), fp8.get("fp8.0.weight").float() * fp8.get("fp8.0.weight_scale"))


def test_kept_layers_are_comfy_kitchen_weights_whose_linear_runs_the_library(mixed, allow_cpu_kernels):
    path, oracle = mixed
    read = read_state_dict(path, list(oracle), dtype=torch.bfloat16)
    assert set(read.kept) == set(oracle) and read.dequantised == ()
    x = randn(5, 64, seed=7)
    for key, qt in oracle.items():
        weight = read.state[key]
        assert isinstance(weight, QuantizedTensor) and weight.dtype == torch.bfloat16
        assert torch.equal(weight.layout_cls.get_plain_tensors(weight)[0], qt.layout_cls.get_plain_tensors(qt)[0])
        assert torch.equal(weight.dequantize(), qt.dequantize()), key
    # an nvfp4 weight with a plain input: the matmul with the dequantised weight (full precision), after the AWQ
    # input scaling ComfyUI applies
    awq = read.state["awq.0.weight"]
    scaled = randn(3, 48, seed=8) * read.state["awq.0.pre_quant_scale"]
    assert torch.equal(F.linear(scaled, awq), F.linear(scaled, oracle["awq.0.weight"].dequantize()))
    # int8 ConvRot: comfy-kitchen's int8 matmul (activations rotated and quantised per row), not a dequantisation
    convrot = F.linear(x, read.state["convrot.0.weight"])
    plain = F.linear(x, oracle["convrot.0.weight"].dequantize())
    assert not torch.equal(convrot, plain)
    assert (convrot.float() - plain.float()).abs().max() <= 0.05 * plain.float().abs().max()


def test_may_keep_leaves_other_quantised_weights_dequantised(mixed, allow_cpu_kernels):
    path, oracle = mixed
    read = read_state_dict(path, list(oracle), dtype=torch.float32, may_keep=lambda key: key.startswith("nvfp4"))
    assert read.kept == ("nvfp4.0.weight",) and isinstance(read.state["nvfp4.0.weight"], QuantizedTensor)
    assert not isinstance(read.state["convrot.0.weight"], QuantizedTensor)
    assert "the caller holds it dense" in read.report


def test_held_kitchen_says_why_it_cannot(mixed):
    path, _ = mixed
    with pytest.raises(
        H3BackendUnavailable,
        match=r"mixed\.safetensors: layer 'convrot\.0' \(int8_convrot\) cannot "
        r"be kept as a comfy-kitchen layer: comfy-kitchen has no "
        r"int8_convrot kernels for cpu",
    ):
        read_state_dict(path, ["convrot.0.weight"], held="kitchen")
    with pytest.raises(H3InputError, match=r"held: got 'fast'; allowed: 'auto', 'dequantize', 'kitchen'"):
        read_state_dict(path, ["convrot.0.weight"], held="fast")


def test_missing_keys_are_named(mixed):
    path, _ = mixed
    with pytest.raises(
        H3InputError,
        match=r"mixed\.safetensors: has no 1 of the 2 keys asked for, first "
        r"\['nowhere\.weight'\]",
    ):
        read_state_dict(path, ["plain.weight", "nowhere.weight"])


# ---- refusals -------------------------------------------------------------------------------------


def write(tmp_path, state, name="model.safetensors"):
    path = tmp_path / name
    save_file(state, str(path))
    return path


def int8_layer(**changes):
    tensors, _ = quantized_layer("blocks.0.fc", randn(48, 64, seed=1), INT8_CONVROT)
    tensors.update(changes)
    return {k: v for k, v in tensors.items() if v is not None}


@pytest.mark.parametrize(
    "state, message",
    [
        (
            int8_layer(**{"blocks.0.fc.comfy_quant": comfy_quant({"format": "svdquant_w4a4"})}),
            r"model\.safetensors: layer 'blocks\.0\.fc' is quantized as 'svdquant_w4a4', which this pack does not "
            r"read; "
            r"it reads ComfyUI's float8_e4m3fn, float8_e5m2, int8_tensorwise, nvfp4 \(with convrot\) layers",
        ),
        (
            int8_layer(**{"blocks.0.fc.comfy_quant": comfy_quant({"convrot": True})}),
            r"layer 'blocks\.0\.fc' names no format",
        ),
        (
            int8_layer(**{"blocks.0.fc.comfy_quant": torch.tensor(list(b"not json"), dtype=torch.uint8)}),
            r"'blocks\.0\.fc\.comfy_quant' is not a JSON object",
        ),
        (
            int8_layer(**{"blocks.0.fc.weight_scale": None}),
            r"model\.safetensors: layer 'blocks\.0\.fc' \(int8_convrot\): has no 'blocks\.0\.fc\.weight_scale'; "
            r"ComfyUI's "
            r"int8_convrot layers store a float scale per tensor or per row \(\[48, 1\]\) there",
        ),
        (
            int8_layer(**{"blocks.0.fc.weight_scale": torch.ones(48, 2)}),
            r"layer 'blocks\.0\.fc' \(int8_convrot\): 'blocks\.0\.fc\.weight_scale' is F32 \[48, 2\], expected a float "
            r"scale per tensor or per row \(\[48, 1\]\)",
        ),
        (
            int8_layer(**{"blocks.0.fc.weight": torch.zeros(48, 64, dtype=torch.uint8)}),
            r"'blocks\.0\.fc\.weight' is U8 \[48, 64\], expected a I8 matrix",
        ),
        (
            int8_layer(**{"blocks.0.fc.weight": None}),
            r"'blocks\.0\.fc\.comfy_quant' describes a layer with no 'blocks\.0\.fc\.weight'",
        ),
        (
            int8_layer(**{"blocks.0.fc.comfy_quant": comfy_quant({**INT8_CONVROT, "convrot_groupsize": 8})}),
            r"\(int8_convrot\): convrot_groupsize 8 is not a power of 4",
        ),
        (
            int8_layer(**{"blocks.0.fc.comfy_quant": comfy_quant({**INT8_CONVROT, "convrot_groupsize": 256})}),
            r"\(int8_convrot\): its 64 input columns are not a multiple of its convrot_groupsize 256",
        ),
    ],
)
def test_malformed_or_unknown_layers_are_refused_naming_file_layer_and_expectation(tmp_path, state, message):
    path = write(tmp_path, state)
    with pytest.raises(H3InputError, match=message):
        quantized_view(CheckpointFiles(path))


def test_nvfp4_sidecars_are_checked(tmp_path):
    tensors, _ = quantized_layer("te.proj", randn(48, 64, seed=4), {"format": "nvfp4"})
    missing = {k: v for k, v in tensors.items() if not k.endswith("weight_scale_2")}
    with pytest.raises(
        H3InputError,
        match=r"layer 'te\.proj' \(nvfp4\): has no 'te\.proj\.weight_scale_2'; "
        r"ComfyUI's nvfp4 layers store the F32 per-tensor scale there",
    ):
        quantized_view(CheckpointFiles(write(tmp_path, missing)))
    blocks = {**tensors, "te.proj.weight_scale": torch.zeros(48, 4, dtype=torch.float8_e4m3fn)}
    with pytest.raises(
        H3InputError,
        match=r"'te\.proj\.weight_scale' is F8_E4M3 \[48, 4\], expected F8_E4M3 block "
        r"scales \[128, 4\] \(one per 16 codes, swizzled\)",
    ):
        quantized_view(CheckpointFiles(write(tmp_path, blocks, "blocks.safetensors")))
    awq = {**tensors, "te.proj.pre_quant_scale": torch.ones(7)}
    with pytest.raises(
        H3InputError,
        match=r"'te\.proj\.pre_quant_scale' is F32 \[7\], expected the AWQ input "
        r"scales \[64\]",
    ):
        quantized_view(CheckpointFiles(write(tmp_path, awq, "awq.safetensors")))


def test_gguf_is_refused_by_name_and_by_content(tmp_path):
    named = tmp_path / "qwen3vl_32b_minimax_h3-Q4_K_M.gguf"
    named.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(H3InputError, match=r"Q4_K_M\.gguf: GGUF checkpoints are not supported yet"):
        read_state_dict(named, ["x"])
    disguised = tmp_path / "renamed.safetensors"
    disguised.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(
        H3InputError,
        match=r"renamed\.safetensors: a GGUF file \(named \.safetensors\); GGUF "
        r"checkpoints are not supported yet",
    ):
        read_state_dict(disguised, ["x"])
