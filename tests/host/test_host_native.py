"""Native H3 types through a real ComfyUI server: the sampler's LATENT in ComfyUI's own nested form, read by the
pack's decoders, and a CONDITIONING in the form ComfyUI's own H3 nodes make (row tags and keyframes), taken by the
sampler."""

import av
import numpy as np
from comfy_host import error_message
from graphs import generation, with_references


def run(server, prompt):
    events = list(server.events(prompt))
    assert events[-1][0] == "execution_success", error_message({"status": {"messages": events}}) + server.log_tail()
    texts = "\n".join(text for kind, (node, text) in (e for e in events if e[0] == "text") if node == "7")
    prefix = prompt["10"]["inputs"]["filename_prefix"]
    (path,) = sorted(server.output.glob(prefix + "*.mp4"))
    with av.open(str(path)) as container:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    with av.open(str(path)) as container:
        sound = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)
    return frames, sound, texts


def test_the_native_latent_decodes_as_the_packs_own(server):
    ours = generation(prefix="H3/form_h3", length=22, seed=9)
    native = generation(prefix="H3/form_native", length=22, seed=9)
    native["7"]["inputs"]["latent_form"] = "native"
    frames, sound, _ = run(server, ours)
    native_frames, native_sound, _ = run(server, native)
    assert np.array_equal(frames, native_frames) and np.array_equal(sound, native_sound)


def test_a_native_conditioning_brings_its_tags_and_keyframes(server):
    prompt = generation(prefix="H3/native_cond", length=22, seed=3)
    prompt["30"] = {
        "class_type": "H3ProbeNativeConditioning",
        "inputs": {"conditioning": ["5", 0], "frame_idx": 9, "width": 64, "height": 32, "audio_latents": 6},
    }
    prompt["7"]["inputs"]["conditioning"] = ["30", 0]
    frames, sound, told = run(server, prompt)
    assert "from the conditioning:" in told and "keyframe 1: an image and 6 audio latents at frame 9" in told, told
    plain_frames, plain_sound, _ = run(server, generation(prefix="H3/native_cond_plain", length=22, seed=3))
    assert not np.array_equal(sound, plain_sound), "the native keyframe's rows did not reach the model"
    referenced = with_references(prompt, audio="tone.wav")
    referenced["7"]["inputs"].update(mode="Ref2VA", conditioning=["30", 0])
    entry = server.run(referenced)
    assert entry["status"]["status_str"] == "error"
    assert "carries 1 keyframes from ComfyUI's own H3 nodes, which mode Ref2VA does not take" in error_message(entry)


def test_a_native_conditioning_brings_its_references(server):
    prompt = generation(prefix="H3/native_refs", length=22, seed=4)
    prompt["30"] = {
        "class_type": "H3ProbeNativeConditioning",
        "inputs": {
            "conditioning": ["5", 0],
            "frame_idx": 0,
            "width": 64,
            "height": 32,
            "audio_latents": 12,
            "references": True,
        },
    }
    prompt["7"]["inputs"]["conditioning"] = ["30", 0]
    _, sound, told = run(server, prompt)
    assert "references from the conditioning: image, audio" in told, told
    _, plain_sound, _ = run(server, generation(prefix="H3/native_refs_plain", length=22, seed=4))
    assert not np.array_equal(sound, plain_sound), "the native references did not reach the model"
    prompt["7"]["inputs"]["mode"] = "FL2VA"
    prompt["7"]["inputs"]["first_frame"] = ["31", 0]
    prompt["31"] = {"class_type": "LoadImage", "inputs": {"image": "first.png"}}
    entry = server.run(prompt)
    assert "which run in mode T2VA with no keyframes" in error_message(entry), error_message(entry)


def test_a_schedule_from_the_hosts_scheduler_node_drives_the_sampler(server):
    """The host's own KarrasScheduler, set to the flow's range, in place of the released schedule; a scheduler left
    at another model's range is refused by name."""
    prompt = generation(prefix="H3/karras", length=22, seed=6)
    prompt["35"] = {
        "class_type": "KarrasScheduler",
        "inputs": {"steps": 3, "sigma_max": 1.0, "sigma_min": 0.02, "rho": 7.0},
    }
    prompt["7"]["inputs"]["sigmas"] = ["35", 0]
    _, sound, told = run(server, prompt)
    assert "sigmas: 3 steps from 1 to 0, as connected" in told, told
    _, released, _ = run(server, generation(prefix="H3/karras_plain", length=22, seed=6, steps=3))
    assert not np.array_equal(sound, released)
    prompt["35"]["inputs"]["sigma_max"] = 14.614642
    entry = server.run(prompt)
    assert "H3 is a flow model, its sigmas run from at most 1 down to 0; got 14.6146" in error_message(entry)
