"""The DiT entry point (h3_core.formats.checkpoints): describing a checkpoint from its headers in every layout, refusing
what cannot load, and loading H3 / VDN-H3 with LoRAs exactly as the individual loaders and merge_lora do."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from h3_core.attention import WindowSpec
from h3_core.errors import H3InputError
from h3_core.formats.checkpoints import LoraSpec, describe_dit_checkpoint, load_h3_model
from h3_core.formats.lora import merge_lora, read_lora
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.models.hybrid import HybridContext
from h3_core.pipeline.packing import pack_sequence

CFG = DiTConfig(
    hidden=24,
    layers=2,
    heads=2,
    head_dim=16,
    ffn=32,
    text_dim=20,
    freq_dim=8,
    time_hidden=12,
    time_embed=10,
    rope_freqs=2,
)
TINY_DIFFUSERS = dict(
    num_attention_heads=2,
    attention_head_dim=16,
    hidden_size=24,
    num_layers=2,
    num_refiner_layers=2,
    ffn_dim=32,
    text_dim=20,
    freq_dim=8,
    time_embed_hidden_dim=12,
    time_embed_dim=10,
    rope_freq_dim=2,
)
CURVE = (9, 4)  # the pruned form's (grid, width)
ADDED = (".attn.softmax_gate.", ".attn.to_out_linear.", ".attn.linear_attention.")
PRE_V2 = (
    (".attn.linear_attention.output_gate.", ".attn.far.gate."),
    (".attn.linear_attention.", ".attn.far."),
    (".attn.softmax_gate.", ".attn.local_gate."),
    (".attn.to_out_linear.", ".attn.w_o_far."),
)
INNER, RANK = CFG.heads * CFG.head_dim, 3


# ---- writing tiny checkpoints -------------------------------------------------------------------


def random_state(cfg: DiTConfig, seed: int) -> dict[str, torch.Tensor]:
    """A random model's state in native names (``qkv_proj`` stacked [q; k; v])."""
    torch.manual_seed(seed)
    model = H3DiT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def per_head_interleaved(state: dict, cfg: DiTConfig) -> dict:
    """The official shards' qkv rows: head h holds [q_h; k_h; v_h]."""

    def interleave(w):
        return w.view(3, cfg.heads, cfg.head_dim, -1).transpose(0, 1).reshape(3 * cfg.inner, -1).contiguous()

    return {k: interleave(v) if k.endswith("attn.qkv_proj.weight") else v for k, v in state.items()}


def write_shards(state: dict, folder: Path, shards: int = 2, index: bool = False) -> Path:
    """``model-0000k-of-0000n.safetensors`` files, optionally with the index json naming them."""
    folder.mkdir(parents=True)
    keys = sorted(state)
    weight_map = {}
    for k in range(shards):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[k::shards]
        save_file({key: state[key] for key in part}, str(folder / name))
        weight_map.update({key: name for key in part})
    if index:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def split_vdn(state: dict, rename=()) -> tuple[dict, dict]:
    """A hybrid model's state as the base DiT file and the linear-branch file (``transformer_blocks.`` names)."""
    base = {k: v for k, v in state.items() if not any(a in k for a in ADDED)}
    branch = {}
    for key, value in state.items():
        if any(a in key for a in ADDED):
            name = "transformer_blocks." + key.removeprefix("blocks.")
            for new, old in rename:
                if new in name:
                    name = name.replace(new, old)
                    break
            branch[name] = value
    branch["__window__"] = torch.tensor([1, 5])
    return base, branch


def comfy_quant(spec: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(spec).encode()), dtype=torch.uint8)


def fp8_scaled(state: dict) -> dict:
    """ComfyUI's per-layer fp8 form of the blocks' big linears."""
    out = {}
    for key, value in state.items():
        if key.startswith("blocks.") and key.endswith(("qkv_proj.weight", "fc1.weight", "fc2.weight")):
            layer = key.removesuffix(".weight")
            scale = value.abs().amax() / 448
            out[key] = (value / scale).to(torch.float8_e4m3fn)
            out[layer + ".weight_scale"] = scale.reshape(())
            out[layer + ".comfy_quant"] = comfy_quant({"format": "float8_e4m3fn"})
        else:
            out[key] = value
    return out


@pytest.fixture(scope="module")
def dense_state():
    return random_state(CFG, 0)


@pytest.fixture(scope="module")
def pruned_state():
    return random_state(replace(CFG, adaln_curve_grid=CURVE[0], time_embed=CURVE[1]), 1)


@pytest.fixture(scope="module")
def hybrid_state():
    return random_state(replace(CFG, hybrid=True), 2)


@pytest.fixture(scope="module")
def written(tmp_path_factory, dense_state, pruned_state, hybrid_state):
    """One checkpoint per layout on disk, by name."""
    root = tmp_path_factory.mktemp("checkpoints")
    paths = {}

    def file(name, state):
        save_file(state, str(root / name))
        return root / name

    paths["comfy"] = file("minimax_h3_fl2va_bf16.safetensors", dense_state)
    paths["comfy prefixed"] = file(
        "prefixed.safetensors", {"model.diffusion_model." + k: v for k, v in dense_state.items()}
    )
    paths["official shards"] = write_shards(per_head_interleaved(dense_state, CFG), root / "FL2VA" / "transformer")
    paths["official task folder"] = root / "FL2VA"
    paths["official shards with index"] = write_shards(
        per_head_interleaved(dense_state, CFG), root / "indexed", 3, True
    )
    paths["pruned"] = file("minimax_h3_fl2va_pruned_bf16.safetensors", pruned_state)
    paths["fp8 scaled"] = file("minimax_h3_fl2va_fp8_scaled.safetensors", fp8_scaled(dense_state))
    paths["pruned fp8 scaled"] = file("minimax_h3_fl2va_pruned_fp8_scaled.safetensors", fp8_scaled(pruned_state))
    vdn_base, vdn_branch = split_vdn(hybrid_state)
    paths["vdn base"] = file("vdn_base.safetensors", vdn_base)
    paths["vdn branch"] = file("branch.safetensors", vdn_branch)
    paths["vdn branch pre-v2"] = file("branch_pre_v2.safetensors", split_vdn(hybrid_state, PRE_V2)[1])
    paths["vdn official base"] = write_shards(per_head_interleaved(vdn_base, CFG), root / "vdn_official")
    pruned_hybrid = random_state(replace(CFG, hybrid=True, adaln_curve_grid=CURVE[0], time_embed=CURVE[1]), 3)
    pruned_base, pruned_branch = split_vdn(pruned_hybrid)
    paths["vdn pruned base"] = file("vdn_pruned_base.safetensors", pruned_base)
    paths["vdn pruned branch"] = file("vdn_pruned_branch.safetensors", pruned_branch)
    return paths


@pytest.fixture(scope="module")
def diffusers_root(tmp_path_factory):
    """A diffusers model's root folder, its weights (random) under ``transformer/``, written by diffusers."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(4)
    model = diffusers.MiniMaxH3Transformer3DModel(**TINY_DIFFUSERS)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    root = tmp_path_factory.mktemp("diffusers")
    model.save_pretrained(root / "transformer")
    return root


def lora_pair(g: torch.Generator, in_features: int, out_features: int, rank: int = RANK):
    return torch.randn(rank, in_features, generator=g), torch.randn(out_features, rank, generator=g) * 0.1


def write_comfy_lora(path: Path, modules: dict) -> Path:
    """``diffusion_model.<module>.lora_down/up.weight`` and ``.alpha`` for ``{module: (A, B, alpha)}``."""
    tensors = {}
    for module, (A, B, alpha) in modules.items():
        stem = f"diffusion_model.{module}"
        tensors[f"{stem}.lora_down.weight"], tensors[f"{stem}.lora_up.weight"] = A, B
        tensors[f"{stem}.alpha"] = torch.tensor(float(alpha))
    save_file(tensors, str(path))
    return path


def write_peft_lora(folder: Path, modules: dict, adapters=("default",), alpha: float = 2.0 * RANK) -> Path:
    """A peft adapter folder: ``adapter_model.safetensors`` (diffusers names) and ``adapter_config.json``."""
    folder.mkdir(parents=True)
    tensors = {}
    for i, adapter in enumerate(adapters):  # adapter i updates (i + 1) times as much
        for module, (A, B) in modules.items():
            tensors[f"base_model.model.{module}.lora_A.{adapter}.weight"] = A.clone()
            tensors[f"base_model.model.{module}.lora_B.{adapter}.weight"] = B * (i + 1)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": RANK, "lora_alpha": alpha}))
    return folder


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    """A peft adapter (attention and MLP of both blocks, diffusers names) and a ComfyUI LoRA (fused qkv and
    fc2 of block 0): both touch block 0's qkv, so their order matters in bf16."""
    root = tmp_path_factory.mktemp("loras")
    g = torch.Generator().manual_seed(5)
    peft = {}
    for b in range(CFG.layers):
        stem = f"transformer_blocks.{b}"
        for x in "qkv":
            peft[f"{stem}.attn.to_{x}"] = lora_pair(g, CFG.hidden, INNER)
        peft[f"{stem}.attn.to_out.0"] = lora_pair(g, INNER, CFG.hidden)
        peft[f"{stem}.ff.net.0.proj"] = lora_pair(g, CFG.hidden, 2 * CFG.ffn)
    comfy = {
        "blocks.0.attn.qkv_proj": (*lora_pair(g, CFG.hidden, 3 * INNER), 1.5),
        "blocks.0.mlp.fc2": (*lora_pair(g, CFG.ffn, CFG.hidden), 3.0),
    }
    return {
        "peft": write_peft_lora(root / "default", peft),
        "comfy": write_comfy_lora(root / "style.safetensors", comfy),
        "comfy modules": comfy,
    }


# ---- inputs -------------------------------------------------------------------------------------


def sequence(frames: int = 8, text: int = 4, audio: int = 3):
    """Model inputs for a T2VA-like sequence, audio at a second timestep, and its packed layout."""
    packed = pack_sequence(torch.ones(text, dtype=torch.long), frames, 2, 4, audio)
    g = torch.Generator().manual_seed(6)
    timestep_index = torch.zeros(packed.positions.shape[0], dtype=torch.long)
    timestep_index[packed.audio_index] = 1
    args = (
        torch.randn(packed.video_index.numel(), 96, generator=g),
        torch.randn(packed.audio_index.numel(), 32, generator=g),
        torch.randn(text, CFG.text_dim, generator=g),
        torch.tensor([0.3, 0.8]),
        timestep_index,
        packed.tags,
        packed.positions,
        packed.video_index,
        packed.audio_index,
        packed.text_index,
    )
    return args, packed


def forward(model, hybrid: bool = False):
    args, packed = sequence()
    ctx = HybridContext(packed.layout, WindowSpec(1, 3, "both"), "ref", (0, 4)) if hybrid else None
    with torch.no_grad():
        return model(*args, hybrid=ctx)


def assert_identical(a: torch.nn.Module, b: torch.nn.Module, hybrid: bool = False):
    """Same tensors bit for bit, in the same dtypes, and the same forward bit for bit."""
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key
    for x, y in zip(forward(a, hybrid), forward(b, hybrid)):
        assert torch.equal(x, y)


# ---- describing ---------------------------------------------------------------------------------

# name -> (is_branch, layout, key_prefix, qkv_interleaved, curve, fp8_scaled)
EXPECTED = {
    "comfy": (False, "ComfyUI", "", False, None, False),
    "comfy prefixed": (False, "ComfyUI", "model.diffusion_model.", False, None, False),
    "official shards": (False, "official", "", True, None, False),
    "official task folder": (False, "official", "", True, None, False),
    "official shards with index": (False, "official", "", True, None, False),
    "pruned": (False, "ComfyUI", "", False, CURVE, False),
    "fp8 scaled": (False, "ComfyUI", "", False, None, True),
    "pruned fp8 scaled": (False, "ComfyUI", "", False, CURVE, True),
    "vdn base": (False, "ComfyUI", "", False, None, False),
    "vdn branch": (True, "VDN-H3 v2", "", False, None, False),
    "vdn branch pre-v2": (True, "VDN-H3 pre-v2", "", False, None, False),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_describe_says_what_each_layout_is(written, name):
    info = describe_dit_checkpoint(written[name], cfg=CFG)
    assert (
        info.is_branch,
        info.layout,
        info.key_prefix,
        info.qkv_interleaved,
        info.curve,
        info.fp8_scaled,
    ) == EXPECTED[name]
    assert info.pruned == (info.curve is not None)
    if info.curve is not None:
        assert (info.cfg.adaln_curve_grid, info.cfg.time_embed) == CURVE
        assert f"grid {CURVE[0]} x width {CURVE[1]}" in info.summary()


def test_describe_reads_a_task_folder_from_its_transformer_subfolder(written):
    info = describe_dit_checkpoint(written["official task folder"], cfg=CFG)
    assert info.path == written["official shards"] and len(info.files) == 2


def test_describe_a_diffusers_folder_and_its_root(diffusers_root):
    for path in (diffusers_root, diffusers_root / "transformer"):
        info = describe_dit_checkpoint(path, cfg=CFG)
        assert (info.is_branch, info.layout, info.qkv_interleaved, info.pruned, info.fp8_scaled) == (
            False,
            "diffusers",
            False,
            False,
            False,
        )
        assert info.path == diffusers_root / "transformer"


def test_the_official_rule_can_be_overridden(written, tmp_path, dense_state, diffusers_root):
    # an official file consolidated into one file: only the caller knows
    assert describe_dit_checkpoint(written["comfy"], cfg=CFG, qkv_interleaved=True).layout == "official"
    # a ComfyUI file alone in a folder
    folder = tmp_path / "comfy_folder"
    folder.mkdir()
    save_file(dense_state, str(folder / "minimax_h3.safetensors"))
    assert describe_dit_checkpoint(folder, cfg=CFG).layout == "official"
    assert describe_dit_checkpoint(folder, cfg=CFG, qkv_interleaved=False).layout == "ComfyUI"
    with pytest.raises(
        H3InputError,
        match=r"qkv_interleaved=True is for native names without a prefix .*"
        r"this checkpoint is in the diffusers layout",
    ):
        describe_dit_checkpoint(diffusers_root, cfg=CFG, qkv_interleaved=True)
    with pytest.raises(H3InputError, match=r"in the ComfyUI layout under 'model\.diffusion_model\.'"):
        describe_dit_checkpoint(written["comfy prefixed"], cfg=CFG, qkv_interleaved=True)


def test_incomplete_or_mixed_shard_sets_are_refused_naming_the_files(tmp_path, dense_state):
    state = per_head_interleaved(dense_state, CFG)
    indexed = write_shards(state, tmp_path / "indexed", 3, index=True)
    (indexed / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(
        H3InputError,
        match=r"model\.safetensors\.index\.json names shards the folder lacks, first "
        r"\['model-00002-of-00003\.safetensors'\]; the download is incomplete",
    ):
        describe_dit_checkpoint(indexed, cfg=CFG)
    stray = write_shards(state, tmp_path / "stray", 2, index=True)
    save_file({"x": torch.zeros(1)}, str(stray / "old_consolidated.safetensors"))
    with pytest.raises(H3InputError, match=r"does not name, first \['old_consolidated\.safetensors'\]"):
        describe_dit_checkpoint(stray, cfg=CFG)
    unindexed = write_shards(state, tmp_path / "unindexed", 3)
    (unindexed / "model-00003-of-00003.safetensors").unlink()
    with pytest.raises(H3InputError, match=r"holds 2 shards named '-of-' totals \[3\]; the set is incomplete"):
        describe_dit_checkpoint(unindexed, cfg=CFG)
    with pytest.raises(H3InputError, match=r"model-00001-of-00003\.safetensors: one shard of 3; give the folder"):
        describe_dit_checkpoint(unindexed / "model-00001-of-00003.safetensors", cfg=CFG)


@pytest.mark.parametrize(
    "spec, named",
    [
        (
            {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256},
            r"\(int8_convrot\): its 24 input columns are not a multiple of its convrot_groupsize 256",
        ),
        (
            {"format": "nvfp4"},
            r"\(nvfp4\): 'blocks\.0\.attn\.qkv_proj\.weight_scale' is F32 \[96, 1\], expected "
            r"F8_E4M3 block scales \[128, 4\]",
        ),
        ({"format": "svdquant_w4a4"}, r"is quantized as 'svdquant_w4a4', which this pack does not read"),
    ],
)
def test_malformed_or_unknown_quantized_files_are_refused_naming_the_layer(tmp_path, dense_state, spec, named):
    state = dict(dense_state)
    stored = torch.uint8 if spec["format"] == "nvfp4" else torch.int8
    state["blocks.0.attn.qkv_proj.weight"] = torch.zeros(3 * INNER, CFG.hidden, dtype=stored)
    state["blocks.0.attn.qkv_proj.weight_scale"] = torch.ones(3 * INNER, 1)
    state["blocks.0.attn.qkv_proj.comfy_quant"] = comfy_quant(spec)
    path = tmp_path / "minimax_h3_fl2va_int8_convrot.safetensors"
    save_file(state, str(path))
    with pytest.raises(H3InputError, match=rf"{path.name}: layer 'blocks\.0\.attn\.qkv_proj' {named}"):
        describe_dit_checkpoint(path, cfg=CFG)


def test_gguf_and_missing_paths_are_refused(tmp_path):
    gguf = tmp_path / "minimax_h3-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(H3InputError, match=r"minimax_h3-Q4_K_M\.gguf: GGUF checkpoints are not supported yet"):
        describe_dit_checkpoint(gguf, cfg=CFG)
    with pytest.raises(H3InputError, match=r"nowhere\.safetensors: no such file or folder"):
        describe_dit_checkpoint(tmp_path / "nowhere.safetensors", cfg=CFG)


def test_unrecognised_files_name_the_closest_layout_and_first_keys(tmp_path, dense_state):
    vae = tmp_path / "vae.safetensors"
    save_file({"encoder.conv_in.weight": torch.zeros(1), "decoder.proj_out.weight": torch.zeros(1)}, str(vae))
    with pytest.raises(
        H3InputError,
        match=r"vae\.safetensors: not a MiniMax H3 DiT checkpoint this pack can load; "
        r"it is closest to the \w+ layout but missing \d+ keys, first \[.+\] and "
        r"2 unexpected keys, first \['decoder\.proj_out\.weight', "
        r"'encoder\.conv_in\.weight'\]",
    ):
        describe_dit_checkpoint(vae, cfg=CFG)
    extra = tmp_path / "extra.safetensors"
    save_file({**dense_state, "blocks.0.attn.to_gate_compress.weight": torch.zeros(2, 2)}, str(extra))
    with pytest.raises(
        H3InputError,
        match=r"closest to the ComfyUI layout but 1 unexpected keys, first "
        r"\['blocks\.0\.attn\.to_gate_compress\.weight'\]",
    ):
        describe_dit_checkpoint(extra, cfg=CFG)
    short = tmp_path / "short_branch.safetensors"
    save_file(
        {
            k: v
            for k, v in split_vdn(random_state(replace(CFG, hybrid=True), 7))[1].items()
            if not k.startswith("transformer_blocks.1.")
        },
        str(short),
    )
    with pytest.raises(
        H3InputError,
        match=r"short_branch\.safetensors: not a VDN-H3 linear branch checkpoint this "
        r"pack can load; it is closest to the VDN-H3 v2 layout but missing",
    ):
        describe_dit_checkpoint(short, cfg=CFG)


def test_a_checkpoint_for_another_model_size_is_refused_from_its_header(written):
    wider = replace(CFG, hidden=32)
    with pytest.raises(
        H3InputError,
        match=r"minimax_h3_fl2va_bf16\.safetensors: \d+ tensors do not fit the MiniMax "
        r"H3 DiT of this config \(hidden 32, 2 layers, 2 heads of 16\) in the "
        r"ComfyUI layout, first: 'video_patch_proj\.weight' \[24, 96\] for "
        r"'video_patch_proj\.weight' \[32, 96\]",
    ):
        describe_dit_checkpoint(written["comfy"], cfg=wider)
    # same inner width, so qkv fits; the per-head norms say the heads are another size
    more_heads = replace(CFG, heads=4, head_dim=8)
    with pytest.raises(
        H3InputError,
        match=r"in the official layout, first: 'token_refiner\.blocks\.0\.attn\.q_norm"
        r"\.weight' \[16\] for 'token_refiner\.blocks\.0\.attn\.q_norm\.weight' \[8\]",
    ):
        describe_dit_checkpoint(written["official shards"], cfg=more_heads)


# ---- loading ------------------------------------------------------------------------------------


def merged_the_long_way(model, *loras):
    for path, strength, *adapter in loras:
        merge_lora(model, read_lora(path, strength, *adapter))
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dense_model_with_loras_equals_the_long_way(written, loras, dtype):
    chosen = [(loras["peft"], 0.7, "default"), (loras["comfy"], -1.3)]
    model = load_h3_model(written["comfy"], loras=chosen, dtype=dtype, cfg=CFG)
    long_way = merged_the_long_way(
        load_h3_model(written["comfy"], dtype=dtype, cfg=CFG),
        (loras["peft"] / "adapter_model.safetensors", 0.7, "default"),
        (loras["comfy"], -1.3),
    )
    assert_identical(model, long_way)
    assert [(m.lora.path.name, m.lora.strength, m.lora.adapter, m.weights) for m in model.merged_loras] == [
        ("adapter_model.safetensors", 0.7, "default", 2 * 5),
        ("style.safetensors", -1.3, None, 2),
    ]
    assert model.checkpoint.layout == "ComfyUI" and model.branch_checkpoint is None
    assert not any(
        torch.equal(a, b)
        for a, b in zip(forward(model), forward(load_h3_model(written["comfy"], dtype=dtype, cfg=CFG)))
    )


def test_lora_order_is_the_rounding_order_in_bf16(written, loras):
    """Both LoRAs change block 0's qkv; stored in bf16 after each merge, the two orders round differently."""
    chosen = [(loras["peft"], 1.0), (loras["comfy"], 2.0)]
    given = load_h3_model(written["comfy"], loras=chosen, cfg=CFG)
    reversed_ = load_h3_model(written["comfy"], loras=chosen[::-1], cfg=CFG)
    assert [m.lora.path.name for m in reversed_.merged_loras] == ["style.safetensors", "adapter_model.safetensors"]
    qkv = "blocks.0.attn.qkv_proj.weight"
    assert not torch.equal(given.state_dict()[qkv], reversed_.state_dict()[qkv])
    long_way = merged_the_long_way(
        load_h3_model(written["comfy"], cfg=CFG),
        (loras["peft"] / "adapter_model.safetensors", 1.0),
        (loras["comfy"], 2.0),
    )
    assert torch.equal(given.state_dict()[qkv], long_way.state_dict()[qkv])


@pytest.mark.parametrize("strength", [0.0, 0.5, -1.8])
def test_strength_scales_the_update(written, loras, strength):
    model = load_h3_model(written["comfy"], loras=[LoraSpec(loras["comfy"], strength)], dtype=torch.float32, cfg=CFG)
    base = load_h3_model(written["comfy"], dtype=torch.float32, cfg=CFG).state_dict()
    merged = model.state_dict()
    changed = {f"{module}.weight" for module in loras["comfy modules"]}
    for module, (A, B, alpha) in loras["comfy modules"].items():
        key = f"{module}.weight"
        want = base[key].double() + strength * alpha / RANK * (B.double() @ A.double())
        assert (merged[key].double() - want).abs().max() <= 1e-6 * want.abs().max(), key
    assert all(torch.equal(merged[k], base[k]) for k in base if k not in changed or strength == 0.0)


def test_official_shards_plus_branch_plus_lora_equal_the_long_way(written, loras, hybrid_state):
    model = load_h3_model(
        written["vdn official base"],
        branch=written["vdn branch"],
        loras=[(loras["comfy"], 0.8)],
        dtype=torch.float32,
        cfg=CFG,
    )
    long_way = merged_the_long_way(
        load_h3_model(
            written["vdn official base"],
            branch=written["vdn branch"],
            dtype=torch.float32,
            cfg=CFG,
            qkv_interleaved=True,
        ),
        (loras["comfy"], 0.8),
    )
    assert model.cfg.hybrid and model.layout == "official + VDN-H3 v2"
    assert_identical(model, long_way, hybrid=True)
    # the interleave was undone: without the LoRA every tensor is the hybrid model's own
    plain = load_h3_model(
        written["vdn official base"], branch=written["vdn branch pre-v2"], dtype=torch.float32, cfg=CFG
    )
    assert all(torch.equal(value, hybrid_state[key]) for key, value in plain.state_dict().items())


def test_pruned_base_plus_branch_loads_as_vdn(written, loras):
    model = load_h3_model(
        written["vdn pruned base"],
        branch=written["vdn pruned branch"],
        loras=[(loras["comfy"], 1.0)],
        dtype=torch.float32,
        cfg=CFG,
    )
    curve_cfg = replace(CFG, adaln_curve_grid=CURVE[0], time_embed=CURVE[1])
    long_way = merged_the_long_way(
        load_h3_model(
            written["vdn pruned base"], branch=written["vdn pruned branch"], dtype=torch.float32, cfg=curve_cfg
        ),
        (loras["comfy"], 1.0),
    )
    assert model.cfg.adaln_curve_grid == CURVE[0] and model.checkpoint.pruned
    assert_identical(model, long_way, hybrid=True)


@pytest.mark.parametrize(
    "name", ["pruned", "pruned fp8 scaled", "fp8 scaled", "official task folder", "comfy prefixed"]
)
def test_other_layouts_load_as_load_dit_does(written, name):
    interleaved = EXPECTED[name][3]
    path = written["official shards"] if name == "official task folder" else written[name]
    # fp32: a pruned model loaded in bf16 does not run yet (its fp32 AdaLN table meets bf16 linears)
    assert_identical(
        load_h3_model(written[name], dtype=torch.float32, cfg=CFG),
        load_h3_model(path, dtype=torch.float32, cfg=CFG, qkv_interleaved=interleaved),
    )


def test_a_diffusers_root_loads_as_its_transformer_folder(diffusers_root, loras):
    model = load_h3_model(diffusers_root, loras=[(loras["peft"], 1.0)], dtype=torch.float32, cfg=CFG)
    long_way = merged_the_long_way(
        load_h3_model(diffusers_root / "transformer", dtype=torch.float32, cfg=CFG),
        (loras["peft"] / "adapter_model.safetensors", 1.0),
    )
    assert_identical(model, long_way)


# ---- bad inputs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def odd_loras(tmp_path_factory):
    root = tmp_path_factory.mktemp("odd_loras")
    g = torch.Generator().manual_seed(8)
    # a Wan-style LoRA: its module names are not this model's
    wan = write_comfy_lora(
        root / "wan_style.safetensors",
        {
            "blocks.0.self_attn.q": (*lora_pair(g, CFG.hidden, INNER), RANK),
            "blocks.0.ffn.0": (*lora_pair(g, CFG.hidden, CFG.ffn), RANK),
        },
    )
    both = write_peft_lora(
        root / "both",
        {"transformer_blocks.0.attn.to_q": lora_pair(g, CFG.hidden, INNER)},
        adapters=("default", "turbo"),
    )
    adaln = write_comfy_lora(
        root / "full_adaln.safetensors",
        {"blocks.0.adaln_proj.linear": (*lora_pair(g, CFG.time_embed, 18 * CFG.hidden), RANK)},
    )
    half = root / "half.safetensors"
    save_file({"diffusion_model.blocks.0.mlp.fc2.lora_down.weight": torch.zeros(RANK, CFG.ffn)}, str(half))
    not_st = root / "style.ckpt"
    not_st.write_bytes(b"\0" * 16)
    return {"wan": wan, "both": both, "adaln": adaln, "ckpt": not_st, "half": half}


@pytest.mark.parametrize(
    "case, message",
    [
        ("base missing", r"^base: no file or folder at '.*nope\.safetensors'; give a MiniMax H3 DiT checkpoint"),
        (
            "branch missing",
            r"^branch: no file or folder at '.*nope\.safetensors'; give VDN-H3's "
            r"linear_branch/model\.safetensors",
        ),
        (
            "base is a branch",
            r"^base: .*branch\.safetensors is a VDN-H3 linear branch file, not a DiT; pass it as branch=",
        ),
        (
            "branch is a base",
            r"^branch: .*vdn_base\.safetensors is a MiniMax H3 DiT \(ComfyUI layout\), not a VDN-H3 "
            r"linear branch file",
        ),
        ("base unrecognised", r"^base: .*style\.safetensors: not a MiniMax H3 DiT checkpoint this pack can load"),
        (
            "lora missing",
            r"^loras\[1\]: no LoRA file at '.*nope\.safetensors'; give a \.safetensors LoRA or a peft "
            r"adapter folder",
        ),
        ("lora not safetensors", r"^loras\[0\]: '.*style\.ckpt' is not a \.safetensors file"),
        ("strength nan", r"^loras\[0\] \(.*style\.safetensors\): strength must be a finite number \(.*\), got nan$"),
        ("strength inf", r"strength must be a finite number \(.*\), got -inf$"),
        ("strength text", r"strength must be a finite number \(.*\), got '0\.8'$"),
        ("strength bool", r"strength must be a finite number \(.*\), got True$"),
        ("entry malformed", r"^loras\[0\]: expected \(path, strength\) or \(path, strength, adapter\), got "),
        (
            "hits nothing",
            r"^loras\[0\] \(.*wan_style\.safetensors\): none of its 2 target modules is in this model, first "
            r"\['blocks\.0\.ffn\.0', 'blocks\.0\.self_attn\.q'\]; a MiniMax H3 LoRA targets modules such as",
        ),
        (
            "adapter absent",
            r"^loras\[0\] \(.*adapter_model\.safetensors\): has no adapter 'turbo'; it holds \['default'\]",
        ),
        ("adapter unchosen", r"holds the peft adapters \['default', 'turbo'\]; name the one to merge"),
        (
            "adaln on pruned",
            r"^loras\[0\] \(.*full_adaln\.safetensors\): the update of 'blocks\.0\.adaln_proj\.linear' .*"
            r"pruned \(AdaLN curve\) form",
        ),
        ("loras not a list", r"^loras: expected a list of \(path, strength\) or \(path, strength, adapter\), got "),
        (
            "lora half a pair",
            r"^loras\[0\]: .*half\.safetensors: module 'diffusion_model\.blocks\.0\.mlp\.fc2' has "
            r"only one half of its LoRA pair",
        ),
        (
            "dtype",
            r"^dtype: got torch\.int8; allowed: torch\.bfloat16, torch\.float16, torch\.float32, torch\.float64$",
        ),
    ],
)
def test_bad_inputs_are_refused_naming_the_input(written, loras, odd_loras, tmp_path, case, message):
    nope = tmp_path / "nope.safetensors"
    comfy, style = written["comfy"], loras["comfy"]
    kwargs = {
        "base missing": dict(base=nope),
        "branch missing": dict(base=written["vdn base"], branch=nope),
        "base is a branch": dict(base=written["vdn branch"]),
        "branch is a base": dict(base=written["vdn base"], branch=written["vdn base"]),
        "base unrecognised": dict(base=style),
        "lora missing": dict(base=comfy, loras=[(style, 1.0), (nope, 1.0)]),
        "lora not safetensors": dict(base=comfy, loras=[(odd_loras["ckpt"], 1.0)]),
        "strength nan": dict(base=comfy, loras=[(style, math.nan)]),
        "strength inf": dict(base=comfy, loras=[(style, -math.inf)]),
        "strength text": dict(base=comfy, loras=[(style, "0.8")]),
        "strength bool": dict(base=comfy, loras=[(style, True)]),
        "entry malformed": dict(base=comfy, loras=[(style,)]),
        "hits nothing": dict(base=comfy, loras=[(odd_loras["wan"], 1.0)]),
        "adapter absent": dict(base=comfy, loras=[(loras["peft"], 1.0, "turbo")]),
        "adapter unchosen": dict(base=comfy, loras=[(odd_loras["both"], 1.0)]),
        "adaln on pruned": dict(base=written["pruned"], loras=[(odd_loras["adaln"], 1.0)]),
        "loras not a list": dict(base=comfy, loras=LoraSpec(style, 1.0)),
        "lora half a pair": dict(base=comfy, loras=[(odd_loras["half"], 1.0)]),
        "dtype": dict(base=comfy, dtype=torch.int8),
    }[case]
    with pytest.raises(H3InputError, match=message):
        load_h3_model(**kwargs, cfg=CFG)


def test_a_chosen_adapter_of_several_merges_only_that_one(written, odd_loras):
    base = load_h3_model(written["comfy"], dtype=torch.float32, cfg=CFG).state_dict()["blocks.0.attn.qkv_proj.weight"]
    deltas = {}
    for adapter in ("default", "turbo"):
        model = load_h3_model(written["comfy"], loras=[(odd_loras["both"], 1.0, adapter)], dtype=torch.float32, cfg=CFG)
        assert [m.weights for m in model.merged_loras] == [1]
        deltas[adapter] = model.state_dict()["blocks.0.attn.qkv_proj.weight"] - base
    assert deltas["default"][INNER:].abs().max() == 0 and deltas["default"][:INNER].abs().max() > 0
    assert torch.allclose(deltas["turbo"], 2 * deltas["default"], atol=1e-6)
