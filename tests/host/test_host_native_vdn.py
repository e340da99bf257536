"""H3 VDN-H3 Patch in a real ComfyUI server: on a native H3 MODEL (the tests' re-derivation of the host's model, held
by the host's own ModelPatcher, as ComfyUI 0.3.75 has no native H3), the patched model's evaluation equals the pack's
own VDN-H3 DiT loaded with the same branch file, and the branch weights come onto the device through the host's
model management; a second patch and a model that is not H3 are refused with messages that say so. VDN-H3's LoRA
adapters (PEFT names under ``.attn.orig.``, beside their ``adapter_config.json``) go onto the native MODEL as the
host's weight patches through H3 LoRA (native MODEL): the evaluation equals the pack's DiT with the adapter merged
by the library, and a new strength re-patches without loading the branch file again."""

import json

import torch
from comfy_host import error_message
from graphs import TINY_BRANCH, TINY_DIT
from safetensors.torch import save_file
from tiny_checkpoints import TINY_DIT as TINY_CFG


def patch_inputs(model, **changes):
    inputs = {
        "model": model,
        "linear_branch": TINY_BRANCH,
        "window_radius": 1,
        "window_chunk": 5,
        "window_anchors": "both",
        "window_backend": "auto",
        "attention_precision": "bf16",
        "compile": "auto",
    }
    return {**inputs, **changes}


def native_graph() -> dict:
    return {
        "1": {
            "class_type": "H3DiTLoader",
            "inputs": {"dit_name": TINY_DIT, "linear_branch": "none", "weight_dtype": "bf16", "offload": "auto"},
        },
        "2": {
            "class_type": "H3DiTLoader",
            "inputs": {"dit_name": TINY_DIT, "linear_branch": TINY_BRANCH, "weight_dtype": "bf16", "offload": "auto"},
        },
        "3": {"class_type": "H3ProbeNativeH3", "inputs": {"h3_model": ["1", 0]}},
        "4": {"class_type": "H3VDNPatch", "inputs": patch_inputs(["3", 0])},
        "5": {"class_type": "H3ProbeNativeEvaluate", "inputs": {"model": ["4", 0], "h3_model": ["2", 0], "frames": 12}},
    }


def test_the_patched_native_model_evaluates_as_the_packs_own_vdn_dit(server):
    prompt = native_graph()
    # the same evaluation of the unpatched model: plain H3, which the VDN-H3 DiT's result is not
    prompt["7"] = {"class_type": "H3ProbeNativeEvaluate", "inputs": {"model": ["3", 0], "h3_model": ["2", 0],
                                                                     "frames": 12}}  # fmt: skip
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    patched, plain = entry["outputs"]["5"]["evaluate"][0], entry["outputs"]["7"]["evaluate"][0]
    # fp32 on both sides, the same weights (bf16 in the files) and branch file
    assert patched["video"] <= 1e-6 * patched["scale"] and patched["audio"] <= 1e-6 * patched["scale"], patched
    assert plain["video"] > 100 * patched["video"] and plain["audio"] > 100 * patched["audio"], (plain, patched)
    assert "BranchWeights" in patched["loaded"], patched["loaded"]


def test_a_second_patch_is_refused(server):
    prompt = native_graph()
    prompt["6"] = {"class_type": "H3VDNPatch", "inputs": patch_inputs(["4", 0])}
    prompt["5"]["inputs"]["model"] = ["6", 0]
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "error"
    assert "model: is already VDN-H3" in error_message(entry)


def test_a_model_that_is_not_h3_is_refused_naming_its_class(server):
    prompt = native_graph()
    prompt["3"] = {"class_type": "H3ProbeOtherModel", "inputs": {"tag": "other"}}
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "error"
    assert "model: is a Linear, not ComfyUI's native MiniMax H3 (MiniMaxH3Model)" in error_message(entry)


def test_a_file_that_is_no_branch_is_refused_at_validation(server):
    prompt = native_graph()
    prompt["4"]["inputs"]["linear_branch"] = TINY_DIT
    answer = server.queue(prompt)
    # the probe that builds the native model is an output of its own and still runs; the patch's output does not
    refused = str(answer["node_errors"])
    assert f"linear_branch: '{TINY_DIT}' is an H3 DiT checkpoint, not VDN-H3's linear branch" in refused, answer
    entry = server.wait(answer["prompt_id"])
    assert "5" not in entry["outputs"]


def test_the_patch_nodes_inputs_are_those_the_native_workflows_name(server):
    from native_schema import PATCH_NODE

    info = server.object_info()["H3VDNPatch"]
    names = list(info["input"]["required"]) + list(info["input"].get("optional", {}))
    assert names == [name for name, _ in PATCH_NODE[1]]


VDN_ADAPTER = "vdn_default/adapter_model.safetensors"


def write_vdn_adapter(server):
    """A VDN-H3-style PEFT adapter (``adapter_config.json`` beside it: rank 2, alpha 4): q and v thirds of block 0's
    fused projection, block 1's output projection and FFN input (diffusers' ``[up; gate]`` order)."""
    folder = server.models / "loras" / "vdn_default"
    folder.mkdir(parents=True, exist_ok=True)
    inner, hidden, ffn = TINY_CFG.heads * TINY_CFG.head_dim, TINY_CFG.hidden, TINY_CFG.ffn
    modules = {
        "transformer_blocks.0.attn.orig.to_q": (hidden, inner),
        "transformer_blocks.0.attn.orig.to_v": (hidden, inner),
        "transformer_blocks.1.attn.orig.to_out.0": (inner, hidden),
        "transformer_blocks.1.ff.net.0.proj": (hidden, 2 * ffn),
    }
    g = torch.Generator().manual_seed(11)
    tensors = {}
    for module, (fan_in, fan_out) in modules.items():
        stem = f"base_model.model.{module}"
        tensors[f"{stem}.lora_A.default.weight"] = torch.randn(2, fan_in, generator=g)
        tensors[f"{stem}.lora_B.default.weight"] = torch.randn(fan_out, 2, generator=g) * 0.3
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))


def with_native_lora(prompt, strength):
    prompt = json.loads(json.dumps(prompt))
    prompt["8"] = {
        "class_type": "H3LoraLoaderNative",
        "inputs": {"model": ["4", 0], "lora_name": VDN_ADAPTER, "strength": strength},
    }
    prompt["5"]["inputs"].update(model=["8", 0], lora_name=VDN_ADAPTER, strength=strength)
    return prompt


def test_vdn_adapters_patch_the_native_model_as_the_library_merges_them(server):
    write_vdn_adapter(server)
    patched_lines = server.log_path.read_text().count("VDN-H3 on the native H3 model:")
    for strength in (0.7, 0.3):
        prompt = with_native_lora(native_graph(), strength)
        # the same patched model without the adapter, against the same merged DiT: what the adapter changed
        prompt["7"] = {"class_type": "H3ProbeNativeEvaluate", "inputs": dict(prompt["5"]["inputs"], model=["4", 0])}
        entry = server.run(prompt)
        assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
        with_lora, without = entry["outputs"]["5"]["evaluate"][0], entry["outputs"]["7"]["evaluate"][0]
        assert with_lora["video"] <= 1e-6 * with_lora["scale"] and with_lora["audio"] <= 1e-6 * with_lora["scale"]
        assert without["video"] > 100 * with_lora["video"], (without, with_lora)
        assert f"LoRA adapter_model.safetensors × {strength:g} patches 4 weights" in server.log_tail(200)
    # the strength changed: the LoRA node ran again on the same patched model; the patch (and its branch file) did not
    assert server.log_path.read_text().count("VDN-H3 on the native H3 model:") == patched_lines + 1


def test_a_native_lora_on_a_model_that_is_not_h3_is_refused_naming_its_class(server):
    write_vdn_adapter(server)
    prompt = with_native_lora(native_graph(), 1.0)
    prompt["8"]["inputs"]["model"] = ["9", 0]
    prompt["9"] = {"class_type": "H3ProbeOtherModel", "inputs": {"tag": "lora"}}
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "error"
    assert "model: is a Linear, not ComfyUI's native MiniMax H3 (MiniMaxH3Model)" in error_message(entry)


def test_a_native_lora_for_modules_the_model_lacks_is_a_node_error_naming_them(server):
    folder = server.models / "loras"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            "diffusion_model.blocks.9.attn.qkv_proj.lora_down.weight": torch.zeros(2, TINY_CFG.hidden),
            "diffusion_model.blocks.9.attn.qkv_proj.lora_up.weight": torch.zeros(3 * TINY_CFG.hidden, 2),
        },
        str(folder / "deeper.safetensors"),
    )
    prompt = with_native_lora(native_graph(), 1.0)
    prompt["8"]["inputs"]["lora_name"] = "deeper.safetensors"
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "error"
    assert "deeper.safetensors" in error_message(entry) and "blocks.9.attn.qkv_proj" in error_message(entry)
