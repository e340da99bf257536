"""Extend and inpaint through a real ComfyUI server: a generated clip extended by 17 frames in the same prompt
(H3 Extend / Inpaint → the sampler's start and canvas), its latents and decoded frames read back by a probe node."""

import re

import torch
from comfy_host import error_message
from graphs import generation


def extended(prompt_a, mode="extend", **options):
    """``prompt_a`` (a 22-frame generation) with a second sampler that starts from its clip."""
    prompt = {k: {"class_type": v["class_type"], "inputs": dict(v["inputs"])} for k, v in prompt_a.items()}
    prompt["60"] = {
        "class_type": "H3ExtendOrInpaint",
        "inputs": {
            "latent": ["7", 0],
            "mode": mode,
            "extend_frames": 17,
            "from_frame": 0,
            "to_frame": 24,
            "audio": "follow",
            **options,
        },
    }
    prompt["61"] = {"class_type": "H3Sampler", "inputs": dict(prompt["7"]["inputs"], seed=11, start=["60", 0])}
    prompt["61"]["inputs"]["canvas"] = ["60", 1]
    prompt["62"] = {"class_type": "H3VideoDecode", "inputs": dict(prompt["8"]["inputs"], latent=["61", 0])}
    for node, name in (("7", "latent_a"), ("61", "latent_b"), ("8", "frames_a"), ("62", "frames_b")):
        prompt[f"7{node}"] = {"class_type": "H3ProbeKeep", "inputs": {"value": [node, 0], "name": name}}
    return prompt


def kept(server, name):
    return torch.load(server.output / "probes" / f"{name}.pt", weights_only=False)


def test_extending_a_clip_holds_it_exactly(server):
    entry = server.run(extended(generation(prefix="H3/extend_source", length=22, seed=1)))
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    a, b = kept(server, "latent_a"), kept(server, "latent_b")
    assert a["samples"].shape[2] == 7 and b["samples"].shape[2] == 12 and b["h3_frames"] == 39
    assert torch.equal(b["samples"][:, :, :7], a["samples"])  # the clip's latents, bit for bit
    assert torch.equal(b["h3_audio"][..., :37], a["h3_audio"])
    assert not torch.equal(b["samples"][:, :, 7:], torch.zeros_like(b["samples"][:, :, 7:]))
    frames_a, frames_b = kept(server, "frames_a"), kept(server, "frames_b")
    assert frames_a.shape[0] == 22 and frames_b.shape[0] == 39
    # the decoder's first window (latents 0-6) is the clip's own; only its last 5 frames cross-fade into the next
    # window, which touches the new latents
    torch.testing.assert_close(frames_b[:17], frames_a[:17], rtol=0, atol=1e-3)


def test_inpainting_frames_holds_the_rest(server):
    entry = server.run(extended(generation(prefix="H3/inpaint_source", length=22, seed=2), mode="frames", to_frame=6))
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    a, b = kept(server, "latent_a"), kept(server, "latent_b")
    # frames 0-5: latent frames 0 (frame 0), 1 (1-4) and 2 (5-8) are regenerated, the rest held
    assert torch.equal(b["samples"][:, :, 3:], a["samples"][:, :, 3:])
    assert not torch.equal(b["samples"][:, :, :3], a["samples"][:, :, :3])


def test_a_region_from_the_hosts_noise_mask_and_bad_inputs_named(server):
    prompt = extended(generation(prefix="H3/region_noise_mask", length=22, seed=2), mode="region", to_frame=22)
    # the host's own Set Latent Noise Mask on the clip: the right half of the 64 x 32 canvas regenerated
    prompt["63"] = {"class_type": "SolidMask", "inputs": {"value": 1.0, "width": 32, "height": 32}}
    prompt["64"] = {"class_type": "SolidMask", "inputs": {"value": 0.0, "width": 64, "height": 32}}
    prompt["65"] = {
        "class_type": "MaskComposite",
        "inputs": {"destination": ["64", 0], "source": ["63", 0], "x": 32, "y": 0, "operation": "add"},
    }
    prompt["66"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["7", 0], "mask": ["65", 0]}}
    prompt["60"]["inputs"]["latent"] = ["66", 0]
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    a, b = kept(server, "latent_a"), kept(server, "latent_b")
    assert torch.equal(b["samples"][..., :2], a["samples"][..., :2])  # the left half held
    assert not torch.equal(b["samples"][..., 2:], a["samples"][..., 2:])
    entry = server.run(extended(generation(prefix="H3/region_none", length=22, seed=2), mode="region", to_frame=22))
    assert entry["status"]["status_str"] == "error" and "mode region: needs the mask input" in error_message(entry)
    prompt = extended(generation(prefix="H3/span_bad", length=22, seed=2), mode="frames", from_frame=20, to_frame=30)
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "error"
    assert re.search(r"the frames to regenerate, 20 to 30, must lie within the clip's 22 frames", error_message(entry))
