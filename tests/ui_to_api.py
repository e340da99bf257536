"""A UI-format workflow (what the canvas saves and a drop loads) to the API form ``/prompt`` takes, by the
frontend's rules, against the server's ``/object_info``:

* each active node (mode 0) becomes ``{"class_type", "inputs"}`` under its id;
* inputs are read in the node type's input order (required, then optional); a linked input becomes
  ``[source id, source slot]``; a widget input takes the next ``widgets_values`` entry (a widget turned into
  a linked input still holds its entry); a widget past the saved entries (added to the node after the workflow
  was saved) takes its default;
* the frontend's own widgets hold entries too and are skipped: the "control after generate" value after a
  seed, and the upload button after an ``image_upload`` combo.

``embedded_default`` rewrites a converted bundled workflow to run on the tiny random checkpoints at a small
size (what the example run and the host tests use).
"""

from __future__ import annotations

from tiny_checkpoints import TINY_FILES

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
SEED_NAMES = {"seed", "noise_seed"}


class WorkflowError(ValueError):
    pass


def _is_widget(spec) -> bool:
    kind = spec[0]
    return isinstance(kind, list) or kind in WIDGET_TYPES


def _extra_widgets(name: str, spec) -> int:
    options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    extra = 0
    if spec[0] == "INT" and (name in SEED_NAMES or options.get("control_after_generate")):
        extra += 1
    if options.get("image_upload") or options.get("video_upload") or options.get("audio_upload"):
        extra += 1
    return extra


def to_api(workflow: dict, object_info: dict) -> dict:
    """The API form of ``workflow``; raises ``WorkflowError`` for unknown node types or values that do not fit."""
    links = {link[0]: link for link in workflow.get("links", [])}
    prompt = {}
    missing = sorted({n["type"] for n in workflow["nodes"] if n["type"] not in object_info})
    if missing:
        raise WorkflowError(f"unknown node types: {missing}")
    for node in workflow["nodes"]:
        if node.get("mode", 0) != 0:
            continue
        info = object_info[node["type"]]
        linked = {
            entry["name"]: links[entry["link"]] for entry in node.get("inputs", []) if entry.get("link") is not None
        }
        values = list(node.get("widgets_values") or [])
        inputs = {}
        for section in ("required", "optional"):
            specs = info["input"].get(section, {})
            for name in info.get("input_order", {}).get(section, list(specs)):
                spec = specs[name]
                if _is_widget(spec):
                    if not values:
                        # a widget newer than the saved workflow keeps its default, as the frontend leaves it
                        options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
                        if "default" not in options:
                            raise WorkflowError(
                                f"node {node['id']} ({node['type']}): no widget value left for {name!r}"
                            )
                        if name not in linked:
                            inputs[name] = options["default"]
                        continue
                    value = values.pop(0)
                    del values[: _extra_widgets(name, spec)]
                    if name not in linked:
                        inputs[name] = value
                if name in linked:
                    link = linked[name]
                    inputs[name] = [str(link[1]), link[2]]
        if values:
            raise WorkflowError(f"node {node['id']} ({node['type']}): {len(values)} widget values left over: {values}")
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


# What the bundled workflows run on without the real checkpoints: the tiny random files of
# tests/tiny_checkpoints.py, at a size a CPU decodes in seconds.
EMBEDDED_FILES = {
    "H3DiTLoader": {"dit_name": TINY_FILES["dit"], "linear_branch": TINY_FILES["linear_branch"]},
    "H3VideoVAELoader": {"vae_name": TINY_FILES["video_vae"]},
    "H3AudioVAELoader": {"vae_name": TINY_FILES["audio_vae"]},
    "H3TextEncoderLoader": {"text_encoder_name": TINY_FILES["text_encoder"]},
}
EMBEDDED_SIZE = {"width": 256, "height": 160, "length": 56, "steps": 4}
# The nodes each of those widgets lives on.
SIZED_NODES = ("H3Canvas", "H3Sampler")


def embedded_default(prompt: dict) -> dict:
    """``prompt`` (API form) with the tiny checkpoints and the small size in place of the released ones."""
    out = {}
    for node_id, node in prompt.items():
        inputs = dict(node["inputs"])
        plain = inputs.get("linear_branch") == "none"  # a workflow of plain H3 stays plain
        inputs.update(EMBEDDED_FILES.get(node["class_type"], {}))
        if plain:
            inputs["linear_branch"] = "none"
        if node["class_type"] in SIZED_NODES:
            inputs.update({k: v for k, v in EMBEDDED_SIZE.items() if k in inputs})
        out[node_id] = {"class_type": node["class_type"], "inputs": inputs}
    return out
