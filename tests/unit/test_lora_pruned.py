"""LoRAs merged into the pruned ("AdaLN curve") DiT (h3_core.formats.lora on a model from h3_core.models.dit).

The pruned form changes only the time path (a table instead of the time MLP, rank-r AdaLN linears); the
attention and MLP weights are the full model's, so LoRAs on them merge as they would there. Each merged weight
is checked against W + strength · (alpha / rank) · B @ A computed here in fp64, the pruned-only tensors
against their loaded values, bit for bit. (A full-model AdaLN LoRA in ComfyUI's naming is refused in
test_lora.py; here the peft / diffusers names of the same mistake.)"""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from h3_core.errors import H3InputError
from h3_core.formats.checkpoints import load_h3_model
from h3_core.formats.lora import merge_lora, read_lora
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.pipeline.packing import pack_sequence

FULL = DiTConfig(
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
PRUNED = replace(FULL, adaln_curve_grid=9, time_embed=4)
INNER, RANK = FULL.heads * FULL.head_dim, 3
PRUNED_ONLY = ("adaln_t_table", "adaln_proj.linear.")


def is_pruned_only(key: str) -> bool:
    return key.startswith(PRUNED_ONLY[0]) or PRUNED_ONLY[1] in key


@pytest.fixture(scope="module")
def pruned_file(tmp_path_factory):
    """A random pruned checkpoint in ComfyUI's naming (``adaln_t_table`` + rank-4 AdaLN linears)."""
    torch.manual_seed(0)
    model = H3DiT(PRUNED)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("pruned") / "minimax_h3_fl2va_pruned_bf16.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def load(path, dtype):
    model = load_h3_model(path, dtype=dtype, cfg=FULL)
    assert model.cfg.adaln_curve_grid == PRUNED.adaln_curve_grid
    return model


def pair(g, in_features, out_features):
    return torch.randn(RANK, in_features, generator=g, dtype=torch.float64), torch.randn(
        out_features, RANK, generator=g, dtype=torch.float64
    ) * 0.1


def peft_lora(folder: Path, strength_alpha: float = 6.0):
    """A peft adapter on diffusers names (``to_q/k/v``, ``to_out.0``, ``ff.net.0.proj`` stored [up; gate],
    ``ff.net.2``, a refiner block, one name under VDN's ``.attn.orig.``). Returns the file and the updates
    it should make, as (weight key, rows, A, B in native row order, alpha / rank)."""
    g = torch.Generator().manual_seed(1)
    tensors, updates = {}, []
    scale = strength_alpha / RANK

    def add(module, A, B, key, rows=slice(None), native_B=None):
        tensors[f"base_model.model.{module}.lora_A.default.weight"] = A.float()
        tensors[f"base_model.model.{module}.lora_B.default.weight"] = B.float()
        updates.append((key, rows, A.float().double(), (B if native_B is None else native_B).float().double(), scale))

    for b, attn in ((0, "attn"), (1, "attn.orig")):
        for i, x in enumerate("qkv"):
            add(
                f"transformer_blocks.{b}.{attn}.to_{x}",
                *pair(g, FULL.hidden, INNER),
                f"blocks.{b}.attn.qkv_proj.weight",
                slice(i * INNER, (i + 1) * INNER),
            )
        add(f"transformer_blocks.{b}.{attn}.to_out.0", *pair(g, INNER, FULL.hidden), f"blocks.{b}.attn.out_proj.weight")
        A, B = pair(g, FULL.hidden, 2 * FULL.ffn)
        add(
            f"transformer_blocks.{b}.ff.net.0.proj",
            A,
            B,
            f"blocks.{b}.mlp.fc1.weight",
            native_B=torch.cat([B[FULL.ffn :], B[: FULL.ffn]]),
        )
        add(f"transformer_blocks.{b}.ff.net.2", *pair(g, FULL.ffn, FULL.hidden), f"blocks.{b}.mlp.fc2.weight")
    add(
        "token_refiner.refiner_blocks.1.attn.to_v",
        *pair(g, FULL.hidden, INNER),
        "token_refiner.blocks.1.attn.qkv_proj.weight",
        slice(2 * INNER, 3 * INNER),
    )
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": RANK, "lora_alpha": strength_alpha}))
    return folder / "adapter_model.safetensors", updates


def comfy_lora(path: Path):
    """A ComfyUI LoRA on native names (fused ``qkv_proj``, ``out_proj``, ``fc1``, ``fc2``), an alpha per module."""
    g = torch.Generator().manual_seed(2)
    tensors, updates = {}, []
    shapes = {
        "attn.qkv_proj": (FULL.hidden, 3 * INNER),
        "attn.out_proj": (INNER, FULL.hidden),
        "mlp.fc1": (FULL.hidden, 2 * FULL.ffn),
        "mlp.fc2": (FULL.ffn, FULL.hidden),
    }
    for b in range(FULL.layers):
        for alpha, (name, (fan_in, fan_out)) in enumerate(shapes.items(), start=1):
            A, B = pair(g, fan_in, fan_out)
            stem = f"diffusion_model.blocks.{b}.{name}"
            tensors[f"{stem}.lora_down.weight"], tensors[f"{stem}.lora_up.weight"] = A.float(), B.float()
            tensors[f"{stem}.alpha"] = torch.tensor(float(alpha))
            updates.append(
                (f"blocks.{b}.{name}.weight", slice(None), A.float().double(), B.float().double(), alpha / RANK)
            )
    save_file(tensors, str(path))
    return path, updates


def lora(kind: str, tmp_path: Path):
    return peft_lora(tmp_path / "default") if kind == "peft" else comfy_lora(tmp_path / "style.safetensors")


def expected_weights(before: dict, updates, strength: float) -> dict:
    """The targeted weights after the merge, in fp64: W[rows] += strength · scale · B @ A."""
    want = {}
    for key, rows, A, B, scale in updates:
        want.setdefault(key, before[key].double().clone())
        want[key][rows] += strength * scale * (B @ A)
    return want


def run(model):
    """One forward of a small T2VA sequence (audio at another timestep than video), fp32."""
    packed = pack_sequence(torch.ones(4, dtype=torch.long), 3, 2, 4, 3)
    g = torch.Generator().manual_seed(3)
    index = torch.zeros(packed.positions.shape[0], dtype=torch.long)
    index[packed.audio_index] = 1
    with torch.no_grad():
        return model(
            torch.randn(packed.video_index.numel(), 96, generator=g),
            torch.randn(packed.audio_index.numel(), 32, generator=g),
            torch.randn(4, FULL.text_dim, generator=g),
            torch.tensor([0.3, 0.8]),
            index,
            packed.tags,
            packed.positions,
            packed.video_index,
            packed.audio_index,
            packed.text_index,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind, strength", [("peft", 0.6), ("comfy", -1.5)])
def test_attention_and_mlp_loras_merge_into_the_pruned_model(pruned_file, tmp_path, kind, strength, dtype):
    model = load(pruned_file, dtype)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path, updates = lora(kind, tmp_path)
    changed = merge_lora(model, read_lora(path, strength=strength))
    want = expected_weights(before, updates, strength)
    assert changed == len(updates)
    after = model.state_dict()
    for key, value in want.items():
        err = (after[key].double() - value).abs()
        # fp32: the fp32 product's rounding; bf16: half an ulp of the stored sum (relative 2^-8)
        bound = 1e-6 * value.abs().max() if dtype == torch.float32 else 2.0**-8 * value.abs() + 1e-6
        assert after[key].dtype == dtype and (err <= bound).all(), key
    untouched = [k for k in after if k not in want]
    assert any(is_pruned_only(k) for k in untouched)
    for key in untouched:
        assert after[key].dtype == before[key].dtype and torch.equal(after[key], before[key]), key
    assert all(after[k].dtype == torch.float32 for k in after if is_pruned_only(k))


@pytest.mark.parametrize("kind", ["peft", "comfy"])
def test_a_merged_lora_changes_the_pruned_forward(pruned_file, tmp_path, kind):
    # fp32: the pruned model's forward in bf16 mixes its fp32 AdaLN table with bf16 activations
    model = load(pruned_file, torch.float32)
    plain = run(model)
    path, _ = lora(kind, tmp_path)
    merge_lora(model, read_lora(path, strength=1.0))
    for got, old in zip(run(model), plain):
        assert torch.isfinite(got).all() and (got - old).abs().max() > 1e-3 * old.abs().max()


@pytest.mark.parametrize(
    "module, weight",
    [
        ("norm_out.linear", "final_layer.adaln_proj.linear"),
        ("transformer_blocks.1.adaln_proj.linear", "blocks.1.adaln_proj.linear"),
    ],
)
def test_a_full_model_adaln_peft_lora_is_refused_and_merges_nothing(pruned_file, tmp_path, module, weight):
    """A turbo-style adapter can target the AdaLN projections (e.g. diffusers' ``norm_out.linear``); made for
    the full model, its A reads the 10-wide time embedding the pruned form no longer has."""
    g = torch.Generator().manual_seed(4)
    out = 2 * FULL.hidden if module.startswith("norm_out") else 18 * FULL.hidden
    tensors = {}
    for name, (fan_in, fan_out) in (
        (module, (FULL.time_embed, out)),
        ("transformer_blocks.0.attn.to_q", (FULL.hidden, INNER)),
    ):
        A, B = pair(g, fan_in, fan_out)
        tensors[f"base_model.model.{name}.lora_A.turbo.weight"] = A.float()
        tensors[f"base_model.model.{name}.lora_B.turbo.weight"] = B.float()
    path = tmp_path / "adapter_model.safetensors"
    save_file(tensors, str(path))
    model = load(pruned_file, torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        H3InputError,
        match=rf"turbo: the update of '{weight}' is \({out}, {RANK}\) @ \({RANK}, "
        rf"{FULL.time_embed}\), the weight is \({out}, {PRUNED.time_embed}\); this "
        rf"model is the pruned \(AdaLN curve\) form",
    ):
        merge_lora(model, read_lora(path, adapter="turbo"), source="turbo")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
