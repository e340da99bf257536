"""Writes the workflows for ComfyUI's native H3 with VDN-H3 (UI format) into workflows/: the host's own H3 graph
(its loaders, text encoder, VAEs, samplers and video nodes) with H3 VDN-H3 Patch between the model loader and the
sampler. They need ComfyUI 0.30 or later (native H3); the node inputs are those of ``native_schema``.

    h3_vdn_native_t2va.json   prompt → video + stereo audio
    h3_vdn_native_fl2va.json  first and last frame → video + stereo audio

    python3 tests/make_native_workflows.py
"""

from __future__ import annotations

import json

from make_workflows import BRANCH, COMFY_REPO, DIT, FIRST, LAST, PROMPT, VDN_REPO, WORKFLOWS, Graph

TEXT_ENCODER = "qwen3vl_32b_minimax_h3_bf16.safetensors"
VIDEO_VAE, AUDIO_VAE = "minimax_h3_video_vae_fp16.safetensors", "minimax_h3_audio_vae_fp32.safetensors"


def build(mode: str) -> dict:
    g = Graph()
    unet = g.node("UNETLoader", (0, 0), [DIT, "default"], [("MODEL", "MODEL")],
                  files=[(DIT, COMFY_REPO, "diffusion_models")])  # fmt: skip
    patch = g.node("H3VDNPatch", (360, 0), [BRANCH, 1, 5, "both", "auto", "bf16", "auto"], [("model", "MODEL")],
                   (340, 254), files=[(BRANCH, VDN_REPO, "diffusion_models")])  # fmt: skip
    g.link(unet, 0, patch, "model")
    clip = g.node("CLIPLoader", (0, 160), [TEXT_ENCODER, "minimax", "default"], [("CLIP", "CLIP")],
                  files=[(TEXT_ENCODER, COMFY_REPO, "text_encoders")])  # fmt: skip
    video_vae = g.node("VAELoader", (0, 320), [VIDEO_VAE], [("VAE", "VAE")], title="Load VAE (video)",
                       files=[(VIDEO_VAE, COMFY_REPO, "vae")])  # fmt: skip
    audio_vae = g.node("VAELoader", (0, 440), [AUDIO_VAE], [("VAE", "VAE")], title="Load VAE (audio)",
                       files=[(AUDIO_VAE, COMFY_REPO, "vae")])  # fmt: skip
    encode = g.node("MiniMaxH3ImageToVideo", (360, 260), [PROMPT, 1344, 768, 124],
                    [("positive", "CONDITIONING"), ("LATENT", "LATENT")], (380, 260))  # fmt: skip
    g.link(clip, 0, encode, "clip")
    g.link(video_vae, 0, encode, "vae")
    if mode == "FL2VA":
        for i, (name, image) in enumerate((("first_frame", FIRST), ("last_frame", LAST))):
            load = g.node("LoadImage", (0, 560 + 320 * i), [image, "image"], [("IMAGE", "IMAGE"), ("MASK", "MASK")])
            g.link(load, 0, encode, name)
    noise = g.node("RandomNoise", (780, 0), [42, "fixed"], [("NOISE", "NOISE")])
    select = g.node("KSamplerSelect", (780, 120), ["res_multistep"], [("SAMPLER", "SAMPLER")])
    schedule = g.node("BasicScheduler", (780, 220), ["simple", 20, 1.0], [("SIGMAS", "SIGMAS")])
    g.link(patch, 0, schedule, "model")
    guider = g.node("BasicGuider", (780, 380), [], [("GUIDER", "GUIDER")])
    g.link(patch, 0, guider, "model")
    g.link(encode, 0, guider, "conditioning")
    sample = g.node("SamplerCustomAdvanced", (1120, 0), [],
                    [("output", "LATENT"), ("denoised_output", "LATENT")], (300, 200))  # fmt: skip
    for source, slot, name in ((noise, 0, "noise"), (guider, 0, "guider"), (select, 0, "sampler"),
                               (schedule, 0, "sigmas"), (encode, 1, "latent_image")):  # fmt: skip
        g.link(source, slot, sample, name)
    frames = g.node("VAEDecode", (1460, 0), [], [("IMAGE", "IMAGE")])
    g.link(sample, 0, frames, "samples")
    g.link(video_vae, 0, frames, "vae")
    sound = g.node("VAEDecodeAudio", (1460, 120), [], [("AUDIO", "AUDIO")])
    g.link(sample, 0, sound, "samples")
    g.link(audio_vae, 0, sound, "vae")
    video = g.node("CreateVideo", (1460, 240), [24, "auto", "sRGB", "none"], [("VIDEO", "VIDEO")])
    g.link(frames, 0, video, "images")
    g.link(sound, 0, video, "audio")
    save = g.node("SaveVideo", (1800, 0), [f"video/H3_VDN_native_{mode.lower()}", "auto", "auto"], [], (360, 420))
    g.link(video, 0, save, "video")
    return g.workflow(f"vdn-native-{mode}")


def main() -> None:
    for mode in ("T2VA", "FL2VA"):
        (WORKFLOWS / f"h3_vdn_native_{mode.lower()}.json").write_text(json.dumps(build(mode), indent=1) + "\n")


if __name__ == "__main__":
    main()
