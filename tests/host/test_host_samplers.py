"""The host's samplers and schedulers on the pack's model, and turbo LoRAs at their published schedules, through a
real ComfyUI server: KSamplerSelect's SAMPLER and H3 Scheduler's SIGMAS into the H3 Sampler; the latents read back
by a probe node.

The turbo LoRAs are tiny random ones in the two key layouts lightx2v publishes for H3: the ComfyUI files
(``minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16``, ``minimax_h3_ref2v_turbo_4step_v0.1_comfyui_bf16``) name the
native modules under ``diffusion_model.`` with ``lora_down`` / ``lora_up`` and an ``.alpha`` (what ComfyUI's own H3
key map reads, comfy/lora.py at Comfy-Org/ComfyUI 17358c8f), and full differences beside them (``.diff_b``); its
own files use diffusers' PEFT names (``transformer_blocks.N.attn.to_q``, the token refiner's ``attn.k_proj``,
``lora_A`` / ``lora_B``; sgl-project/sglang PR 34258, deepbeepmeep/Wan2GP issue 2101). Each runs at its published
schedule: the FL2V 8-step one with euler and the simple scheduler at 8 steps, video shift 12 and audio shift 3,
strength 1 (T2VA); the Ref2V 4-step one with euler and simple at 4 steps (Ref2VA)."""

import torch
from comfy_host import error_message
from graphs import generation, with_references
from safetensors.torch import save_file
from test_host_loras import with_loras
from tiny_checkpoints import TINY_DIT


def kept(server, name):
    return torch.load(server.output / "probes" / f"{name}.pt", weights_only=False)


def keep(prompt, node, name):
    prompt[f"9{node}"] = {"class_type": "H3ProbeKeep", "inputs": {"value": [node, 0], "name": name}}


def host_sampling(prompt, node, sampler, scheduler=None, steps=None, video_shift=12.0):
    """A second H3 Sampler ``node`` like ``7`` with KSamplerSelect's ``sampler`` (and H3 Scheduler's sigmas)."""
    prompt[f"{node}1"] = {"class_type": "KSamplerSelect", "inputs": {"sampler_name": sampler}}
    inputs = dict(prompt["7"]["inputs"], sampler=[f"{node}1", 0])
    if scheduler is not None:
        prompt[f"{node}2"] = {
            "class_type": "H3Scheduler",
            "inputs": {"scheduler": scheduler, "steps": steps, "video_shift": video_shift},
        }
        inputs["sigmas"] = [f"{node}2", 0]
    prompt[node] = {"class_type": "H3Sampler", "inputs": inputs}
    return prompt


def simple_schedule(steps, shift):
    """The host's simple scheduler on a flow model, re-derived from comfy/samplers.py ``simple_scheduler`` and
    comfy/model_sampling.py ``ModelSamplingDiscreteFlow`` (Comfy-Org/ComfyUI 2fd20839): its 1000 σ
    ``shift·t / (1 + (shift − 1)·t)`` at t = i/1000, every (1000/steps)-th from the top, then 0."""
    t = torch.arange(1, 1001, dtype=torch.float32) / 1000
    table = shift * t / (1 + (shift - 1) * t)
    stride = len(table) / steps
    return torch.tensor([float(table[-(1 + int(i * stride))]) for i in range(steps)] + [0.0])


def run(server, prompt):
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    return entry


def test_the_hosts_euler_gives_the_released_latents_and_its_other_samplers_and_schedulers_run(server):
    prompt = generation(length=22, steps=3, seed=3, prefix="H3/host_samplers")
    host_sampling(prompt, "81", "euler")
    host_sampling(prompt, "84", "res_multistep", scheduler="beta", steps=3)
    for node, name in (("7", "released"), ("81", "euler"), ("84", "res_multistep_beta")):
        keep(prompt, node, name)
    run(server, prompt)
    released, euler, other = kept(server, "released"), kept(server, "euler"), kept(server, "res_multistep_beta")
    # the host's Euler over the released grid is the released sampler, the audio carried on the video schedule
    torch.testing.assert_close(euler["samples"], released["samples"], rtol=0, atol=1e-4)
    torch.testing.assert_close(euler["h3_audio"], released["h3_audio"], rtol=0, atol=1e-4)
    assert torch.isfinite(other["samples"]).all() and torch.isfinite(other["h3_audio"]).all()
    # another method on another schedule (the tiny random model's velocity hardly depends on σ, so close to it)
    assert not torch.equal(other["samples"], released["samples"])


def test_a_sampler_needing_guidance_is_named(server):
    prompt = host_sampling(generation(length=22, prefix="H3/cfg_pp"), "81", "euler_cfg_pp")
    prompt["7"] = prompt.pop("81")
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "error"
    assert "sampler: sample_euler_cfg_pp needs classifier-free guidance" in error_message(entry)


def comfyui_layout(path, rank=4):
    """lightx2v's ComfyUI files: native names under diffusion_model., lora_down / lora_up, alpha (8 at rank 128:
    1/16 of the rank here), a bias difference."""
    g = torch.Generator().manual_seed(7)
    inner, hidden = TINY_DIT.heads * TINY_DIT.head_dim, TINY_DIT.hidden
    shapes = {"attn.qkv_proj": (hidden, 3 * inner), "attn.out_proj": (inner, hidden), "mlp.fc2": (TINY_DIT.ffn, hidden)}
    tensors = {}
    for stem in [f"blocks.{i}" for i in range(TINY_DIT.layers)] + ["token_refiner.blocks.0"]:
        for module, (fan_in, fan_out) in shapes.items():
            key = f"diffusion_model.{stem}.{module}"
            tensors[f"{key}.lora_down.weight"] = torch.randn(rank, fan_in, generator=g)
            tensors[f"{key}.lora_up.weight"] = torch.randn(fan_out, rank, generator=g)
            tensors[f"{key}.alpha"] = torch.tensor(rank / 16)
    tensors["diffusion_model.final_layer.video_out.diff_b"] = torch.randn(2 * 2 * 24, generator=g) * 0.1
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(path))


def peft_layout(path, rank=4):
    """lightx2v's own files: diffusers' PEFT names, q / k / v split, the token refiner's k_proj."""
    g = torch.Generator().manual_seed(8)
    inner, hidden = TINY_DIT.heads * TINY_DIT.head_dim, TINY_DIT.hidden
    tensors = {}
    modules = {f"transformer_blocks.{i}.attn.to_{x}": (hidden, inner) for i in range(TINY_DIT.layers) for x in "qkv"}
    modules["transformer_blocks.0.attn.to_out.0"] = (inner, hidden)
    modules["token_refiner.refiner_blocks.0.attn.k_proj"] = (hidden, inner)
    for module, (fan_in, fan_out) in modules.items():
        tensors[f"{module}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.5
        tensors[f"{module}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.5
    save_file(tensors, str(path))


def test_turbo_loras_in_their_published_layouts_run_at_their_published_schedules(server):
    loras = server.models / "loras"
    loras.mkdir(exist_ok=True)
    comfyui_layout(loras / "tiny_fl2v_turbo_8step_comfyui.safetensors")
    peft_layout(loras / "tiny_ref2v_turbo_4step.safetensors")

    fl2v = host_sampling(generation(length=22, seed=5, prefix="H3/turbo_fl2v"), "81", "euler", "simple", 8)
    fl2v["81"]["inputs"].update(video_shift=12.0, audio_shift=3.0)
    fl2v = with_loras(fl2v, ("tiny_fl2v_turbo_8step_comfyui.safetensors", 1.0))
    fl2v["81"]["inputs"]["model"] = fl2v["7"]["inputs"]["model"]
    fl2v["7"]["inputs"]["model"] = ["1", 0]  # the same schedule without the LoRA, to compare
    fl2v["7"]["inputs"].update(sampler=["811", 0], sigmas=["812", 0])
    keep(fl2v, "7", "fl2v_plain")
    keep(fl2v, "81", "fl2v_turbo")
    keep(fl2v, "812", "simple_8")
    run(server, fl2v)
    torch.testing.assert_close(kept(server, "simple_8"), simple_schedule(8, 12.0))
    assert "tiny_fl2v_turbo_8step_comfyui.safetensors × 1 patches 10 weights" in server.log_tail(300)
    plain, turbo = kept(server, "fl2v_plain"), kept(server, "fl2v_turbo")
    assert torch.isfinite(turbo["samples"]).all() and not torch.allclose(turbo["samples"], plain["samples"])

    ref2v = with_references(generation("Ref2VA", length=22, seed=6, prefix="H3/turbo_ref2v"), audio="tone.wav")
    ref2v = host_sampling(ref2v, "81", "euler", "simple", 4)
    ref2v["7"] = ref2v.pop("81")
    ref2v = with_loras(ref2v, ("tiny_ref2v_turbo_4step.safetensors", 1.0))
    keep(ref2v, "7", "ref2v_turbo")
    run(server, ref2v)
    assert "tiny_ref2v_turbo_4step.safetensors × 1 patches 8 weights" in server.log_tail(300)
    assert torch.isfinite(kept(server, "ref2v_turbo")["samples"]).all()
