"""ComfyUI's quantised single-file text encoders (``qwen3vl_32b_minimax_h3_int8_convrot`` / ``_nvfp4_awq``) read by
h3_core.formats.qwen3vl_checkpoint / qwen3vl_weights / text_encoder.

The files are written here as ComfyUI writes them, from one tiny random Qwen3-VL of Qwen3-VL-32B's family
(``tiny_qwen3vl``, one decoder layer more than the conditioning layer): each layer quantised by comfy-kitchen's
own ``QuantizedTensor.from_float`` and stored through its ``state_dict`` beside the ``comfy_quant`` JSON bytes
(``quantize_text_encoder_state``): int8 ConvRot (groups of 16, which the tiny width holds; the tower's linears too)
or nvfp4 with AWQ input scales on ``o_proj`` and ``down_proj``, the embedding table in int8 per row. comfy-kitchen
is the oracle: a dequantised weight must equal the library's own dequantisation bit for bit.

The reference for the encoded states is a text encoder loaded from a bf16 file in ComfyUI's layout holding those
same dequantised weights; for nvfp4_awq its AWQ layers' inputs are multiplied by the file's scales explicitly
(forward pre-hooks, the product ComfyUI's ``MixedPrecisionOps.Linear.forward`` forms). Computing in bf16 the
states are then equal bit for bit (tolerance zero): the same weights, the same operations in the same order, on
the CPU. Computing in fp32 they are not: the quantised file's weights are comfy-kitchen's fp32 dequantisation,
the bf16 file's that rounded to bf16, each off by at most 2^-9 of itself (the embedding table's rows included).
Each linear's output is then off by about 2^-9 of its size, and the three decoder layers' residual stream
carries the errors of the embeddings and of every layer forward, adding them: the states' relative error
(Frobenius) is bounded by 2^-6, the sum of a handful of such 2^-9 terms, and is not zero (the fp32 path kept
comfy-kitchen's fp32 dequantisation rather than a bf16 one).

comfy-kitchen layers (kept) run here on its eager backend, the GPU-only device policy replaced by one that allows
the CPU: int8 with its activations quantised per row (close to, not equal to, the dequantised model), nvfp4 with
the weight dequantised for the plain input (equal to it).
"""

import dataclasses
import json
import logging

import pytest
import torch
from comfy_kitchen.tensor import QuantizedTensor
from safetensors.torch import load_file, save_file
from tiny_checkpoints import (
    TINY_TEXT_WIDTH,
    quantize_text_encoder_state,
    write_tiny_quantized_text_encoder_file,
    write_tiny_text_encoder_file,
)

from h3_core.errors import H3BackendUnavailable, H3InputError
from h3_core.formats import kitchen
from h3_core.formats.files import CheckpointFiles
from h3_core.formats.qwen3vl_checkpoint import describe_text_encoder_file
from h3_core.formats.qwen3vl_weights import PreScaledLinear
from h3_core.pipeline.text_encoder import load_text_encoder

LAYER = 3  # the conditioning layer; the files hold LAYER + 1 decoder layers
GROUP = 16
KINDS = ("int8_convrot", "nvfp4_awq")
PROMPT = "<d>Run!</d> a fox runs through snow"


def host_tokenizer_dir():
    from comfy_host import comfyui_root

    try:
        return comfyui_root() / "comfy" / "text_encoders" / "qwen25_tokenizer"
    except RuntimeError as exc:
        pytest.skip(str(exc))


def pixels(*shape, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


def dequantized(qt: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """comfy-kitchen's dequantisation of ``qt`` standing for a ``dtype`` weight."""
    codes = qt.layout_cls.get_plain_tensors(qt)[0]
    return QuantizedTensor(codes, qt.layout_cls.__name__, dataclasses.replace(qt.params, orig_dtype=dtype)).dequantize()


@dataclasses.dataclass
class Written:
    kind: str
    path: object  # the quantised file
    plain: object  # the bf16 file of its dequantised weights
    tensors: dict  # the quantised file's tensors
    oracle: dict  # weight key -> QuantizedTensor


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized_text_encoder")
    state = load_file(str(write_tiny_text_encoder_file(root / "bf16", layers=LAYER + 1)))
    written = {}
    for kind in KINDS:
        tensors, oracle = quantize_text_encoder_state(state, kind, group=GROUP, tower=kind == "int8_convrot")
        path = root / f"qwen3vl_tiny_{kind}.safetensors"
        save_file(tensors, str(path))
        plain = root / f"qwen3vl_tiny_{kind}_dequantised_bf16.safetensors"
        save_file({k: oracle[k].dequantize() if k in oracle else v for k, v in state.items()}, str(plain))
        written[kind] = Written(kind, path, plain, tensors, oracle)
    return written


def load(path, **kw):
    kw.setdefault("dtype", torch.bfloat16)
    return load_text_encoder(path, tokenizer=host_tokenizer_dir(), layer=LAYER, **kw)


def model_key(key: str) -> str:
    return (
        "model.visual." + key.removeprefix("visual.")
        if key.startswith("visual.")
        else "model.language_model." + key.removeprefix("model.")
    )


def held(key: str) -> bool:
    return not key.startswith(f"model.layers.{LAYER}.")


def prescale_inputs(encoder, tensors):
    """Multiply each AWQ layer's input by its scale explicitly, cast to the input's dtype, as ComfyUI does."""
    for key, scale in tensors.items():
        if key.endswith(".pre_quant_scale") and held(key):
            layer = encoder.model.get_submodule(model_key(key.removesuffix(".pre_quant_scale")))
            layer.register_forward_pre_hook(lambda module, args, s=scale: (args[0] * s.to(args[0].dtype),))
    return encoder


@pytest.fixture
def allow_cpu_kernels(monkeypatch):
    """The device policy replaced: comfy-kitchen layers allowed on the CPU, where its eager backend runs them."""
    monkeypatch.setattr(
        kitchen, "kitchen_support", lambda fmt, kind, dtype, device: (True, "comfy-kitchen's eager backend (test)")
    )


def _reads(monkeypatch):
    read = []
    real = CheckpointFiles.get
    monkeypatch.setattr(CheckpointFiles, "get", lambda self, key: read.append(key) or real(self, key))
    return read


@pytest.mark.parametrize("kind", KINDS)
def test_described_from_the_header_and_the_sidecars(files, kind, monkeypatch):
    written = files[kind]
    read = _reads(monkeypatch)
    described = describe_text_encoder_file(written.path)
    assert read and all(key.endswith(".comfy_quant") for key in read)  # no weight read
    plain = describe_text_encoder_file(written.plain)
    assert described.layout.name == "ComfyUI" and described.layers == LAYER + 1
    assert described.config.to_dict() == plain.config.to_dict()
    layers = LAYER + 1
    if kind == "int8_convrot":
        tower = sum(1 for k in written.oracle if k.startswith("visual."))
        assert tower > 0 and described.quantization == (("int8_convrot", 7 * layers + tower), ("int8_tensorwise", 1))
        assert described.prescaled == () and "I8" in described.dtypes
    else:
        assert described.quantization == (("int8_tensorwise", 1), ("nvfp4", 5 * layers), ("nvfp4_awq", 2 * layers))
        assert sorted(described.prescaled) == sorted(
            f"model.layers.{i}.{name}" for i in range(layers) for name in ("self_attn.o_proj", "mlp.down_proj")
        )
        assert {"U8", "F8_E4M3"} <= set(described.dtypes)
    # what loading holds, at the stored size: every tensor but the later layer's (codes and sidecars alike)
    stored = sum(v.numel() * v.element_size() for k, v in written.tensors.items() if held(k))
    assert described.held(LAYER).held == stored


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", KINDS)
def test_dequantised_weights_equal_comfy_kitchens_bit_for_bit(files, kind, dtype, monkeypatch, caplog):
    written = files[kind]
    read = _reads(monkeypatch)
    with caplog.at_level(logging.INFO, logger="h3_core.formats.kitchen"):
        encoder = load(written.path, dtype=dtype, held="dequantize")
    # the weights and scales H3 holds, each once; besides them only the few-byte comfy_quant sidecars
    tensors = [k for k in read if not k.endswith(".comfy_quant")]
    assert sorted(tensors) == sorted(k for k in written.tensors if held(k) and not k.endswith(".comfy_quant"))
    model = encoder.model
    for key, qt in written.oracle.items():
        if held(key):
            weight = model.get_parameter(model_key(key))
            assert not isinstance(weight, QuantizedTensor) and weight.dtype == dtype
            assert torch.equal(weight, dequantized(qt, dtype)), key
    prescaled = {k.removesuffix(".pre_quant_scale") for k in written.tensors if k.endswith(".pre_quant_scale")}
    for name, module in model.named_modules():
        file_layer = next((k.removesuffix(".weight") for k in written.oracle if model_key(k) == f"{name}.weight"), None)
        if file_layer in prescaled:
            assert isinstance(module, PreScaledLinear)
            assert torch.equal(module.pre_quant_scale, written.tensors[f"{file_layer}.pre_quant_scale"].to(dtype))
        else:
            assert not isinstance(module, PreScaledLinear)
    quantized = sorted(k for k in written.oracle if held(k))
    assert encoder.kept_layers == () and list(encoder.dequantised_layers) == quantized
    assert encoder.load_report in caplog.text and caplog.text.count(written.path.name) == 1
    assert "int8_tensorwise (1 layer) dequantised on load to " in encoder.load_report  # the embedding table
    assert "the caller holds it dense (it runs no F.linear)" in encoder.load_report


REQUESTS = {"prompt": {}, "fl2va": dict(keyframes=[pixels(48, 80, 3, seed=1), pixels(48, 80, 3, seed=2)])}


@pytest.mark.parametrize("request_kind", list(REQUESTS))
@pytest.mark.parametrize("kind", KINDS)
def test_states_equal_the_bf16_file_of_the_dequantised_weights(files, kind, request_kind):
    written = files[kind]
    got = load(written.path).encode(PROMPT, **REQUESTS[request_kind])
    reference = prescale_inputs(load(written.plain), written.tensors)
    want = reference.encode(PROMPT, **REQUESTS[request_kind])
    assert got.tags.tolist() == want.tags.tolist() and got.embeds.shape[1] == TINY_TEXT_WIDTH
    assert torch.equal(got.embeds, want.embeds)
    if kind == "nvfp4_awq":  # the scales are not the identity: without them the states differ
        unscaled = load(written.plain).encode(PROMPT, **REQUESTS[request_kind])
        assert (unscaled.embeds.float() - want.embeds.float()).norm() > 0.05 * want.embeds.float().norm()


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_states_agree_with_the_bf16_file_to_its_rounding(files, kind):
    written = files[kind]
    got = load(written.path, dtype=torch.float32).encode(PROMPT)
    want = prescale_inputs(load(written.plain, dtype=torch.float32), written.tensors).encode(PROMPT)
    error = ((got.embeds - want.embeds).norm() / want.embeds.norm()).item()
    assert 0 < error < 2**-6, error


@pytest.mark.parametrize("kind", KINDS)
def test_kept_as_comfy_kitchen_layers(files, kind, allow_cpu_kernels):
    written = files[kind]
    encoder = load(written.path)
    quantized = sorted(k for k in written.oracle if held(k))
    linears = [k for k in quantized if k != "model.embed_tokens.weight"]
    assert list(encoder.kept_layers) == linears and encoder.dequantised_layers == ("model.embed_tokens.weight",)
    assert "kept quantised as comfy-kitchen layers for cpu" in encoder.load_report
    for key in linears:
        weight = encoder.model.get_parameter(model_key(key))
        qt = written.oracle[key]
        assert isinstance(weight, QuantizedTensor) and weight.dtype == torch.bfloat16 and not weight.requires_grad
        assert torch.equal(weight.layout_cls.get_plain_tensors(weight)[0], qt.layout_cls.get_plain_tensors(qt)[0])
    embedding = encoder.language_model.embed_tokens.weight
    assert not isinstance(embedding, QuantizedTensor)
    assert torch.equal(embedding, written.oracle["model.embed_tokens.weight"].dequantize())
    # a streamed layer carries its stored bytes: the file's codes, scales and AWQ scales, and its norms
    stored = sum(
        v.numel() * v.element_size()
        for k, v in written.tensors.items()
        if k.startswith("model.layers.0.") and not k.endswith(".comfy_quant")
    )
    assert encoder.layer_bytes == stored
    dense = load(written.path, held="dequantize")
    got, want = encoder.encode(PROMPT), dense.encode(PROMPT)
    if kind == "int8_convrot":  # the int8 matmul quantises each row of activations to 8 bits (a step of amax/127)
        error = ((got.embeds.float() - want.embeds.float()).norm() / want.embeds.float().norm()).item()
        assert 0 < error < 0.05, error
    else:  # nvfp4 with a plain input: the matmul with the dequantised weight
        assert torch.equal(got.embeds, want.embeds)
    assert torch.equal(encoder.place(stream=True).encode(PROMPT).embeds, got.embeds)


def test_held_choices_and_the_run_device(files, monkeypatch):
    path = files["int8_convrot"].path
    with pytest.raises(
        H3BackendUnavailable,
        match=r"layer 'visual\.blocks\.0\.attn\.qkv' \(int8_convrot\) "
        r"cannot be kept as a comfy-kitchen layer: comfy-kitchen has no "
        r"int8_convrot kernels for cpu",
    ):
        load(path, held="kitchen")
    with pytest.raises(H3InputError, match=r"held: got 'int8'; allowed: 'auto', 'dequantize', 'kitchen'"):
        load(path, held="int8")
    seen = []
    monkeypatch.setattr(
        kitchen,
        "kitchen_support",
        lambda fmt, kind, dtype, device: seen.append((device, dtype)) or (False, f"none for {device}"),
    )
    load(path, device="cpu", run_device="cuda:0")  # loaded in host memory for a GPU
    assert seen and set(seen) == {(torch.device("cuda:0"), torch.bfloat16)}
    seen.clear()
    load(path, device="cuda:0")  # where the encodes run decides when no run device is given
    assert seen and set(seen) == {(torch.device("cuda:0"), torch.bfloat16)}


def test_the_tiny_quantized_files_load(tmp_path):
    for kind in KINDS:
        path = write_tiny_quantized_text_encoder_file(tmp_path, kind, layers=2)
        assert path.name == f"h3_tiny_random_qwen3vl_{kind}.safetensors" and path.parent.name == "text_encoders"
        encoder = load_text_encoder(path, tokenizer=host_tokenizer_dir(), layer=2)
        assert encoder.dequantised_layers and torch.isfinite(encoder.encode("a fox runs").embeds).all()


# ---- refusals -------------------------------------------------------------------------------------


def refused(path, pattern, monkeypatch):
    read = _reads(monkeypatch)
    with pytest.raises(H3InputError, match=pattern):
        describe_text_encoder_file(path)
    with pytest.raises(H3InputError, match=pattern):
        load(path)
    assert all(key.endswith(".comfy_quant") for key in read)  # no weight read


def variant(files, tmp_path, name, kind="int8_convrot", drop=(), **changes):
    tensors = {k: v for k, v in files[kind].tensors.items() if k not in drop}
    tensors.update(changes)
    path = tmp_path / name
    save_file(tensors, str(path))
    return path


def comfy_quant(spec: dict) -> torch.Tensor:
    """The sidecar as comfy/ops.py ``_quantized_weight_state_dict`` writes it."""
    return torch.tensor(list(json.dumps(spec).encode("utf-8")), dtype=torch.uint8)


def relaid(layer: str, weight: torch.Tensor, spec: dict) -> dict:
    """``layer`` quantised anew by comfy-kitchen into ``spec``'s format, with its sidecar."""
    if spec["format"] == "nvfp4":
        qt = QuantizedTensor.from_float(weight, "TensorCoreNVFP4Layout")
    else:
        qt = QuantizedTensor.from_float(
            weight, "TensorWiseINT8Layout", per_channel=True, convrot=True, convrot_groupsize=GROUP
        )
    return {**qt.state_dict(f"{layer}.weight"), f"{layer}.comfy_quant": comfy_quant(spec)}


UP = "model.layers.0.mlp.up_proj"
INT8 = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": GROUP}


def test_unknown_and_unread_formats_are_refused_naming_format_file_and_layer(files, tmp_path, monkeypatch):
    unknown = variant(files, tmp_path, "mxfp8.safetensors", **{f"{UP}.comfy_quant": comfy_quant({"format": "mxfp8"})})
    refused(
        unknown,
        r"mxfp8\.safetensors: layer 'model\.layers\.0\.mlp\.up_proj' is quantized as 'mxfp8', which this "
        r"pack does not read",
        monkeypatch,
    )
    scale = torch.tensor(0.01)
    fp8 = variant(
        files,
        tmp_path,
        "fp8.safetensors",
        **{
            f"{UP}.weight": (torch.randn(64, TINY_TEXT_WIDTH) / scale).to(torch.float8_e4m3fn),
            f"{UP}.weight_scale": scale,
            f"{UP}.comfy_quant": comfy_quant({"format": "float8_e4m3fn"}),
        },
    )
    refused(
        fp8,
        r"fp8\.safetensors: layer 'model\.layers\.0\.mlp\.up_proj' is quantized as 'float8_e4m3fn', which "
        r"the text encoder does not read; it reads ComfyUI's int8_convrot and nvfp4_awq text encoders",
        monkeypatch,
    )
    unmarked = variant(files, tmp_path, "unmarked.safetensors", drop=(f"{UP}.comfy_quant",))
    refused(
        unmarked,
        r"unmarked\.safetensors: a quantized Qwen3-VL text encoder \(I8 weights\) is not supported; use "
        r"the bf16 file or ComfyUI's int8_convrot or nvfp4_awq file",
        monkeypatch,
    )


def test_quantized_weights_are_checked_against_the_unquantized_layout(files, tmp_path, monkeypatch):
    wide = variant(files, tmp_path, "wide.safetensors", **relaid(UP, torch.randn(65, TINY_TEXT_WIDTH), INT8))
    refused(
        wide,
        r"wide\.safetensors: not a complete Qwen3-VL text encoder in ComfyUI's layout: 1 of the wrong shape, "
        r"first \['model\.layers\.0\.mlp\.up_proj\.weight \[65, 32\] \(expected \[64, 32\]\)'\]",
        monkeypatch,
    )
    nvfp4 = {"format": "nvfp4", "full_precision_matrix_mult": True}
    long = variant(files, tmp_path, "long.safetensors", kind="nvfp4_awq", **relaid(UP, torch.randn(64, 48), nvfp4))
    refused(
        long,
        r"long\.safetensors: .*1 of the wrong shape, first \['model\.layers\.0\.mlp\.up_proj\.weight \[64, "
        r"48\] \(expected \[64, 32\]\)'\]",
        monkeypatch,
    )
    down = "model.layers.0.mlp.down_proj"
    short = variant(
        files,
        tmp_path,
        "awq.safetensors",
        kind="nvfp4_awq",
        **{f"{down}.pre_quant_scale": torch.ones(56, dtype=torch.bfloat16)},
    )
    refused(
        short,
        r"awq\.safetensors: layer 'model\.layers\.0\.mlp\.down_proj' \(nvfp4_awq\): "
        r"'model\.layers\.0\.mlp\.down_proj\.pre_quant_scale' is \[56\], expected one AWQ input scale per "
        r"input column, \[64\]",
        monkeypatch,
    )
    unscaled = variant(files, tmp_path, "scale.safetensors", drop=(f"{UP}.weight_scale",))
    refused(
        unscaled,
        r"scale\.safetensors: layer 'model\.layers\.0\.mlp\.up_proj' \(int8_convrot\): has no "
        r"'model\.layers\.0\.mlp\.up_proj\.weight_scale'",
        monkeypatch,
    )


def test_an_embedding_table_takes_no_awq_scales(files, tmp_path, monkeypatch):
    table = files["nvfp4_awq"].oracle["model.embed_tokens.weight"].dequantize()
    tensors = relaid("model.embed_tokens", table, {"format": "nvfp4"})
    tensors["model.embed_tokens.pre_quant_scale"] = torch.ones(TINY_TEXT_WIDTH, dtype=torch.bfloat16)
    path = variant(files, tmp_path, "table.safetensors", kind="nvfp4_awq", **tensors)
    refused(
        path,
        r"table\.safetensors: layer 'model\.embed_tokens' is an embedding table, which has no input for "
        r"its 'model\.embed_tokens\.pre_quant_scale'",
        monkeypatch,
    )


def test_a_quantized_dit_is_not_a_text_encoder(tmp_path, monkeypatch):
    path = tmp_path / "minimax_h3_fl2va_int8_convrot.safetensors"
    save_file(
        {
            **relaid("blocks.0.mlp.fc1", torch.randn(64, 32), INT8),
            "blocks.0.adaln_proj.linear.weight": torch.zeros(4, 2),
        },
        str(path),
    )
    refused(
        path,
        r"int8_convrot\.safetensors: not a Qwen3-VL text encoder: it looks like a diffusion model \(DiT\)",
        monkeypatch,
    )
