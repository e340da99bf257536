"""The native VDN-H3 workflows: every node is one of the host's (recorded in ``native_schema`` from ComfyUI 0.38's
source) or this pack's patch; every link lands on an input that node has, its widget values are as many as the
node's widgets, and they are what ``tests/make_native_workflows.py`` writes."""

import json
from pathlib import Path

import pytest
from make_native_workflows import build
from native_schema import NATIVE_NODES, PATCH_NODE

WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"
NATIVE = {"T2VA": "h3_vdn_native_t2va.json", "FL2VA": "h3_vdn_native_fl2va.json"}


def schema(kind):
    if kind == PATCH_NODE[0]:
        return PATCH_NODE[1], 0
    _, inputs, extra = NATIVE_NODES[kind]
    return inputs, extra


@pytest.mark.parametrize("mode", list(NATIVE))
def test_every_node_and_input_is_the_hosts(mode):
    workflow = json.loads((WORKFLOWS / NATIVE[mode]).read_text())
    assert workflow == json.loads(json.dumps(build(mode))), "regenerate with tests/make_native_workflows.py"
    kinds = {node["type"] for node in workflow["nodes"]}
    assert kinds - set(NATIVE_NODES) == {"H3VDNPatch"}, kinds
    by_id = {node["id"]: node for node in workflow["nodes"]}
    for node in workflow["nodes"]:
        inputs, extra = schema(node["type"])
        links = [name for name, kind in inputs if kind == "link"]
        widgets = [name for name, kind in inputs if kind == "widget"]
        for socket in node["inputs"]:
            assert socket["name"] in links, (node["type"], socket["name"])
        assert len(node["widgets_values"]) == len(widgets) + extra, (node["type"], node["widgets_values"])
    for link_id, source, slot, target, target_slot, kind in workflow["links"]:
        assert by_id[source]["outputs"][slot]["type"] == kind
        assert by_id[target]["inputs"][target_slot]["link"] == link_id
    patch = next(n for n in workflow["nodes"] if n["type"] == "H3VDNPatch")
    assert patch["widgets_values"][1:4] == [1, 5, "both"]  # the released window
