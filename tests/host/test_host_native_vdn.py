"""H3 VDN-H3 Patch in a real ComfyUI server: on a native H3 MODEL (the tests' re-derivation of the host's model, held
by the host's own ModelPatcher, as ComfyUI 0.3.75 has no native H3), the patched model's evaluation equals the pack's
own VDN-H3 DiT loaded with the same branch file, and the branch weights come onto the device through the host's
model management; a second patch and a model that is not H3 are refused with messages that say so."""

from comfy_host import error_message
from graphs import TINY_BRANCH, TINY_DIT


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
