"""Writes the bundled workflows (ComfyUI UI format, drag-and-drop ready) into workflows/:

    h3_fl2va.json  first and last frame → video + stereo audio (the example; memory policy auto)
    h3_t2va.json   prompt → video + stereo audio
    h3_ref2va.json a reference image and a reference sound → video + stereo audio, on H3's Ref2VA checkpoint
                   (plain H3: VDN-H3's branch was trained on the FL2VA transformer, and its published reference
                   mode takes images alone)
    h3_extend.json prompt → a clip, then that clip extended by 34 frames (H3 Extend / Inpaint) → video + audio

Model widgets name the released files (see the README for where each goes); the images are the
LoadImage names ``h3_first_frame.png`` / ``h3_last_frame.png`` (FL2VA) and ``h3_reference_image.png`` with
``h3_reference_audio.wav`` (Ref2VA) in the input folder.

    python3 tests/make_workflows.py
"""

from __future__ import annotations

import json
from pathlib import Path

WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows"
DIT = "minimax_h3_fl2va_bf16.safetensors"  # T2VA and FL2VA
REF2VA_DIT = "minimax_h3_ref2va_bf16.safetensors"
BRANCH = "vdn_h3_linear_branch.safetensors"
VIDEO_VAE = "minimax_h3_video_vae_fp16.safetensors"
AUDIO_VAE = "minimax_h3_audio_vae_fp32.safetensors"
TEXT_ENCODER = "Qwen3-VL-32B-MiniMax-H3"
FIRST, LAST = "h3_first_frame.png", "h3_last_frame.png"
REFERENCE_IMAGE, REFERENCE_AUDIO = "h3_reference_image.png", "h3_reference_audio.wav"
# Where the frontend's missing-models prompt points: the repositories the files come from (the branch file
# is that repository's linear_branch/model.safetensors, renamed).
COMFY_REPO, VDN_REPO = "https://huggingface.co/Comfy-Org/MiniMax-H3", "https://huggingface.co/OpenVDN/vdn-minimax-h3"


def models(*entries):
    return [{"name": name, "url": url, "directory": folder} for name, url, folder in entries]


PROMPT = (
    "A red fox trots through fresh snow at dawn, its breath misting; the crunch of paws on snow and a distant crow."
)
REFERENCE_PROMPT = (
    "<Picture 1>: the fox from the picture trots through fresh snow at dawn, <Audio 1>: with this music playing softly."
)


class Graph:
    """Nodes and links in the UI format the frontend saves."""

    def __init__(self):
        self.nodes, self.links = [], []

    def node(self, kind, pos, widgets, outputs=(), size=(320, 120), title=None, files=()):
        node = {
            "id": len(self.nodes) + 1,
            "type": kind,
            "pos": list(pos),
            "size": list(size),
            "flags": {},
            "order": len(self.nodes),
            "mode": 0,
            "inputs": [],
            "outputs": [
                {"name": name, "type": kind_, "links": [], "slot_index": i} for i, (name, kind_) in enumerate(outputs)
            ],
            "properties": {"Node name for S&R": kind},
            "widgets_values": list(widgets),
        }
        if files:
            node["properties"]["models"] = models(*files)
        if title:
            node["title"] = title
        self.nodes.append(node)
        return node

    def link(self, source, slot, target, input_name):
        link_id = len(self.links) + 1
        kind = source["outputs"][slot]["type"]
        source["outputs"][slot]["links"].append(link_id)
        target["inputs"].append({"name": input_name, "type": kind, "link": link_id})
        self.links.append([link_id, source["id"], slot, target["id"], len(target["inputs"]) - 1, kind])

    def workflow(self, note):
        return {
            "id": "h3-hybrid-" + note.split()[0].lower(),
            "revision": 0,
            "last_node_id": len(self.nodes),
            "last_link_id": len(self.links),
            "nodes": self.nodes,
            "links": self.links,
            "groups": [],
            "config": {},
            "extra": {"ds": {"scale": 0.8, "offset": [0, 0]}},
            "version": 0.4,
        }


def build(mode: str) -> dict:
    """The workflow of ``mode``: T2VA, FL2VA, Ref2VA or Extend (T2VA, then its clip extended)."""
    extend = mode == "Extend"
    mode = "T2VA" if extend else mode
    g = Graph()
    if mode == "Ref2VA":
        dit_file, branch, files = REF2VA_DIT, "none", [(REF2VA_DIT, COMFY_REPO, "diffusion_models")]
    else:
        dit_file, branch = DIT, BRANCH
        files = [(DIT, COMFY_REPO, "diffusion_models"), (BRANCH, VDN_REPO, "diffusion_models")]
    dit = g.node("H3DiTLoader", (0, 0), [dit_file, branch, "bf16", "auto"], [("model", "H3_MODEL")], (340, 150),
                 files=files)  # fmt: skip
    video_vae = g.node(
        "H3VideoVAELoader",
        (0, 200),
        [VIDEO_VAE],
        [("video_vae", "H3_VIDEO_VAE")],
        files=[(VIDEO_VAE, COMFY_REPO, "vae")],
    )
    audio_vae = g.node(
        "H3AudioVAELoader",
        (0, 320),
        [AUDIO_VAE],
        [("audio_vae", "H3_AUDIO_VAE")],
        files=[(AUDIO_VAE, COMFY_REPO, "vae")],
    )
    encoder = g.node("H3TextEncoderLoader", (0, 440), [TEXT_ENCODER, "auto"], [("text_encoder", "H3_TEXT_ENCODER")])
    attention = g.node(
        "H3AttentionSettings",
        (0, 580),
        ["auto", "auto", "auto", "auto", "auto"],
        [("attention", "H3_ATTENTION")],
        (340, 180),
    )
    canvas = g.node(
        "H3Canvas",
        (400, 300),
        [1344, 768, 124],
        [("canvas", "H3_CANVAS"), ("width", "INT"), ("height", "INT"), ("length", "INT")],
        (320, 130),
    )
    prompt = REFERENCE_PROMPT if mode == "Ref2VA" else PROMPT
    encode = g.node("H3TextEncode", (400, 0), [prompt], [("conditioning", "CONDITIONING")], (400, 240))
    sampler = g.node(
        "H3Sampler",
        (860, 0),
        [mode, 20, 12.0, 3.0, 42, "fixed", 1.0, "released", "h3"],
        [("latent", "LATENT")],
        (340, 420),
    )
    save = g.node(
        "H3DecodeAndSave",
        (1260, 0),
        [f"H3/{mode.lower()}", 24, "auto", "superfast", 256, 64, 4],
        [("images", "IMAGE")],
        (400, 460),
    )
    g.link(encoder, 0, encode, "text_encoder")
    g.link(canvas, 0, encode, "canvas")
    g.link(dit, 0, sampler, "model")
    g.link(encode, 0, sampler, "conditioning")
    g.link(canvas, 0, sampler, "canvas")
    g.link(attention, 0, sampler, "attention")
    g.link(video_vae, 0, sampler, "video_vae")
    if mode == "FL2VA":
        for anchor, name, y in (("first", FIRST, 760), ("last", LAST, 1100)):
            image = g.node(
                "LoadImage",
                (400, y + 40),
                [name, "image"],
                [("IMAGE", "IMAGE"), ("MASK", "MASK")],
                (320, 320),
                title=f"{anchor} frame",
            )
            g.link(image, 0, encode, f"{anchor}_frame")
            g.link(image, 0, sampler, f"{anchor}_frame")
    if mode == "Ref2VA":
        image = g.node(
            "LoadImage",
            (400, 760),
            [REFERENCE_IMAGE, "image"],
            [("IMAGE", "IMAGE"), ("MASK", "MASK")],
            (320, 320),
            title="reference picture",
        )
        picture = g.node("H3AddReference", (760, 760), ["image", 24.0], [("references", "H3_REFERENCES")], (300, 130))
        sound = g.node("H3LoadAudio", (400, 1120), [REFERENCE_AUDIO], [("audio", "AUDIO")], title="reference sound")
        music = g.node("H3AddReference", (760, 960), ["audio", 24.0], [("references", "H3_REFERENCES")], (300, 130))
        g.link(image, 0, picture, "images")
        g.link(picture, 0, music, "references")
        g.link(sound, 0, music, "audio")
        g.link(music, 0, encode, "references")
        g.link(music, 0, sampler, "references")
        g.link(audio_vae, 0, sampler, "audio_vae")
    if extend:
        more = g.node(
            "H3ExtendOrInpaint",
            (860, 460),
            ["extend", 34, 0, 24, "follow"],
            [("start", "H3_START"), ("canvas", "H3_CANVAS")],
            (340, 220),
        )
        longer = g.node(
            "H3Sampler",
            (1260, 460),
            [mode, 20, 12.0, 3.0, 43, "fixed", 1.0, "released", "h3"],
            [("latent", "LATENT")],
            (340, 420),
            title="H3 Sampler (the extension)",
        )
        g.link(sampler, 0, more, "latent")
        for source, slot, name in (
            (dit, 0, "model"),
            (encode, 0, "conditioning"),
            (more, 1, "canvas"),
            (attention, 0, "attention"),
            (video_vae, 0, "video_vae"),
            (more, 0, "start"),
        ):
            g.link(source, slot, longer, name)
        save["pos"], save["widgets_values"][0] = [1660, 0], "H3/extend"
        sampler = longer
    g.link(video_vae, 0, save, "video_vae")
    g.link(sampler, 0, save, "latent")
    g.link(audio_vae, 0, save, "audio_vae")
    g.link(attention, 0, save, "attention")
    return g.workflow("Extend" if extend else mode)


def main() -> None:
    for mode, name in (
        ("FL2VA", "h3_fl2va.json"),
        ("T2VA", "h3_t2va.json"),
        ("Ref2VA", "h3_ref2va.json"),
        ("Extend", "h3_extend.json"),
    ):
        (WORKFLOWS / name).write_text(json.dumps(build(mode), indent=1) + "\n")


if __name__ == "__main__":
    main()
