"""The text encoders users have, through a real ComfyUI server: ComfyUI's single file (its key layout, no
tokenizer of its own: the host's Qwen tokenizer files) beside a Hugging Face folder, chosen in one dropdown,
checked from its header when the prompt is queued, and held by the host as the text encoder."""

import json

from comfy_host import error_message, mp4_files
from graphs import TINY_VIDEO_VAE, generation
from tiny_checkpoints import TINY_TEXT_ENCODER_FILE


def test_comfyuis_single_text_encoder_file_encodes_the_prompt(server):
    choices = server.object_info()["H3TextEncoderLoader"]["input"]["required"]["text_encoder_name"][1]["options"]
    assert TINY_TEXT_ENCODER_FILE in choices and "h3_tiny_random_qwen3vl" in choices
    prompt = generation(length=22, prefix="H3/text_encoder_file")
    prompt["4"]["inputs"]["text_encoder_name"] = TINY_TEXT_ENCODER_FILE
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    assert f"loaded {TINY_TEXT_ENCODER_FILE} into host memory: Qwen3-VL" in server.log_tail(300)
    assert len(mp4_files(entry, server.output)) == 1


def test_a_vae_picked_as_the_text_encoder_is_refused_when_queued(server):
    (server.models / "text_encoders" / "picked_by_mistake.safetensors").write_bytes(
        (server.models / "vae" / TINY_VIDEO_VAE).read_bytes()
    )
    prompt = generation(length=22, prefix="H3/te_mistake")
    prompt["4"]["inputs"]["text_encoder_name"] = "picked_by_mistake.safetensors"
    answer = server.queue(prompt)
    assert "prompt_id" not in answer
    errors = json.dumps(answer["node_errors"])
    assert (
        "text_encoder_name: 'picked_by_mistake.safetensors' is the H3 video VAE, not a Qwen3-VL text encoder" in errors
    ), errors
