"""API-form prompts for the host tests, built node by node as the frontend's "Export (API)" would."""

from __future__ import annotations

from tiny_checkpoints import TINY_FILES

TINY_DIT, TINY_BRANCH = TINY_FILES["dit"], TINY_FILES["linear_branch"]
TINY_VIDEO_VAE, TINY_AUDIO_VAE = TINY_FILES["video_vae"], TINY_FILES["audio_vae"]
TINY_TEXT_ENCODER = TINY_FILES["text_encoder"]


def generation(
    mode: str = "T2VA",
    *,
    length: int = 56,
    width: int = 64,
    height: int = 32,
    steps: int = 2,
    seed: int = 0,
    branch: str = TINY_BRANCH,
    first: str | None = None,
    last: str | None = None,
    prefix: str = "H3/test",
    dit: str = TINY_DIT,
    video_vae: str = TINY_VIDEO_VAE,
    audio_vae: str = TINY_AUDIO_VAE,
) -> dict:
    prompt = {
        "1": {
            "class_type": "H3DiTLoader",
            "inputs": {"dit_name": dit, "linear_branch": branch, "weight_dtype": "bf16", "offload": "auto"},
        },
        "2": {"class_type": "H3VideoVAELoader", "inputs": {"vae_name": video_vae}},
        "3": {"class_type": "H3AudioVAELoader", "inputs": {"vae_name": audio_vae}},
        "4": {
            "class_type": "H3TextEncoderLoader",
            "inputs": {"text_encoder_name": TINY_TEXT_ENCODER, "offload": "auto"},
        },
        "13": {"class_type": "H3Canvas", "inputs": {"width": width, "height": height, "length": length}},
        "5": {
            "class_type": "H3TextEncode",
            "inputs": {"text_encoder": ["4", 0], "prompt": "a fox runs through snow", "canvas": ["13", 0]},
        },
        "6": {
            "class_type": "H3AttentionSettings",
            "inputs": {
                "window_backend": "auto",
                "video_vae_attention": "auto",
                "audio_vae_attention": "auto",
                "memory_mode": "auto",
                "compile": "auto",
            },
        },
        "7": {
            "class_type": "H3Sampler",
            "inputs": {
                "model": ["1", 0],
                "conditioning": ["5", 0],
                "canvas": ["13", 0],
                "mode": mode,
                "steps": steps,
                "video_shift": 12.0,
                "audio_shift": 3.0,
                "seed": seed,
                "attention": ["6", 0],
                "video_vae": ["2", 0],
                "audio_vae": ["3", 0],
            },
        },
        "8": {
            "class_type": "H3VideoDecode",
            "inputs": {
                "video_vae": ["2", 0],
                "latent": ["7", 0],
                "tile_size": 256,
                "overlap": 64,
                "tiles_per_batch": 4,
                "attention": ["6", 0],
            },
        },
        "9": {"class_type": "H3AudioDecode", "inputs": {"audio_vae": ["3", 0], "latent": ["7", 0]}},
        "10": {
            "class_type": "H3SaveVideo",
            "inputs": {"images": ["8", 0], "audio": ["9", 0], "filename_prefix": prefix, "fps": 24},
        },
    }
    for node_id, anchor, image in (("11", "first", first), ("12", "last", last)):
        if image is not None:
            prompt[node_id] = {"class_type": "LoadImage", "inputs": {"image": image}}
            prompt["5"]["inputs"][f"{anchor}_frame"] = [node_id, 0]
            prompt["7"]["inputs"][f"{anchor}_frame"] = [node_id, 0]
    return prompt


def with_references(
    prompt: dict, *, image: str | None = None, video: str | None = None, audio: str | None = None
) -> dict:
    """``prompt`` (a ``generation``) with a chain of H3 Add Reference nodes (image, then video with its
    soundtrack, then audio, those given) feeding the text encoder and the sampler."""
    prompt = {k: {"class_type": v["class_type"], "inputs": dict(v["inputs"])} for k, v in prompt.items()}
    last = None

    def add(node_id, kind, **inputs):
        nonlocal last
        node = {"kind": kind, "fps": 24.0, **inputs}
        if last is not None:
            node["references"] = [last, 0]
        prompt[node_id] = {"class_type": "H3AddReference", "inputs": node}
        last = node_id

    if image is not None:
        prompt["20"] = {"class_type": "LoadImage", "inputs": {"image": image}}
        add("21", "image", images=["20", 0])
    if video is not None:
        prompt["22"] = {"class_type": "LoadVideo", "inputs": {"file": video}}
        prompt["23"] = {"class_type": "GetVideoComponents", "inputs": {"video": ["22", 0]}}
        add("24", "video", images=["23", 0], audio=["23", 1])
        prompt["24"]["inputs"]["fps"] = ["23", 2]
    if audio is not None:
        prompt["25"] = {"class_type": "H3LoadAudio", "inputs": {"audio_file": audio}}
        add("26", "audio", audio=["25", 0])
    if last is not None:
        prompt["5"]["inputs"]["references"] = [last, 0]
        prompt["7"]["inputs"]["references"] = [last, 0]
    return prompt


def with_decode_and_save(prompt: dict, prefix: str) -> dict:
    """``prompt`` (a ``generation``) with its decode and save nodes replaced by one H3 Decode & Save (node "8")."""
    prompt = {
        k: {"class_type": v["class_type"], "inputs": dict(v["inputs"])}
        for k, v in prompt.items()
        if k not in ("8", "9", "10")
    }
    prompt["8"] = {
        "class_type": "H3DecodeAndSave",
        "inputs": {
            "video_vae": ["2", 0],
            "audio_vae": ["3", 0],
            "latent": ["7", 0],
            "filename_prefix": prefix,
            "fps": 24,
            "encoder": "auto",
            "encoder_preset": "superfast",
            "tile_size": 256,
            "overlap": 64,
            "tiles_per_batch": 4,
            "attention": ["6", 0],
        },
    }
    return prompt


def with_keyframes(prompt: dict, keyframes: list[dict]) -> dict:
    """``prompt`` (a ``generation``) in mode FL2VA with a chain of H3 Add Keyframe nodes feeding the sampler, one
    per entry in order: ``frame_idx`` and any of ``image`` (a file for LoadImage), ``video`` (a file for
    LoadVideo: its frames) and ``audio`` (a file for H3LoadAudio)."""
    prompt = {k: {"class_type": v["class_type"], "inputs": dict(v["inputs"])} for k, v in prompt.items()}
    prompt["7"]["inputs"]["mode"] = "FL2VA"
    last = None
    for i, keyframe in enumerate(keyframes):
        base = 40 + 5 * i
        node = {"frame_idx": keyframe["frame_idx"]}
        if "image" in keyframe:
            prompt[str(base)] = {"class_type": "LoadImage", "inputs": {"image": keyframe["image"]}}
            node["images"] = [str(base), 0]
        if "video" in keyframe:
            prompt[str(base)] = {"class_type": "LoadVideo", "inputs": {"file": keyframe["video"]}}
            prompt[str(base + 1)] = {"class_type": "GetVideoComponents", "inputs": {"video": [str(base), 0]}}
            node["images"] = [str(base + 1), 0]
        if "audio" in keyframe:
            prompt[str(base + 2)] = {"class_type": "H3LoadAudio", "inputs": {"audio_file": keyframe["audio"]}}
            node["audio"] = [str(base + 2), 0]
        if last is not None:
            node["keyframes"] = [last, 0]
        last = str(base + 3)
        prompt[last] = {"class_type": "H3AddKeyframe", "inputs": node}
    prompt["7"]["inputs"]["keyframes"] = [last, 0]
    return prompt
