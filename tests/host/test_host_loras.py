"""LoRAs through the node pack in a real ComfyUI server: a chain of H3 LoRA nodes merged by the DiT loader,
with the same seed giving another clip, and a LoRA that fits no layer refused by name."""

import torch
from safetensors.torch import save_file

from comfy_host import error_message, mp4_files
from graphs import generation
from h3_core.tiny_checkpoints import TINY_DIT


def write_lora(path, modules, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (fan_in, fan_out) in modules.items():
        stem = f"diffusion_model.{module}"
        tensors[f"{stem}.lora_down.weight"] = torch.randn(2, fan_in, generator=g)
        tensors[f"{stem}.lora_up.weight"] = torch.randn(fan_out, 2, generator=g) * 0.5
        tensors[f"{stem}.alpha"] = torch.tensor(2.0)
    save_file(tensors, str(path))


def with_loras(prompt, *names):
    prompt = {k: {"class_type": v["class_type"], "inputs": dict(v["inputs"])} for k, v in prompt.items()}
    last = None
    for i, name in enumerate(names):
        node = {"lora_name": name, "strength": 0.8}
        if last is not None:
            node["loras"] = [last, 0]
        prompt[f"30{i}"] = {"class_type": "H3LoraList", "inputs": node}
        last = f"30{i}"
    prompt["1"]["inputs"]["loras"] = [last, 0]
    return prompt


def test_a_lora_chain_is_merged_and_changes_the_clip(server):
    inner = TINY_DIT.heads * TINY_DIT.head_dim
    loras = server.models / "loras"
    loras.mkdir(exist_ok=True)
    write_lora(loras / "style.safetensors", {"blocks.0.attn.qkv_proj": (TINY_DIT.hidden, 3 * inner)}, 1)
    write_lora(loras / "motion.safetensors", {"blocks.1.mlp.fc2": (TINY_DIT.ffn, TINY_DIT.hidden)}, 2)
    write_lora(loras / "alien.safetensors", {"blocks.0.attn.qkv_proj": (7, 3 * inner)}, 3)
    plain = server.run(generation(length=22, prefix="H3/plain_lora", seed=5))
    merged = server.run(with_loras(generation(length=22, prefix="H3/with_lora", seed=5), "style.safetensors",
                                   "motion.safetensors"))
    assert merged["status"]["status_str"] == "success", error_message(merged)
    assert "style.safetensors × 0.8, motion.safetensors × 0.8" in server.log_tail(200)
    a, b = (mp4_files(entry, server.output)[0].read_bytes() for entry in (plain, merged))
    assert a != b
    bad = server.run(with_loras(generation(length=22, prefix="H3/bad_lora"), "alien.safetensors"))
    assert bad["status"]["status_str"] == "error"
    assert "alien.safetensors" in error_message(bad)


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
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "success", error_message(entry)
    assert "linears fp8 (quantised at load)" in server.log_tail(200)
    assert len(mp4_files(entry, server.output)) == 1
