"""The bundled workflows against a real ComfyUI server: every node type known, every link of a matching type,
and the API form as the frontend makes it (each one runs end to end through the example command:
test_example_command.py)."""

import json
from pathlib import Path

import pytest
from ui_to_api import to_api

# the pack's own workflows; h3_vdn_native_* need a host with native H3 (0.30 or later), which the test host is not
WORKFLOWS = sorted(
    p for p in (Path(__file__).resolve().parents[2] / "workflows").glob("*.json") if "_native_" not in p.name
)


def test_the_examples_are_bundled():
    assert {"h3_fl2va.json", "h3_t2va.json", "h3_ref2va.json"} <= {p.name for p in WORKFLOWS}


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.stem for p in WORKFLOWS])
def test_every_node_and_link_fits_the_server(server, path):
    workflow = json.loads(path.read_text())
    info = server.object_info()
    nodes = {node["id"]: node for node in workflow["nodes"]}
    for link_id, source, slot, target, target_slot, kind in workflow["links"]:
        assert info[nodes[source]["type"]]["output"][slot] == kind
        name = nodes[target]["inputs"][target_slot]["name"]
        target_info = info[nodes[target]["type"]]["input"]
        spec = {**target_info["required"], **target_info.get("optional", {})}[name]
        assert spec[0] == kind, (path.name, name)
    prompt = to_api(workflow, info)
    assert {node["class_type"] for node in prompt.values()} == {node["type"] for node in workflow["nodes"]}
    sampler = next(node for node in prompt.values() if node["class_type"] == "H3Sampler")
    canvas = next(node for node in prompt.values() if node["class_type"] == "H3Canvas")
    assert sampler["inputs"]["seed"] == 42 and canvas["inputs"] == {"width": 1344, "height": 768, "length": 124}
    assert sampler["inputs"]["canvas"][0] == next(k for k, v in prompt.items() if v["class_type"] == "H3Canvas")
    attention = next(node for node in prompt.values() if node["class_type"] == "H3AttentionSettings")
    assert attention["inputs"]["memory_mode"] == "auto"


def test_a_workflow_saved_before_a_widget_was_added_takes_its_default(server):
    """A sampler saved before ``reference_audio_t``, ``noise`` and ``latent_form`` existed has three widget values
    fewer; the frontend leaves the new widgets at their defaults, and so does the conversion here."""
    workflow = json.loads((WORKFLOWS[0].parent / "h3_ref2va.json").read_text())
    sampler = next(node for node in workflow["nodes"] if node["type"] == "H3Sampler")
    assert sampler["widgets_values"].pop() == "h3"  # latent_form, the last widget
    assert sampler["widgets_values"].pop() == "released"  # noise
    assert sampler["widgets_values"].pop() == 1.0  # reference_audio_t
    info = server.object_info()
    prompt = to_api(workflow, info)
    converted = next(node for node in prompt.values() if node["class_type"] == "H3Sampler")
    optional = info["H3Sampler"]["input"]["optional"]
    assert converted["inputs"]["reference_audio_t"] == optional["reference_audio_t"][1]["default"] == 1.0
    assert converted["inputs"]["noise"] == optional["noise"][1]["default"] == "released"
    assert converted["inputs"]["latent_form"] == optional["latent_form"][1]["default"] == "h3"
