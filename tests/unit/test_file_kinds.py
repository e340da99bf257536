"""A file's kind from its header alone (h3_core.formats.file_kinds): each of the pack's tiny checkpoints is what it is
and is refused as anything else with the loader to pick it in; broken files are refused by name without a
weight being read; a LoRA is told from another model's LoRA by its module names."""

import pickle
import re

import pytest
import torch
from safetensors.torch import save_file
from tiny_checkpoints import (
    write_tiny_checkpoints,
    write_tiny_quantized_checkpoints,
    write_tiny_quantized_text_encoder_file,
)

from h3_core.errors import H3InputError
from h3_core.formats.file_kinds import KINDS, check_file

OWN = {
    "dit": "dit",
    "linear_branch": "linear_branch",
    "video_vae": "video_vae",
    "audio_vae": "audio_vae",
    "text_encoder": "text_encoder",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoints(tmp_path_factory.mktemp("models"))


@pytest.mark.parametrize("field", list(OWN))
def test_each_checkpoint_is_its_own_kind_and_no_other(tiny, field):
    path = getattr(tiny, field)
    assert check_file(path, OWN[field], "input")
    for kind, info in KINDS.items():
        if kind in (OWN[field], "lora", "prompt_embedding"):
            continue
        own = KINDS[OWN[field]]
        with pytest.raises(
            H3InputError,
            match=re.escape(f"input: '{path.name}' is {own.name}, not {info.name}; pick it in {own.loader}"),
        ):
            check_file(path, kind, "input")


def test_comfyuis_quantised_files_are_their_kind_with_their_format(tiny, tmp_path_factory):
    """The int8_convrot DiT and video VAE and the quantised single-file text encoders, as ComfyUI ships them."""
    models = tiny.dit.parent.parent
    dit, vae = write_tiny_quantized_checkpoints(models)
    assert "int8_convrot (8 layers)" in check_file(dit, "dit", "dit_name")
    assert check_file(vae, "video_vae", "vae_name").endswith("int8_convrot (4 layers)")
    with pytest.raises(H3InputError, match="is the H3 video VAE, not an H3 DiT"):
        check_file(vae, "dit", "dit_name")
    for kind in ("int8_convrot", "nvfp4_awq"):
        path = write_tiny_quantized_text_encoder_file(models, kind, layers=2)
        assert check_file(path, "text_encoder", "text_encoder_name")
        with pytest.raises(H3InputError, match="is a Qwen3-VL text encoder, not the H3 video VAE"):
            check_file(path, "video_vae", "vae_name")


def test_broken_files_are_refused_by_name(tiny, tmp_path):
    whole = tiny.dit.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(whole[: len(whole) // 2])
    lying = tmp_path / "lying.safetensors"
    lying.write_bytes((len(whole) * 8).to_bytes(8, "little") + whole[8:])
    pickled = tmp_path / "pickled.safetensors"
    pickled.write_bytes(pickle.dumps({"weight": [0.0] * 8}))
    for path in (truncated, lying, pickled):
        with pytest.raises(
            H3InputError,
            match=rf"dit_name: '{path.name}' cannot be loaded as an H3 DiT checkpoint: "
            r".*(truncated|not a safetensors file)",
        ):
            check_file(path, "dit", "dit_name")


def test_a_lora_for_another_model_is_told_by_its_modules(tmp_path):
    ours = tmp_path / "ours.safetensors"
    save_file(
        {
            "diffusion_model.blocks.0.attn.qkv_proj.lora_down.weight": torch.zeros(2, 8),
            "diffusion_model.blocks.0.attn.qkv_proj.lora_up.weight": torch.zeros(8, 2),
            "transformer.transformer_blocks.1.attn.to_q.lora_A.weight": torch.zeros(2, 8),
            "transformer.transformer_blocks.1.attn.to_q.lora_B.weight": torch.zeros(8, 2),
        },
        str(ours),
    )
    assert check_file(ours, "lora", "lora_name") == "2 modules, e.g. blocks.0.attn.qkv_proj"
    sdxl = tmp_path / "sdxl.safetensors"
    save_file(
        {
            "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(2, 8),
            "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.zeros(8, 2),
        },
        str(sdxl),
    )
    with pytest.raises(
        H3InputError,
        match=r"sdxl\.safetensors: a LoRA for another model: it targets 1 modules this "
        r"DiT does not have",
    ):
        check_file(sdxl, "lora", "lora_name")
