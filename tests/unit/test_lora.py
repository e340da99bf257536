"""LoRA merging into the DiT (h3_core.formats.lora): a merged LoRA equals the unmerged forward."""

import json

import pytest
import torch
from qkv_through_layer import qkv_from_weight_rows, qkv_through_layer
from safetensors.torch import save_file

from h3_core.errors import H3InputError
from h3_core.formats.lora import merge_lora, read_lora
from h3_core.models.dit import DiTConfig, H3DiT

CFG = DiTConfig(
    hidden=48,
    layers=2,
    heads=2,
    head_dim=32,
    ffn=64,
    text_dim=40,
    freq_dim=16,
    time_hidden=24,
    time_embed=20,
    rope_freqs=4,
)


def model():
    torch.manual_seed(0)
    m = H3DiT(CFG).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    return m


def inputs():
    g = torch.Generator().manual_seed(1)
    L, Na, Nv = 3, 4, 6
    T = L + Na + Nv
    tags = torch.tensor([1] * L + [2] * Na + [0] * Nv)
    return (
        torch.randn(Nv, 96, generator=g),
        torch.randn(Na, 32, generator=g),
        torch.randn(L, 40, generator=g),
        torch.tensor([0.5]),
        torch.zeros(T, dtype=torch.long),
        tags,
        torch.randn(T, 3, generator=g),
        torch.arange(L + Na, T),
        torch.arange(L, L + Na),
        torch.arange(L),
    )


def test_peft_adapter_on_q_k_v_out_and_ffn_equals_the_unmerged_forward(tmp_path):
    g = torch.Generator().manual_seed(2)
    r, inner, hidden, ffn = 4, 64, 48, 64
    tensors, updates = {}, {}
    scale = 2.0 * 8 / r  # strength 2, lora_alpha 8, r 4
    for b in range(2):
        stem = f"base_model.model.transformer_blocks.{b}.attn.orig"
        for i, x in enumerate("qkv"):
            A, B = torch.randn(r, hidden, generator=g), torch.randn(inner, r, generator=g) * 0.1
            tensors[f"{stem}.to_{x}.lora_A.default.weight"], tensors[f"{stem}.to_{x}.lora_B.default.weight"] = A, B
            updates.setdefault(f"blocks.{b}.attn.qkv_proj", [])
            updates[f"blocks.{b}.attn.qkv_proj"].append((A, B, slice(i * inner, (i + 1) * inner)))
        A, B = torch.randn(r, inner, generator=g), torch.randn(hidden, r, generator=g) * 0.1
        tensors[f"{stem}.to_out.0.lora_A.default.weight"], tensors[f"{stem}.to_out.0.lora_B.default.weight"] = A, B
        updates[f"blocks.{b}.attn.out_proj"] = [(A, B, slice(None))]
        # diffusers' ff.net.0.proj stores [up; gate]; the native fc1 is [gate; up]
        A, B = torch.randn(r, hidden, generator=g), torch.randn(2 * ffn, r, generator=g) * 0.1
        tensors[f"base_model.model.transformer_blocks.{b}.ff.net.0.proj.lora_A.default.weight"] = A
        tensors[f"base_model.model.transformer_blocks.{b}.ff.net.0.proj.lora_B.default.weight"] = B
        updates[f"blocks.{b}.mlp.fc1"] = [(A, torch.cat([B[ffn:], B[:ffn]]), slice(None))]
    # another adapter in the same file is ignored when one is chosen
    tensors["base_model.model.transformer_blocks.0.attn.orig.to_q.lora_A.turbo.weight"] = torch.zeros(r, hidden)
    tensors["base_model.model.transformer_blocks.0.attn.orig.to_q.lora_B.turbo.weight"] = torch.zeros(inner, r)
    path = tmp_path / "adapter_model.safetensors"
    save_file(tensors, str(path))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": 8}))

    m = model()
    x = inputs()
    expected = unmerged_forward(
        m, {name: [(A, B, scale, rows) for A, B, rows in parts] for name, parts in updates.items()}, x
    )
    merged = merge_lora(m, read_lora(path, strength=2.0, adapter="default"))
    assert merged == 2 * 5  # q, k, v, out, fc1 per block
    with torch.no_grad():
        got = m(*x)
    for a, b in zip(got, expected):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()


def unmerged_forward(m, flat, x):
    """The LoRA applied as a side path at run time: out[rows] += scale · (x Aᵀ) Bᵀ for every update."""
    handles = []
    modules = dict(m.named_modules())
    qkv_through_layer(m)  # q, k, v through qkv_proj's own forward, where the hooks sit
    for name, parts in flat.items():

        def hook(mod, args, out, parts=parts):
            out = out.clone()
            for A, B, scale, rows in parts:
                out[..., rows] += ((args[0].float() @ A.T @ B.T) * scale).to(out.dtype)
            return out

        handles.append(modules[name].register_forward_hook(hook))
    try:
        with torch.no_grad():
            return m(*x)
    finally:
        for h in handles:
            h.remove()
        qkv_from_weight_rows(m)


def test_comfy_lora_with_alpha(tmp_path):
    g = torch.Generator().manual_seed(3)
    A, B = torch.randn(2, 48, generator=g), torch.randn(192, 2, generator=g) * 0.1
    path = tmp_path / "style.safetensors"
    save_file(
        {
            "diffusion_model.blocks.1.attn.qkv_proj.lora_down.weight": A,
            "diffusion_model.blocks.1.attn.qkv_proj.lora_up.weight": B,
            "diffusion_model.blocks.1.attn.qkv_proj.alpha": torch.tensor(1.0),
        },
        str(path),
    )
    m = model()
    before = m.blocks[1].attn.qkv_proj.weight.clone()
    merge_lora(m, read_lora(path, strength=0.5))
    assert torch.allclose(m.blocks[1].attn.qkv_proj.weight, before + 0.5 * (1.0 / 2) * (B @ A), atol=1e-6)


def test_bad_loras_merge_nothing(tmp_path):
    m = model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    path = tmp_path / "wrong.safetensors"
    save_file(
        {
            "diffusion_model.blocks.0.attn.qkv_proj.lora_down.weight": torch.zeros(2, 48),
            "diffusion_model.blocks.0.attn.qkv_proj.lora_up.weight": torch.zeros(192, 2),
            "diffusion_model.blocks.7.attn.qkv_proj.lora_down.weight": torch.zeros(2, 48),
            "diffusion_model.blocks.7.attn.qkv_proj.lora_up.weight": torch.zeros(192, 2),
        },
        str(path),
    )
    with pytest.raises(H3InputError, match="targets 'blocks.7.attn.qkv_proj', which this model does not have"):
        merge_lora(m, read_lora(path), source=str(path))
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    half = tmp_path / "half.safetensors"
    save_file({"diffusion_model.blocks.0.attn.qkv_proj.lora_down.weight": torch.zeros(2, 48)}, str(half))
    with pytest.raises(H3InputError, match="has only one half of its LoRA pair"):
        read_lora(half)
    other = tmp_path / "other.safetensors"
    save_file({"encoder.conv.weight": torch.zeros(1)}, str(other))
    with pytest.raises(H3InputError, match="'encoder.conv.weight' is not a LoRA weight"):
        read_lora(other)


def test_vdn_adapter_lands_on_the_hybrid_model(tmp_path):
    from dataclasses import replace

    g = torch.Generator().manual_seed(4)
    r, inner, hidden = 2, 64, 48
    A, B = torch.randn(r, hidden, generator=g), torch.randn(inner, r, generator=g)
    stem = "base_model.model.transformer_blocks.1.attn.orig.to_k"
    save_file({f"{stem}.lora_A.default.weight": A, f"{stem}.lora_B.default.weight": B}, str(tmp_path / "a.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": r}))
    torch.manual_seed(0)
    m = H3DiT(replace(CFG, hybrid=True)).eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    assert merge_lora(m, read_lora(tmp_path / "a.safetensors")) == 1
    after = m.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {"blocks.1.attn.qkv_proj.weight"}
    delta = after["blocks.1.attn.qkv_proj.weight"] - before["blocks.1.attn.qkv_proj.weight"]
    assert torch.allclose(delta[inner : 2 * inner], B @ A, atol=1e-5)
    assert delta[:inner].abs().max() == 0 and delta[2 * inner :].abs().max() == 0


def test_full_model_adaln_lora_on_a_pruned_model_says_why(tmp_path):
    from dataclasses import replace

    g = torch.Generator().manual_seed(5)
    out = CFG.hidden * 6 * 3
    A, B = torch.randn(2, CFG.time_embed, generator=g), torch.randn(out, 2, generator=g)
    path = tmp_path / "adaln.safetensors"
    save_file(
        {
            "diffusion_model.blocks.0.adaln_proj.linear.lora_down.weight": A,
            "diffusion_model.blocks.0.adaln_proj.linear.lora_up.weight": B,
        },
        str(path),
    )
    full = model()
    assert merge_lora(full, read_lora(path)) == 1
    pruned = H3DiT(replace(CFG, adaln_curve_grid=9, time_embed=8)).eval()
    before = {k: v.clone() for k, v in pruned.state_dict().items()}
    with pytest.raises(
        H3InputError,
        match=r"adaln\.safetensors: the update of 'blocks\.0\.adaln_proj\.linear'.*"
        r"pruned \(AdaLN curve\) form.*use the full \(bf16\) model",
    ):
        merge_lora(pruned, read_lora(path), source=str(path))
    assert all(torch.equal(v, before[k]) for k, v in pruned.state_dict().items())


def test_full_differences_add_to_weights_and_biases_as_comfyuis_loader_adds_them(tmp_path):
    # comfy/lora.py load_lora (Comfy-Org/ComfyUI 17358c8f): "<key>.diff" patches "<key>.weight" and "<key>.diff_b"
    # "<key>.bias", each as W + strength · diff; ComfyUI's H3 key map takes the native module name with or without
    # "diffusion_model."
    g = torch.Generator().manual_seed(5)
    m = model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    diffs = {
        "diffusion_model.final_layer.video_out.diff": torch.randn(96, 48, generator=g),
        "diffusion_model.final_layer.video_out.diff_b": torch.randn(96, generator=g),
        "video_patch_proj.diff_b": torch.randn(48, generator=g),
        # diffusers' refiner names its attention's projections q_proj / k_proj / v_proj
        "token_refiner.refiner_blocks.0.attn.k_proj.diff": torch.randn(64, 48, generator=g),
    }
    save_file(diffs, str(tmp_path / "d.safetensors"))
    assert merge_lora(m, read_lora(tmp_path / "d.safetensors", 0.5)) == 4
    after = m.state_dict()
    torch.testing.assert_close(
        after["final_layer.video_out.weight"],
        before["final_layer.video_out.weight"] + 0.5 * diffs["diffusion_model.final_layer.video_out.diff"],
    )
    torch.testing.assert_close(
        after["final_layer.video_out.bias"],
        before["final_layer.video_out.bias"] + 0.5 * diffs["diffusion_model.final_layer.video_out.diff_b"],
    )
    torch.testing.assert_close(
        after["video_patch_proj.bias"], before["video_patch_proj.bias"] + 0.5 * diffs["video_patch_proj.diff_b"]
    )
    qkv, old = (
        after["token_refiner.blocks.0.attn.qkv_proj.weight"],
        before["token_refiner.blocks.0.attn.qkv_proj.weight"],
    )
    third = qkv.shape[0] // 3
    torch.testing.assert_close(qkv[:third], old[:third])
    torch.testing.assert_close(
        qkv[third : 2 * third],
        old[third : 2 * third] + 0.5 * diffs["token_refiner.refiner_blocks.0.attn.k_proj.diff"],
    )
    torch.testing.assert_close(qkv[2 * third :], old[2 * third :])


def test_full_differences_that_do_not_fit_are_named(tmp_path):
    m = model()
    save_file({"blocks.0.attn.qkv_proj.diff_b": torch.zeros(192)}, str(tmp_path / "bias.safetensors"))
    with pytest.raises(H3InputError, match=r"adds to the bias of 'blocks.0.attn.qkv_proj', which has none"):
        merge_lora(m, read_lora(tmp_path / "bias.safetensors"))
    save_file({"final_layer.video_out.diff": torch.zeros(96, 47)}, str(tmp_path / "shape.safetensors"))
    with pytest.raises(H3InputError, match=r"difference for the weight of 'final_layer.video_out' is \(96, 47\)"):
        merge_lora(m, read_lora(tmp_path / "shape.safetensors"))
