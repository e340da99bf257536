"""The DiT in the host's own ModelPatcher (ComfyUI 0.3.75, imported from the test host): LoRA patches made by the
pack's LoRA node are applied by the host when it loads the model — into bf16 weights as ``merge_lora`` merges them,
into fp8 linears re-quantised from the patched weights — and taken off again bit for bit when the base model (or
another strength) is loaded, and into comfy-kitchen layers dequantised, patched and quantised afresh by the library
(the original put back as it was); the DiT's partial unload frees what is asked, a block at a time."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from h3_core.formats.lora import lora_patches, merge_lora, read_lora
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.models.fp8_linear import Fp8Linear, quantize_linears, quantize_rows_reference
from h3_core.pipeline.packing import pack_sequence

ROOT = Path(__file__).resolve().parents[2]
HOST = ROOT / ".host" / "comfyui-0.3.75"
CFG = DiTConfig(
    hidden=48,
    layers=4,
    heads=2,
    head_dim=32,
    ffn=64,
    text_dim=40,
    freq_dim=16,
    time_hidden=24,
    time_embed=20,
    rope_freqs=4,
)


@pytest.fixture(scope="module")
def pack():
    """The pack imported as the host imports it (a package of its folder's name), with the host's modules on the
    path in front of it and the host's CPU mode set."""
    if not (HOST / "main.py").is_file():
        pytest.fail(f"no ComfyUI at {HOST}: tests/run.sh installs it")
    sys.path.insert(0, str(HOST))
    import comfy.options

    comfy.options.enable_args_parsing(False)
    from comfy.cli_args import args

    args.cpu = True
    if "h3_hybrid" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "h3_hybrid", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["h3_hybrid"] = module
        spec.loader.exec_module(module)
    import comfy.model_management as mm
    from h3_hybrid.nodes import lora, patchers

    yield mm, lora, patchers
    mm.unload_all_models()


def tiny(fp8: bool):
    torch.manual_seed(0)
    model = H3DiT(CFG).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    if fp8:
        model.to(torch.bfloat16)
        quantize_linears(model)
    return model


def lora_file(tmp_path):
    g = torch.Generator().manual_seed(1)
    inner = CFG.heads * CFG.head_dim
    tensors = {
        # a diffusers-named LoRA on q (a third of the fused qkv rows) and on the FFN's output
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(2, CFG.hidden, generator=g),
        "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(inner, 2, generator=g) * 0.5,
        "diffusion_model.blocks.1.mlp.fc2.lora_down.weight": torch.randn(2, CFG.ffn, generator=g),
        "diffusion_model.blocks.1.mlp.fc2.lora_up.weight": torch.randn(CFG.hidden, 2, generator=g) * 0.5,
        "diffusion_model.blocks.1.mlp.fc2.alpha": torch.tensor(4.0),
    }
    path = tmp_path / "style.safetensors"
    save_file(tensors, str(path))
    return path


def load(mm, patchers, patcher):
    run = patchers.DiTRun(pack_sequence(torch.ones(3, dtype=torch.long), 4, 2, 2, 3), "auto", 2)
    mm.load_models_gpu([patcher], memory_required=patcher.prepare(run))


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same(got, want):
    assert got.keys() == want.keys()
    for key in want:
        same = (
            got[key].view(torch.uint8).equal(want[key].view(torch.uint8))
            if got[key].dtype.itemsize == 1
            else torch.equal(got[key], want[key])
        )
        assert got[key].dtype == want[key].dtype and same, key


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-or-fp32", "fp8"])
def test_patches_apply_on_load_and_come_off_exactly(pack, tmp_path, fp8):
    mm, lora, patchers = pack
    model = tiny(fp8)
    base = patchers.H3DiTPatcher.wrap(model, "auto")
    original = snapshot(model)
    deltas = read_lora(lora_file(tmp_path), 1.0)
    patched = base.clone()
    patched.add_patches(lora.host_patches(lora_patches(model, deltas)), strength_patch=0.5)
    load(mm, patchers, patched)

    reference = tiny(fp8)
    if fp8:
        # the reference of an fp8 patch: the layer's weight as its codes stand for it, the LoRA added in fp32,
        # quantised afresh (amax / 448 per output channel)
        for d in read_lora(lora_file(tmp_path), 0.5):
            layer = reference.get_submodule(d.module)
            weight = layer.dequantized_weight()
            merged = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            merged.weight.data = weight
            merge_lora(torch.nn.ModuleDict({"m": merged}), [type(d)("m", d.down, d.up, d.scale, d.part, d.swap_halves)])
            codes, scale = quantize_rows_reference(merged.weight.data)
            layer.weight.data, layer.weight_scale.data = codes, scale.view(-1)
    else:
        merge_lora(reference, read_lora(lora_file(tmp_path), 0.5))
    # the host adds (strength · alpha / rank) · up @ down in fp32 as merge_lora does: the same numbers
    assert_same(snapshot(model), reference.state_dict())
    assert not torch.equal(model.blocks[0].attn.qkv_proj.weight, original["blocks.0.attn.qkv_proj.weight"])

    load(mm, patchers, base)  # the base model again: every patch taken off
    assert_same(snapshot(model), original)
    if fp8:
        assert isinstance(model.blocks[0].attn.qkv_proj, Fp8Linear)


def test_patches_on_comfy_kitchen_layers_requantise_and_come_off_exactly(pack, tmp_path, monkeypatch):
    """An int8_convrot file's block linears kept as comfy-kitchen weights (the library's eager kernels allowed
    on the CPU): the host's patch arithmetic on comfy-kitchen's fp32 dequantisation, quantised afresh by the
    library in the layer's own layout; the base model again puts the file's own weights back."""
    from comfy_kitchen.tensor import QuantizedTensor
    from tiny_checkpoints import quantize_int8_convrot

    from h3_core.formats import kitchen
    from h3_core.formats.checkpoints import load_h3_model

    mm, lora, patchers = pack
    monkeypatch.setattr(kitchen, "kitchen_support", lambda fmt, kind, dtype, device: (True, "eager backend (test)"))
    state = {k: v.to(torch.bfloat16) for k, v in tiny(False).state_dict().items()}
    layers = [
        f"blocks.{i}.{n}" for i in range(CFG.layers) for n in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
    ]
    tensors, _ = quantize_int8_convrot(state, layers, group=16)
    path = tmp_path / "int8_convrot.safetensors"
    save_file(tensors, str(path))

    def kept():
        return load_h3_model(path, device="cpu", dtype=torch.bfloat16, cfg=CFG, run_device="cpu")

    model, reference = kept(), kept()
    assert isinstance(model.blocks[0].attn.qkv_proj.weight, QuantizedTensor)
    original = {k: model.get_parameter(f"{k}.weight").detach().clone() for k in layers}
    base = patchers.H3DiTPatcher.wrap(model, "auto")
    patched = base.clone()
    patched.add_patches(lora.host_patches(lora_patches(model, read_lora(lora_file(tmp_path), 1.0))), strength_patch=0.5)
    load(mm, patchers, patched)

    touched = set()
    for d in read_lora(lora_file(tmp_path), 0.5):
        like = reference.get_parameter(f"{d.module}.weight")
        merged = torch.nn.Linear(like.shape[1], like.shape[0], bias=False)
        merged.weight.data = like.dequantize().float()
        merge_lora(torch.nn.ModuleDict({"m": merged}), [type(d)("m", d.down, d.up, d.scale, d.part, d.swap_halves)])
        want = kitchen.requantize(like, merged.weight.data, torch.bfloat16)
        got = model.get_parameter(f"{d.module}.weight")
        assert isinstance(got, QuantizedTensor) and got.dtype == torch.bfloat16
        for g, w in zip(got.layout_cls.get_plain_tensors(got), want.layout_cls.get_plain_tensors(want)):
            assert torch.equal(g, w), d.module
        assert not torch.equal(got.dequantize(), original[d.module].dequantize())
        touched.add(d.module)
    for key in set(layers) - touched:
        assert torch.equal(model.get_parameter(f"{key}.weight").dequantize(), original[key].dequantize())

    load(mm, patchers, base)  # the base model again: the file's own weights, bit for bit
    for key in layers:
        got, want = model.get_parameter(f"{key}.weight"), original[key]
        assert isinstance(got, QuantizedTensor) and got.dtype == want.dtype, key
        for g, w in zip(got.layout_cls.get_plain_tensors(got), want.layout_cls.get_plain_tensors(want)):
            assert torch.equal(g, w), key


def test_a_new_strength_re_patches_from_the_base_weights(pack, tmp_path):
    mm, lora, patchers = pack
    model = tiny(False)
    base = patchers.H3DiTPatcher.wrap(model, "auto")
    patches = lora.host_patches(lora_patches(model, read_lora(lora_file(tmp_path), 1.0)))
    strong, weak = base.clone(), base.clone()
    strong.add_patches(patches, strength_patch=1.0)
    weak.add_patches(patches, strength_patch=0.25)
    load(mm, patchers, strong)
    load(mm, patchers, weak)
    reference = tiny(False)
    merge_lora(reference, read_lora(lora_file(tmp_path), 0.25))
    assert_same(snapshot(model), reference.state_dict())


def test_partial_unload_frees_at_least_what_is_asked_a_block_at_a_time(pack):
    mm, lora, patchers = pack
    model = tiny(True)
    patcher = patchers.H3DiTPatcher.wrap(model, "auto")
    load(mm, patchers, patcher)
    block = max(sum(t.numel() * t.element_size() for t in (*b.parameters(), *b.buffers())) for b in model.blocks)
    before = patcher.loaded_size()
    freed = patcher.partially_unload(patcher.offload_device, int(1.5 * block))
    assert int(1.5 * block) <= freed < int(1.5 * block) + block
    assert patcher.loaded_size() == before - freed
    assert patcher.placement.fitted.offload.stats.resident_blocks < CFG.layers


def test_the_attention_kernels_chosen_ahead_are_the_ones_a_run_then_uses(pack):
    """The server's start thread chooses the dense-attention kernels for the pack's (dtype, head dim) pairs
    (here on the CPU); a later run's resolution finds each already probed and gets the same kernel."""
    from h3_hybrid.h3_core.attention.kernels import probed_kernels, resolve_kernel  # the pack's own copy
    from h3_hybrid.h3_core.pipeline.first_library_calls import choose_attention_kernels

    chosen = choose_attention_kernels("cpu")
    assert set(chosen) == {"float16 d=128", "bfloat16 d=128", "float16 d=64"}
    probed = probed_kernels()
    for label, name in chosen.items():
        dtype, head_dim = getattr(torch, label.split()[0]), int(label.split("=")[1])
        assert probed[("cpu", dtype, head_dim)].name == name == resolve_kernel(torch.device("cpu"), dtype, head_dim)


def test_the_vae_loaders_leave_the_weights_to_the_hosts_first_load(pack, tmp_path):
    """Each VAE loader's model stays on the meta device (its size already the loaded one) until the host first
    loads it; that load reads what a direct load of the file reads."""
    from h3_hybrid.nodes import loaders
    from tiny_checkpoints import write_tiny_checkpoints

    from h3_core.formats.audio_vae import load_audio_vae
    from h3_core.formats.video_vae import load_video_vae

    mm, _, patchers = pack
    tiny = write_tiny_checkpoints(tmp_path)
    cpu = torch.device("cpu")
    for loader, path, direct in (
        (loaders.H3VideoVAELoader, tiny.video_vae, load_video_vae(tiny.video_vae, dtype=torch.float32)),
        (loaders.H3AudioVAELoader, tiny.audio_vae, load_audio_vae(tiny.audio_vae)),
    ):
        patcher = loaders._vae_patcher(loader.read(path, cpu), cpu)
        assert isinstance(patcher, patchers.VAEPatcher)
        assert all(t.is_meta for t in patcher.model.state_dict().values())
        size = sum(t.numel() * t.element_size() for t in direct.state_dict().values())
        assert patcher.model_size() == size
        assert patchers.load_vae(patcher) is patcher.model
        got, want = patcher.model.state_dict(), direct.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), loader.__name__
        assert patcher.model_size() == size
