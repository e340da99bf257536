"""LoRAs through the node pack in a real ComfyUI server: H3 LoRA nodes patch a clone of the loaded DiT as the
host's own LoRA loaders do. A chain changes the clip; a new strength re-patches without loading the checkpoint
again; taking the LoRAs off gives the plain model's clip back exactly; a LoRA for another model is refused at
validation, one of the wrong shapes when it is applied."""

import json

import av
import numpy as np
import torch
from comfy_host import error_message, mp4_files
from graphs import generation
from safetensors.torch import save_file
from tiny_checkpoints import TINY_DIT


def write_lora(path, modules, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (fan_in, fan_out) in modules.items():
        stem = f"diffusion_model.{module}"
        tensors[f"{stem}.lora_down.weight"] = torch.randn(2, fan_in, generator=g)
        tensors[f"{stem}.lora_up.weight"] = torch.randn(fan_out, 2, generator=g) * 0.5
        tensors[f"{stem}.alpha"] = torch.tensor(2.0)
    save_file(tensors, str(path))


def with_loras(prompt, *chain):
    """``prompt`` with H3 LoRA nodes (``(file, strength)`` each) between the DiT loader and the sampler."""
    prompt = {k: {"class_type": v["class_type"], "inputs": dict(v["inputs"])} for k, v in prompt.items()}
    source = ["1", 0]
    for i, (name, strength) in enumerate(chain):
        prompt[f"30{i}"] = {
            "class_type": "H3LoraLoader",
            "inputs": {"model": source, "lora_name": name, "strength": strength},
        }
        source = [f"30{i}", 0]
    prompt["7"]["inputs"]["model"] = source
    return prompt


def frames(entry, server):
    (path,) = mp4_files(entry, server.output)
    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def loads(server):
    return server.log_path.read_text().count("loaded h3_tiny_random_dit.safetensors into host memory")


def run(server, prompt):
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    return entry


def lora_files(server):
    inner = TINY_DIT.heads * TINY_DIT.head_dim
    loras = server.models / "loras"
    loras.mkdir(exist_ok=True)
    write_lora(loras / "style.safetensors", {"blocks.0.attn.qkv_proj": (TINY_DIT.hidden, 3 * inner)}, 1)
    write_lora(loras / "motion.safetensors", {"blocks.1.mlp.fc2": (TINY_DIT.ffn, TINY_DIT.hidden)}, 2)
    write_lora(loras / "alien.safetensors", {"blocks.0.attn.qkv_proj": (7, 3 * inner)}, 3)
    save_file(
        {
            "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(2, 8),
            "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.zeros(8, 2),
        },
        str(loras / "sdxl_style.safetensors"),
    )


def test_a_lora_chain_patches_the_loaded_model_and_strength_changes_never_reload_it(server):
    lora_files(server)
    for weight_dtype in ("bf16", "fp8"):
        base = generation(length=22, prefix=f"H3/plain_{weight_dtype}", seed=5)
        base["1"]["inputs"]["weight_dtype"] = weight_dtype
        plain = frames(run(server, base), server)
        before = loads(server)
        chain = [("style.safetensors", 0.8), ("motion.safetensors", 0.8)]
        patched = frames(run(server, with_loras(base, *chain)), server)
        assert "chain: style.safetensors × 0.8, motion.safetensors × 0.8" in server.log_tail(300)
        assert not np.array_equal(plain, patched)
        weaker = frames(run(server, with_loras(base, ("style.safetensors", 0.4), ("motion.safetensors", 0.8))), server)
        assert not np.array_equal(weaker, patched)
        again = frames(run(server, with_loras(base, *chain)), server)
        assert np.array_equal(again, patched)  # the same patches on the same weights: the same clip
        unpatched = frames(run(server, base), server)
        assert np.array_equal(unpatched, plain)  # patches taken off: the base weights exactly
        assert loads(server) == before, "a LoRA change loaded the checkpoint again"


def test_a_lora_for_another_model_is_refused_before_anything_runs(server):
    lora_files(server)
    answer = server.queue(with_loras(generation(length=22, prefix="H3/sdxl_lora"), ("sdxl_style.safetensors", 1.0)))
    assert "prompt_id" not in answer
    errors = json.dumps(answer["node_errors"])
    assert "lora_name" in errors and "a LoRA for another model" in errors and "sdxl_style.safetensors" in errors


def test_a_lora_whose_shapes_do_not_fit_is_a_node_error_naming_it(server):
    lora_files(server)
    bad = server.run(with_loras(generation(length=22, prefix="H3/bad_lora"), ("alien.safetensors", 1.0)))
    assert bad["status"]["status_str"] == "error"
    assert "alien.safetensors" in error_message(bad) and "blocks.0.attn.qkv_proj" in error_message(bad)
    after = server.run(generation(length=22, prefix="H3/after_bad_lora"))
    assert after["status"]["status_str"] == "success", error_message(after)


def test_fp8_linears_and_a_saved_prompt_embedding_run_through_the_nodes(server):
    from h3_core.pipeline.prompt import save_prompt_embedding
    from h3_core.pipeline.text_encoder import load_text_encoder

    encoder = load_text_encoder(server.tiny.text_encoder, dtype=torch.float32)
    folder = server.models / "h3_prompts"
    folder.mkdir(exist_ok=True)
    save_prompt_embedding(folder / "fox.safetensors", encoder.encode("a fox runs through snow"))
    prompt = generation(length=22, prefix="H3/fp8_cached")
    prompt["1"]["inputs"]["weight_dtype"] = "fp8"
    prompt["5"] = {"class_type": "H3PromptEmbeddingLoader", "inputs": {"embedding": "fox.safetensors"}}
    entry = run(server, prompt)
    assert "linears fp8 (quantised at load)" in server.log_tail(200)
    assert len(mp4_files(entry, server.output)) == 1
