"""The pack in a real ComfyUI server: its nodes as the host lists them, and whole generations through
/prompt on the tiny random checkpoints, checked by reading the mp4 back."""

from fractions import Fraction

import av
import pytest
import torch
from comfy_host import error_message, mp4_files
from graphs import TINY_DIT, TINY_VIDEO_VAE, generation, with_references

NODES = {
    "H3DiTLoader": ({"dit_name", "linear_branch", "weight_dtype", "offload"}, ["H3_MODEL"]),
    "H3LoraLoader": ({"model", "lora_name", "strength"}, ["H3_MODEL"]),
    "H3MultiGPU": ({"model", "gpus", "softmax_ranks"}, ["H3_MODEL", "H3_VIDEO_VAE"]),
    "H3VideoVAELoader": ({"vae_name"}, ["H3_VIDEO_VAE"]),
    "H3AudioVAELoader": ({"vae_name"}, ["H3_AUDIO_VAE"]),
    "H3TextEncoderLoader": ({"text_encoder_name", "offload"}, ["H3_TEXT_ENCODER"]),
    "H3PromptEmbeddingLoader": ({"embedding"}, ["CONDITIONING"]),
    "H3Canvas": ({"width", "height", "length"}, ["H3_CANVAS", "INT", "INT", "INT"]),
    "H3TextEncode": ({"text_encoder", "prompt", "canvas"}, ["CONDITIONING"]),
    "H3AddReference": ({"kind", "fps"}, ["H3_REFERENCES"]),
    "H3AddKeyframe": ({"frame_idx"}, ["H3_KEYFRAMES"]),
    "H3ExtendOrInpaint": (
        {"latent", "mode", "extend_frames", "from_frame", "to_frame", "audio"},
        ["H3_START", "H3_CANVAS"],
    ),
    "H3LoadAudio": ({"audio_file"}, ["AUDIO"]),
    "H3AttentionSettings": (
        {"window_backend", "video_vae_attention", "audio_vae_attention", "memory_mode", "compile"},
        ["H3_ATTENTION"],
    ),
    "H3Sampler": (
        {"model", "conditioning", "canvas", "mode", "steps", "video_shift", "audio_shift", "seed"},
        ["LATENT"],
    ),
    "H3Scheduler": ({"scheduler", "steps", "video_shift"}, ["SIGMAS"]),
    "H3VideoDecode": ({"video_vae", "latent", "tile_size", "overlap", "tiles_per_batch"}, ["IMAGE"]),
    "H3AudioDecode": ({"audio_vae", "latent"}, ["AUDIO"]),
    "H3SaveVideo": ({"images", "filename_prefix", "fps"}, []),
}


def options(spec):
    """A dropdown's choices, as the host lists them (V3: ``("COMBO", {"options": [...]})``)."""
    return spec[1]["options"] if spec[0] == "COMBO" else spec[0]


def test_object_info_lists_every_node_with_its_types(server):
    info = server.object_info()
    for name, (required, outputs) in NODES.items():
        assert name in info, f"{name} missing from /object_info"
        node = info[name]
        assert node["category"] == "H3 Hybrid"
        assert set(node["input"]["required"]) == required, name
        assert node["output"] == outputs, name
    assert info["H3SaveVideo"]["output_node"] is True
    assert set(info["H3Sampler"]["input"]["optional"]) == {
        "attention",
        "video_vae",
        "audio_vae",
        "first_frame",
        "last_frame",
        "keyframes",
        "references",
        "sigmas",
        "sampler",
        "start",
        "reference_audio_t",
        "noise",
        "latent_form",
    }
    # the dropdowns list the tiny checkpoints from the host's model folders
    required = info["H3DiTLoader"]["input"]["required"]
    assert TINY_DIT in options(required["dit_name"]) and "none" in options(required["linear_branch"])
    assert TINY_VIDEO_VAE in options(info["H3VideoVAELoader"]["input"]["required"]["vae_name"])
    assert "h3_tiny_random_qwen3vl" in options(info["H3TextEncoderLoader"]["input"]["required"]["text_encoder_name"])
    assert options(info["H3Sampler"]["input"]["required"]["mode"]) == ["T2VA", "FL2VA", "Ref2VA"]
    assert {"simple", "beta"} <= set(options(info["H3Scheduler"]["input"]["required"]["scheduler"]))


def check_mp4(path, frames, width, height):
    assert path.is_file() and not any(p.name.startswith(".") for p in path.parent.iterdir())
    with av.open(str(path)) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        assert video.codec_context.name == "h264" and video.codec_context.pix_fmt == "yuv420p"
        assert (video.width, video.height) == (width, height) and video.average_rate == Fraction(24)
        assert audio.codec_context.name == "aac" and audio.rate == 32000 and audio.channels == 2
        decoded = sum(1 for _ in container.decode(video=0))
        video_s = float(video.duration * video.time_base)
        audio_s = float(audio.duration * audio.time_base)
    assert decoded == frames
    assert abs(video_s - frames / 24) < 0.05 and abs(audio_s - video_s) <= 0.25


@pytest.mark.parametrize(
    "mode, frames, size",
    [
        ("T2VA", {}, (64, 32)),
        ("FL2VA", {"first": "first.png", "last": "last.png"}, (64, 32)),
        # 3 x 3 latents: padded to whole patches for the model and cropped after, as native H3 does
        ("FL2VA", {"last": "last.png"}, (48, 48)),
    ],
    ids=["t2va", "fl2va", "last-frame-only-odd-canvas"],
)
def test_a_generation_writes_a_playable_mp4(server, mode, frames, size):
    width, height = size
    entry = server.run(generation(mode, prefix=f"H3/{mode.lower()}", width=width, height=height, **frames))
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    files = mp4_files(entry, server.output)
    assert len(files) == 1
    check_mp4(files[0], 56, width, height)


# An image reference is encoded at its released size (a 2048 px short edge, h3_core.pipeline.conditioning), the
# costliest
# part of a run on the CPU: one case holds an image, beside a video with its soundtrack and a sound.
def mp4_audio(path):
    import av
    import numpy as np

    with av.open(str(path)) as container:
        return np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)


def saved_latent(entry, output):
    """The latent the host's own SaveLatent node wrote for ``entry``, read back with safetensors."""
    from safetensors.torch import load_file

    (item,) = [item for node in entry.get("outputs", {}).values() for item in node.get("latents", [])]
    return load_file(str(output / item["subfolder"] / item["filename"]))["latent_tensor"]


def test_reference_audio_mixed_with_noise_changes_the_clip(server):
    """``reference_audio_t`` below 1 (the native model's audio noise augmentation) reaches the run: the same seed
    with the audio reference held clean (the default) and mixed to t = 0.6 gives a different clip, and the clean
    one again is the same clip. The clip is compared as the sampler's latent, saved by the host's SaveLatent: on the
    tiny random checkpoints the reference moves the result by about 1e-5 of its size, which the mp4's lossy AAC
    soundtrack can round away."""
    clips = {}
    for label, t in (("clean", 1.0), ("mixed", 0.6), ("again", 1.0)):
        prompt = with_references(generation("Ref2VA", prefix=f"H3/ref_audio_{label}"), audio="tone.wav")
        sampler_id = next(key for key, node in prompt.items() if node["class_type"] == "H3Sampler")
        prompt[sampler_id]["inputs"]["reference_audio_t"] = t
        prompt["30"] = {
            "class_type": "SaveLatent",
            "inputs": {"samples": [sampler_id, 0], "filename_prefix": f"latents/H3/ref_audio_{label}"},
        }
        entry = server.run(prompt)
        assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
        assert len(mp4_files(entry, server.output)) == 1
        clips[label] = saved_latent(entry, server.output)
    assert clips["clean"].shape == clips["mixed"].shape
    assert torch.equal(clips["clean"], clips["again"]) and not torch.equal(clips["clean"], clips["mixed"])


def test_the_comfyui_noise_draw_reaches_the_run(server):
    """``noise`` comfyui (the native graph's draw from the seed) starts elsewhere than the released draw for the
    same seed, and is the same clip when run again. Without keyframes or references the two draws share the video's
    noise (both draw it first) and differ in the audio's (native draws it as [32, 2, Ta], the release as rows)."""
    sounds = {}
    for label, draw in (("released", "released"), ("comfyui", "comfyui"), ("again", "comfyui")):
        prompt = generation(prefix=f"H3/noise_{label}", length=22, seed=5)
        prompt["7"]["inputs"]["noise"] = draw
        entry = server.run(prompt)
        assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
        (path,) = mp4_files(entry, server.output)
        sounds[label] = mp4_audio(path)
    assert (sounds["comfyui"] == sounds["again"]).all()
    assert sounds["released"].shape == sounds["comfyui"].shape and not (sounds["released"] == sounds["comfyui"]).all()


@pytest.mark.parametrize(
    "refs",
    [dict(image="first.png", video="clip.mp4", audio="tone.wav"), dict(audio="tone.wav")],
    ids=["image-video-audio", "audio-only"],
)
def test_ref2va_with_references_writes_a_playable_mp4(server, refs):
    prompt = with_references(generation("Ref2VA", prefix="H3/ref2va"), **refs)
    prompt["5"]["inputs"]["prompt"] = "<Picture 1>: a fox runs through snow"
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    files = mp4_files(entry, server.output)
    assert len(files) == 1
    check_mp4(files[0], 56, 64, 32)


def test_an_h3_prompt_writes_nothing_of_the_packs_own_under_the_user_folder(server):
    """After an H3 prompt ran, the pack has kept nothing under the host's user folder: the models' shapes live in the
    process, and the compilers' caches stay where the environment (or their defaults) put them."""
    entry = server.run(generation(prefix="H3/user_folder"))
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    assert not (server.base / "user" / "h3_hybrid").exists(), sorted((server.base / "user").rglob("*"))
