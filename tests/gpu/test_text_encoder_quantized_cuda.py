"""The quantised text encoders' comfy-kitchen layers on a CUDA GPU (skipped without one), against the same files
dequantised on load (h3_core.formats.qwen3vl_weights / text_encoder).

The files are written as ComfyUI writes ``qwen3vl_32b_minimax_h3_int8_convrot`` / ``_nvfp4_awq``
(``quantize_text_encoder_state``: comfy-kitchen's own quantisers, ``comfy_quant`` sidecars), from a random
Qwen3-VL of Qwen3-VL-32B's family whose text model is 256 wide, so that every decoder linear's input holds
ConvRot groups of 256, the released files' group.

int8 ConvRot kept: ``F.linear`` runs comfy-kitchen's int8 matmul, which rotates each group of activations and
rounds each row to 8 bits (a step of amax/127), so the states differ from the dequantised model's by a few per
cent (bounded by 5 %) and are not equal to them (the kernel ran). nvfp4 kept: with a plain input comfy-kitchen
multiplies by the weight it dequantises on the device, the weight the dequantised load computed there, so the
states are equal.
"""

import pytest
import torch
from safetensors.torch import save_file
from tiny_checkpoints import quantize_text_encoder_state

from h3_core.formats.kitchen import kitchen_support
from h3_core.pipeline.text_encoder import load_text_encoder

# a GPU machine without comfy-kitchen runs the other GPU tests
QuantizedTensor = pytest.importorskip("comfy_kitchen.tensor", reason="comfy-kitchen is not installed").QuantizedTensor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = torch.device("cuda")
LAYER = 3
GROUP = 256
PROMPT = "<d>Run!</d> a fox runs through snow"
FORMATS = {"int8_convrot": ("int8_tensorwise", "int8_convrot"), "nvfp4_awq": ("nvfp4", "nvfp4_awq")}


def host_tokenizer_dir():
    from comfy_host import comfyui_root

    try:
        return comfyui_root() / "comfy" / "text_encoders" / "qwen25_tokenizer"
    except RuntimeError as exc:
        pytest.skip(str(exc))


def wide_state() -> dict[str, torch.Tensor]:
    """A seeded random Qwen3-VL (bf16) of Qwen3-VL-32B's family with a 256-wide text model, in ComfyUI's layout
    as its H3 file is cut (no final norm, no output head)."""
    import transformers

    from h3_core.formats.qwen3vl_checkpoint import LAYOUTS, PUBLISHED

    cfg = transformers.Qwen3VLConfig(
        text_config=dict(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=LAYER + 1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=128,
            vocab_size=151936,
            **PUBLISHED["text"],
        ),
        vision_config=dict(
            depth=25,
            hidden_size=64,
            intermediate_size=64,
            out_hidden_size=256,
            num_position_embeddings=64,
            patch_size=16,
            temporal_patch_size=2,
            spatial_merge_size=2,
            **PUBLISHED["vision"],
        ),
        **PUBLISHED["ids"],
    )
    torch.manual_seed(6)
    model = transformers.Qwen3VLForConditionalGeneration(cfg).to(torch.bfloat16)
    return {
        LAYOUTS[0].file_key(k): v
        for k, v in model.state_dict().items()
        if k not in ("lm_head.weight", "model.language_model.norm.weight")
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root, state = tmp_path_factory.mktemp("quantized_text_encoder_cuda"), wide_state()
    written = {}
    for kind in FORMATS:
        tensors, oracle = quantize_text_encoder_state(state, kind, group=GROUP)
        path = root / f"qwen3vl_wide_{kind}.safetensors"
        save_file(tensors, str(path))
        written[kind] = path, oracle
    return written


def supported(kind: str):
    fmt, name = FORMATS[kind]
    ok, how = kitchen_support(fmt, name, torch.bfloat16, torch.device("cuda", torch.cuda.current_device()))
    if not ok:
        pytest.skip(f"comfy-kitchen keeps no {name} layers on this GPU: {how}")


def load(path, **kw):
    return load_text_encoder(path, tokenizer=host_tokenizer_dir(), dtype=torch.bfloat16, layer=LAYER, **kw)


def relative(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def keyframes():
    g = torch.Generator().manual_seed(1)
    return [torch.rand(48, 80, 3, generator=g), torch.rand(48, 80, 3, generator=g)]


@pytest.mark.parametrize("kind", list(FORMATS))
def test_kept_layers_against_dequantised(files, kind):
    supported(kind)
    path, oracle = files[kind]
    kept = load(path, device=DEV, held="kitchen")
    linears = sorted(
        k for k in oracle if k != "model.embed_tokens.weight" and not k.startswith(f"model.layers.{LAYER}.")
    )
    assert list(kept.kept_layers) == linears and kept.dequantised_layers == ("model.embed_tokens.weight",)
    dense = load(path, device=DEV, held="dequantize")
    assert dense.kept_layers == ()
    for request in ({}, {"keyframes": keyframes()}):
        got, want = kept.encode(PROMPT, **request), dense.encode(PROMPT, **request)
        assert got.tags.tolist() == want.tags.tolist()
        if kind == "int8_convrot":
            assert 0 < relative(got.embeds, want.embeds) < 0.05
        else:
            assert torch.equal(got.embeds, want.embeds)
    weight = kept.language_model.layers[0].mlp.down_proj.weight
    assert isinstance(weight, QuantizedTensor) and weight.device.type == DEV.type
    codes = weight.layout_cls.get_plain_tensors(weight)[0]
    qt = oracle["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(codes.cpu(), qt.layout_cls.get_plain_tensors(qt)[0].cpu())


@pytest.mark.parametrize("kind", list(FORMATS))
def test_kept_layers_move_at_their_stored_size(files, kind):
    supported(kind)
    path, _ = files[kind]
    resident = load(path, device=DEV, held="kitchen")
    want = resident.encode(PROMPT).embeds
    resident.to_host()
    # loaded in host memory for the GPU, then placed per run as the host does
    encoder = load(path, device="cpu", run_device=DEV, held="kitchen")
    assert encoder.kept_layers == resident.kept_layers
    tensors = [*encoder.model.parameters(), *encoder.model.buffers()]
    slack = 512 * 3 * len(tensors)  # the allocator rounds each tensor up to 512 bytes; a kept one is up to 3
    base = torch.cuda.memory_allocated()
    encoder.place(DEV, stream=True)
    assert 0 <= torch.cuda.memory_allocated() - base - encoder.kept_bytes < slack
    assert torch.equal(encoder.encode(PROMPT).embeds, want)  # streamed = resident
    encoder.place(stream=False)
    assert 0 <= torch.cuda.memory_allocated() - base - encoder.resident_bytes < slack
    assert isinstance(encoder.language_model.layers[0].self_attn.o_proj.weight, QuantizedTensor)
    assert torch.equal(encoder.encode(PROMPT).embeds, want)
    encoder.to_host()
    assert torch.cuda.memory_allocated() == base
