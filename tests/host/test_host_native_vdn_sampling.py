"""H3 VDN-H3 Patch sampled end to end by the host in a real ComfyUI server. The native H3 MODEL (the tests'
re-derivation of ComfyUI 0.38's, in a model_base like its ``MiniMaxH3``: ``probe_nodes._native_h3``) goes through H3
VDN-H3 Patch, then the host's own KSamplerSelect + BasicScheduler + BasicGuider + RandomNoise + SamplerCustomAdvanced
on an empty native AV latent, then the pack's H3 Decode & Save. The pack's own H3 DiT Loader (the same DiT and
branch file) goes through its H3 Sampler with the same sampler, schedule and seed, then the same decode. The two
mp4s have the same frames, pixel for pixel.

Made the same on both sides:
  * the dtype: the native model holds the DiT's weights in fp32, as the other native tests run it, so the pack's DiT
    runs in fp32 too (``H3ProbeFloat32DiT``); in bf16 the two models would round at different points, far apart;
  * the starting noise: the H3 Sampler's ``comfyui`` draw is the host's ``prepare_noise`` on the nested latent
    (video, then audio, from one generator seeded with the seed);
  * the schedule: BasicScheduler reads the native model's own flow sampling at the video shift, H3 Scheduler the
    host's flow sampling at that shift; both are kept and must be equal;
  * the audio is carried on the video schedule on both sides (the native model_base's ``audio_scale``, the pack's
    ``carried_audio``), and each evaluation's per-row timesteps come from the video σ with shifts 12 and 3.

What still differs is fp32 rounding, of two implementations of the same arithmetic:
  * the models: the pack's DiT and the native blocks with the patch's attention, given the same inputs, agree to
    about 2e-7 of the velocity's scale (40-60 % of the values bit for bit);
  * the carried audio: the pack reads it back dividing by a float64 carry factor, native multiplying by an fp32
    σ_a / σ_v; the two form its clean estimate by two formulas; and the pack derives the audio timestep
    1 − σ_a in fp32 where native does in float64 (1.5e-7 apart at σ = 0.96).
So the latents agree to a few float32 units in the last place, not bit for bit: compared at 1e-6 of their scale,
so that a failure says where the paths part. The decoded frames round those differences away (8-bit pixels) and
are compared exactly. The soundtrack cannot be: AAC encodes waveforms that differ by 4e-7 into different
bitstreams (at this length they decode up to 0.03 apart; the same waveform encodes identically). The soundtracks
are therefore compared as decoded before encoding (H3 Audio Decode), and the mp4s' audio tracks by their layout."""

import os

import av
import numpy as np
import torch
from comfy_host import error_message
from graphs import TINY_AUDIO_VAE, TINY_BRANCH, TINY_DIT, TINY_TEXT_ENCODER, TINY_VIDEO_VAE
from test_host_native_vdn import patch_inputs

# The two soundtracks decoded from latents that agree to 1e-6 of their scale: on the CPU within 2e-6 of the
# waveform's scale; on a GPU the audio decoder's convolutions may run in TF32 (PyTorch's default for cuDNN), and the
# latents' last-bit differences came through at 1.4e-5 (H100, bench/results/host_gpu.md)
WAVE_TOLERANCE = 5e-5 if os.environ.get("H3_COMFY_GPU") == "1" else 2e-6

# 12 latent frames: more than the window (chunks of 5, one chunk each side) sees, so the patch's attention is not
# plain attention
LENGTH, WIDTH, HEIGHT, STEPS, SEED = 39, 64, 32, 3, 5
LATENT_FRAMES, AUDIO_LATENTS = 12, 65


def decode_and_save(latent, prefix):
    return {
        "class_type": "H3DecodeAndSave",
        "inputs": {
            "video_vae": ["3", 0],
            "audio_vae": ["4", 0],
            "latent": latent,
            "filename_prefix": prefix,
            "fps": 24,
            "encoder": "libx264",
            "encoder_preset": "superfast",
            "tile_size": 256,
            "overlap": 64,
            "tiles_per_batch": 4,
        },
    }


def sampling_graph() -> dict:
    """Both paths in one prompt: the host's (nodes 1x) and the pack's (2x), from the same files, prompt and seed,
    each kept (9x) as it leaves its sampler and its audio decode."""
    loader = {"dit_name": TINY_DIT, "weight_dtype": "bf16", "offload": "auto"}
    return {
        "1": {"class_type": "H3DiTLoader", "inputs": {**loader, "linear_branch": "none"}},
        "2": {"class_type": "H3DiTLoader", "inputs": {**loader, "linear_branch": TINY_BRANCH}},
        "3": {"class_type": "H3VideoVAELoader", "inputs": {"vae_name": TINY_VIDEO_VAE}},
        "4": {"class_type": "H3AudioVAELoader", "inputs": {"vae_name": TINY_AUDIO_VAE}},
        "5": {
            "class_type": "H3TextEncoderLoader",
            "inputs": {"text_encoder_name": TINY_TEXT_ENCODER, "offload": "auto"},
        },
        "6": {"class_type": "H3Canvas", "inputs": {"width": WIDTH, "height": HEIGHT, "length": LENGTH}},
        "7": {
            "class_type": "H3TextEncode",
            "inputs": {"text_encoder": ["5", 0], "prompt": "a fox runs through snow", "canvas": ["6", 0]},
        },
        "8": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        # the host's path: native MODEL -> H3 VDN-H3 Patch (the release window, as the H3 Sampler's) -> the host's
        # sampler -> the pack's decode
        "10": {"class_type": "H3ProbeNativeH3Model", "inputs": {"h3_model": ["1", 0]}},
        "11": {"class_type": "H3VDNPatch", "inputs": patch_inputs(["10", 0])},
        "12": {"class_type": "H3ProbeNativeTextConditioning", "inputs": {"conditioning": ["7", 0]}},
        "13": {"class_type": "BasicGuider", "inputs": {"model": ["11", 0], "conditioning": ["12", 0]}},
        "14": {
            "class_type": "BasicScheduler",
            "inputs": {"model": ["11", 0], "scheduler": "simple", "steps": STEPS, "denoise": 1.0},
        },
        "15": {"class_type": "RandomNoise", "inputs": {"noise_seed": SEED}},
        "16": {
            "class_type": "H3ProbeEmptyNativeLatentAV",
            "inputs": {"width": ["6", 1], "height": ["6", 2], "length": ["6", 3]},
        },  # fmt: skip
        "17": {
            "class_type": "SamplerCustomAdvanced",
            "inputs": {
                "noise": ["15", 0],
                "guider": ["13", 0],
                "sampler": ["8", 0],
                "sigmas": ["14", 0],
                "latent_image": ["16", 0],
            },
        },  # fmt: skip
        "18": decode_and_save(["17", 0], "H3/native_vdn_host"),
        "19": {"class_type": "H3AudioDecode", "inputs": {"audio_vae": ["4", 0], "latent": ["17", 0]}},
        "91": {"class_type": "H3ProbeKeep", "inputs": {"value": ["14", 0], "name": "native_vdn_sigmas_host"}},
        "93": {"class_type": "H3ProbeKeepStreams", "inputs": {"latent": ["17", 0], "name": "native_vdn_host"}},
        "95": {"class_type": "H3ProbeKeep", "inputs": {"value": ["19", 0], "name": "native_vdn_sound_host"}},
        # the pack's path: its DiT loader with the branch -> its sampler -> the same decode
        "20": {"class_type": "H3ProbeFloat32DiT", "inputs": {"h3_model": ["2", 0]}},
        "21": {"class_type": "H3Scheduler", "inputs": {"scheduler": "simple", "steps": STEPS, "video_shift": 12.0}},
        "22": {
            "class_type": "H3Sampler",
            "inputs": {
                "model": ["20", 0],
                "conditioning": ["7", 0],
                "canvas": ["6", 0],
                "mode": "T2VA",
                "steps": STEPS,
                "video_shift": 12.0,
                "audio_shift": 3.0,
                "seed": SEED,
                "sampler": ["8", 0],
                "sigmas": ["21", 0],
                "noise": "comfyui",
                "latent_form": "native",
            },
        },
        "23": decode_and_save(["22", 0], "H3/native_vdn_pack"),
        "24": {"class_type": "H3AudioDecode", "inputs": {"audio_vae": ["4", 0], "latent": ["22", 0]}},
        "92": {"class_type": "H3ProbeKeep", "inputs": {"value": ["21", 0], "name": "native_vdn_sigmas_pack"}},
        "94": {"class_type": "H3ProbeKeepStreams", "inputs": {"latent": ["22", 0], "name": "native_vdn_pack"}},
        "96": {"class_type": "H3ProbeKeep", "inputs": {"value": ["24", 0], "name": "native_vdn_sound_pack"}},
    }


def kept(server, name):
    return torch.load(server.output / "probes" / f"{name}.pt", weights_only=True)


def contents(path):
    """The mp4's frames ``[F, H, W, 3]`` uint8, its audio samples ``[channels, n]`` and their rate."""
    with av.open(str(path)) as container:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    with av.open(str(path)) as container:
        rate = container.streams.audio[0].rate
        sound = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)
    return frames, sound, rate


def written(server, entry, node):
    (item,) = entry["outputs"][node]["images"]
    return server.output / item["subfolder"] / item["filename"]


def test_the_hosts_sampler_on_the_patched_native_model_writes_the_packs_mp4(server):
    prompt = sampling_graph()
    # the same host path on the unpatched native model: plain H3, whose latents the VDN-H3 ones are not
    prompt["30"] = {"class_type": "BasicGuider", "inputs": {"model": ["10", 0], "conditioning": ["12", 0]}}
    prompt["31"] = {"class_type": "SamplerCustomAdvanced", "inputs": dict(prompt["17"]["inputs"], guider=["30", 0])}
    prompt["97"] = {"class_type": "H3ProbeKeepStreams", "inputs": {"latent": ["31", 0], "name": "native_plain_host"}}
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()

    # the same schedule: the native model's own flow sampling, and the host's at H3's video shift
    host_sigmas, pack_sigmas = kept(server, "native_vdn_sigmas_host"), kept(server, "native_vdn_sigmas_pack")
    assert len(host_sigmas) == STEPS + 1 and torch.equal(host_sigmas, pack_sigmas), (host_sigmas, pack_sigmas)

    # the latents before decoding, ComfyUI's nested pair on both sides
    host_video, host_audio = kept(server, "native_vdn_host")
    pack_video, pack_audio = kept(server, "native_vdn_pack")
    assert host_video.shape == pack_video.shape == (1, 24, LATENT_FRAMES, HEIGHT // 16, WIDTH // 16)
    assert host_audio.shape == pack_audio.shape == (1, 32, 2, AUDIO_LATENTS)
    scale = max(pack_video.abs().max().item(), pack_audio.abs().max().item())
    video_diff = (host_video - pack_video).abs().max().item()
    audio_diff = (host_audio - pack_audio).abs().max().item()
    assert video_diff <= 1e-6 * scale and audio_diff <= 1e-6 * scale, (video_diff, audio_diff, scale)
    plain_video, plain_audio = kept(server, "native_plain_host")
    plain_diff = (plain_video - pack_video).abs().max().item(), (plain_audio - pack_audio).abs().max().item()
    assert plain_diff[0] > 20 * max(video_diff, 1e-7 * scale), (plain_diff, video_diff)
    assert plain_diff[1] > 20 * max(audio_diff, 1e-7 * scale), (plain_diff, audio_diff)

    # the mp4s: every frame's pixels; the audio tracks' layout
    host_frames, host_sound, host_rate = contents(written(server, entry, "18"))
    pack_frames, pack_sound, pack_rate = contents(written(server, entry, "23"))
    assert host_frames.shape == pack_frames.shape == (LENGTH, HEIGHT, WIDTH, 3)
    assert np.array_equal(host_frames, pack_frames), f"{int((host_frames != pack_frames).sum())} pixel values differ"
    assert host_sound.shape == pack_sound.shape and host_rate == pack_rate == 32000, (host_sound.shape, host_rate)

    # the soundtracks as decoded for the mp4, before AAC
    host_wave, pack_wave = kept(server, "native_vdn_sound_host"), kept(server, "native_vdn_sound_pack")
    assert host_wave["sample_rate"] == pack_wave["sample_rate"] == 32000
    assert host_wave["waveform"].shape == pack_wave["waveform"].shape == (1, 2, LENGTH * 32000 // 24)
    wave_diff = (host_wave["waveform"] - pack_wave["waveform"]).abs().max().item()
    assert wave_diff <= WAVE_TOLERANCE * max(pack_wave["waveform"].abs().max().item(), 1e-3), wave_diff
