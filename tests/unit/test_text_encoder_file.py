"""ComfyUI's single-file Qwen3-VL text encoder (h3_core.formats.qwen3vl_checkpoint / qwen3vl_tokens /
text_encoder): it describes itself from its header, loads holding only what H3 reads, and gives the folder
path's states bit for bit; what is not such a file is refused before any weight is read.

The pair compared: one tiny random Qwen3-VL of Qwen3-VL-32B's family (``tiny_qwen3vl``), saved by transformers
as a Hugging Face folder with one layer more than H3 reads (as the release's 64 against 50), and written here in
ComfyUI's layout (renamed by this file's own rules, cut at the conditioning layer with no final norm and no
output head, as ComfyUI's qwen3vl_32b_minimax_h3 files are)."""

import copy
import hashlib
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_checkpoints import TINY_TEXT_WIDTH, tiny_qwen3vl, write_tiny_text_encoder_file

from h3_core.errors import H3InputError
from h3_core.formats.files import CheckpointFiles
from h3_core.formats.qwen3vl_checkpoint import (
    LAYOUTS,
    describe_text_encoder_file,
    describe_text_encoder_header,
    held_bytes,
    qwen3vl_header,
)
from h3_core.pipeline.presentation import PresentedReference
from h3_core.pipeline.qwen3vl_tokens import published_processors, qwen3vl_tokenizer
from h3_core.pipeline.text_encoder import load_text_encoder

transformers = pytest.importorskip("transformers")

LAYER = 3  # the tiny pair's conditioning layer; the folder holds LAYER + 1 decoder layers
# Qwen3's added tokens (ids from 151643) as its published tokenizer_config.json lists them (content, special);
# H3's tokenizer_config.json appends seven to additional_special_tokens (ComfyUI minimax.py MINIMAX_EXTRA_TOKENS).
QWEN3_DECODER = [
    ("<|endoftext|>", 1),
    ("<|im_start|>", 1),
    ("<|im_end|>", 1),
    ("<|object_ref_start|>", 1),
    ("<|object_ref_end|>", 1),
    ("<|box_start|>", 1),
    ("<|box_end|>", 1),
    ("<|quad_start|>", 1),
    ("<|quad_end|>", 1),
    ("<|vision_start|>", 1),
    ("<|vision_end|>", 1),
    ("<|vision_pad|>", 1),
    ("<|image_pad|>", 1),
    ("<|video_pad|>", 1),
    ("<tool_call>", 0),
    ("</tool_call>", 0),
    ("<|fim_prefix|>", 0),
    ("<|fim_middle|>", 0),
    ("<|fim_suffix|>", 0),
    ("<|fim_pad|>", 0),
    ("<|repo_name|>", 0),
    ("<|file_sep|>", 0),
    ("<tool_response>", 0),
    ("</tool_response>", 0),
    ("<think>", 0),
    ("</think>", 0),
]
H3_SPECIALS = [
    "<d>",
    "</d>",
    "<|cutoff|>",
    "<|lyrics_start|>",
    "<|lyrics_end|>",
    "<|caption_start|>",
    "<|caption_end|>",
]
# sha256 of the H3 release's processor/vocab.json and processor/merges.txt, as public pin lists of its files
# give them; the second equals the one Qwen2.5 / Qwen3 repositories publish for merges.txt less its
# "#version: 0.2" first line.
VOCAB_SHA256 = "ca10d7e9fb3ed18575dd1e277a2579c16d108e32f27439684afa0e10b1440910"
MERGES_SHA256 = "599bab54075088774b1733fde865d5bd747cbcc7a547c5bc12610e874e26f5e3"
# Qwen3-VL's preprocessor_config.json and video_preprocessor_config.json as published.
IMAGE_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
VIDEO_CONFIG = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "video_processor_type": "Qwen3VLVideoProcessor",
}
PROMPTS = [
    "a fox runs through snow",
    "<d>Hello there!</d> a man says, smiling. [English]",
    "<Picture 1>: ",
    "<Audio 2>: ",
    "<Video 1>: ",
    "<0.2 seconds>",
    "<12.8 seconds>",
    "<|vision_start|><|image_pad|><|video_pad|><|vision_end|>",
    "<think>\n\n</think>\n\n",
    "<|im_start|>user\nhi<|im_end|><|endoftext|>",
    "日本語の字幕、中文字幕 and émigrés — ünïcödé 🎬🦊",
    "  leading and   inner   spaces\n\nand\ttabs  ",
    "<tool_response>x</tool_response><|box_start|>",
]


def host_tokenizer_dir():
    from comfy_host import comfyui_root

    try:
        return comfyui_root() / "comfy" / "text_encoders" / "qwen25_tokenizer"
    except RuntimeError as exc:
        pytest.skip(str(exc))


def comfyui_state(model, layers: int) -> dict[str, torch.Tensor]:
    """``model``'s weights as ComfyUI's H3 file holds them: its Qwen3VL module's names (``model.*`` for the
    language model, ``visual.*`` for the tower), ``layers`` decoder layers, no final norm, no output head."""
    state = {}
    for key, value in model.state_dict().items():
        if key.startswith("model.language_model."):
            rest = key.removeprefix("model.language_model.")
            if rest == "norm.weight" or (rest.startswith("layers.") and int(rest.split(".")[1]) >= layers):
                continue
            state["model." + rest] = value
        elif key.startswith("model.visual."):
            state["visual." + key.removeprefix("model.visual.")] = value
    return state


def oracle_tokenizer_dir(root):
    """A tokenizer folder laid out as the H3 release's: Qwen's vocab.json and merges.txt (checked by hash) and a
    tokenizer_config.json with Qwen3's added tokens and H3's additional special tokens."""
    folder = root / "oracle_tokenizer"
    folder.mkdir()
    host = host_tokenizer_dir()
    shutil.copy(host / "vocab.json", folder / "vocab.json")
    lines = (host / "merges.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    (folder / "merges.txt").write_text(
        "".join(line for line in lines if not line.startswith("#version")), encoding="utf-8"
    )
    flags = dict(lstrip=False, normalized=False, rstrip=False, single_word=False)
    config = {
        "added_tokens_decoder": {
            str(151643 + i): dict(content=c, special=bool(s), **flags) for i, (c, s) in enumerate(QWEN3_DECODER)
        },
        "additional_special_tokens": [c for c, _ in QWEN3_DECODER[1:14]] + H3_SPECIALS,
        "add_prefix_space": False,
        "bos_token": None,
        "unk_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 262144,
        "tokenizer_class": "Qwen2Tokenizer",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3vl_file")
    model = tiny_qwen3vl(LAYER + 1)
    folder = root / "folder"
    model.save_pretrained(folder / "text_encoder")
    shutil.copytree(oracle_tokenizer_dir(root), folder / "tokenizer")
    (folder / "processor").mkdir()
    (folder / "processor" / "preprocessor_config.json").write_text(json.dumps(IMAGE_CONFIG))
    (folder / "processor" / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    file = root / "qwen3vl_tiny_comfyui.safetensors"
    save_file({k: v.contiguous() for k, v in comfyui_state(model, LAYER).items()}, str(file))
    return folder, file


def from_folder(folder, **kw):
    return load_text_encoder(folder, dtype=torch.float32, layer=LAYER, **kw)


def from_file(file, **kw):
    return load_text_encoder(file, tokenizer=host_tokenizer_dir(), dtype=torch.float32, layer=LAYER, **kw)


def pixels(*shape, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


REQUESTS = {
    "plain": dict(),
    "fl2va": dict(keyframes=[pixels(48, 80, 3, seed=1), pixels(48, 80, 3, seed=2)]),
    "ref2va": dict(
        references=[
            PresentedReference("video", pixels(30, 40, 64, 3, seed=3), has_audio=True),
            PresentedReference("image", pixels(32, 48, 3, seed=4)),
            PresentedReference("audio"),
        ]
    ),
}


@pytest.mark.parametrize("request_kind", list(REQUESTS))
def test_the_file_gives_the_folders_states(pair, request_kind):
    folder, file = pair
    prompt = "<d>Run!</d> a fox runs through snow"
    a = from_folder(folder).encode(prompt, **REQUESTS[request_kind])
    b = from_file(file).encode(prompt, **REQUESTS[request_kind])
    assert a.tags.tolist() == b.tags.tolist() and torch.equal(a.embeds, b.embeds)
    assert a.embeds.shape[1] == TINY_TEXT_WIDTH and torch.isfinite(a.embeds).all()
    if request_kind != "plain":
        assert 0 in a.tags.tolist()  # vision rows reached the model


def test_the_header_gives_the_folders_config(pair):
    folder, file = pair
    described = describe_text_encoder_file(file)
    saved = transformers.Qwen3VLConfig.from_pretrained(folder / "text_encoder")
    assert described.layout.name == "ComfyUI" and described.layers == LAYER and described.dtypes == ("BF16",)
    got, want = described.config.to_dict(), saved.to_dict()
    want["text_config"]["num_hidden_layers"] = LAYER
    for part in ("text_config", "vision_config"):
        for key in ("dtype", "architectures", "transformers_version"):
            got[part].pop(key, None), want[part].pop(key, None)
        assert got[part] == want[part], part
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert got[key] == want[key]
    one_file = describe_text_encoder_file(folder / "text_encoder" / "model.safetensors")  # transformers' names
    assert one_file.layout.name == "transformers" and one_file.layers == LAYER + 1


def _reads(monkeypatch):
    read = []
    real = CheckpointFiles.get
    monkeypatch.setattr(CheckpointFiles, "get", lambda self, key: read.append(key) or real(self, key))
    return read


def test_only_what_h3_reads_is_read_and_held(pair, monkeypatch):
    folder, file = pair
    read = _reads(monkeypatch)
    encoder = load_text_encoder(file, tokenizer=host_tokenizer_dir(), dtype=torch.bfloat16, layer=2)
    raw = file.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert sorted(read) == sorted(k for k in header if not k.startswith(("model.layers.2.",)))
    assert len(encoder.language_model.layers) == 2
    params = sum(p.numel() * p.element_size() for p in encoder.model.parameters())
    held = held_bytes(header, 2)
    assert held.held == params and held.held_tensors == len(read) and held.file == file.stat().st_size
    # the folder: no later layer, no final norm, no output head
    read.clear()
    from_folder(folder)
    names = set(load_file(str(folder / "text_encoder" / "model.safetensors")))
    later = {k for k in names if k.startswith(f"model.language_model.layers.{LAYER}.")}
    assert later and names - set(read) == {"lm_head.weight", "model.language_model.norm.weight"} | later
    with pytest.raises(RuntimeError, match="does not hold the final norm"):
        encoder.language_model.norm(torch.zeros(1, TINY_TEXT_WIDTH))


def test_placement_per_run(pair):
    folder, file = pair
    encoder = from_file(file, offload="auto", fits=lambda device, nbytes: False)
    layers = [sum(p.numel() * p.element_size() for p in block.parameters()) for block in encoder.language_model.layers]
    weights = sum(p.numel() * p.element_size() for p in encoder.model.parameters())
    tables = sum(b.numel() * b.element_size() for b in encoder.model.buffers())
    assert encoder.resident_bytes == weights + tables and encoder.layer_bytes == max(layers)
    assert encoder.streamed_bytes == weights + tables - sum(layers) + max(layers)
    assert encoder.streamed is None  # nothing placed at load
    first = encoder.encode("a fox runs")
    assert encoder.streamed and encoder.layer_visits == LAYER  # "auto" decided at the first encode
    again = encoder.place(stream=False).encode("a fox runs")
    assert not encoder.streamed and encoder.layer_visits == LAYER and torch.equal(first.embeds, again.embeds)
    assert encoder.to_host().encode("a fox runs").embeds.equal(first.embeds)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_placement_on_cuda_moves_what_it_says(pair, monkeypatch):
    folder, file = pair
    # fp32 on both devices: no TF32 in the vision tower's convolutions or the matmuls
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    want = from_file(file).encode("a fox runs", **REQUESTS["fl2va"])
    encoder = from_file(file, device="cuda")
    tensors = [*encoder.model.parameters(), *encoder.model.buffers()]
    assert all(t.device.type == "cpu" for t in tensors)  # the loader puts nothing on the device
    slack = 512 * len(tensors)  # the caching allocator rounds each tensor up to 512 bytes
    base = torch.cuda.memory_allocated()
    encoder.place(stream=False)
    assert 0 <= torch.cuda.memory_allocated() - base - encoder.resident_bytes < slack
    encoder.to_host()
    assert torch.cuda.memory_allocated() == base
    encoder.place(stream=True)
    assert 0 <= torch.cuda.memory_allocated() - base - encoder.kept_bytes < slack
    got = encoder.encode("a fox runs", **REQUESTS["fl2va"])
    assert all(p.device.type == "cpu" for p in encoder.language_model.layers.parameters())
    assert torch.allclose(got.embeds, want.embeds, atol=1e-5, rtol=1e-4)
    encoder.place(stream=False)
    assert torch.equal(encoder.encode("a fox runs", **REQUESTS["fl2va"]).embeds, got.embeds)  # streamed = resident
    # after encodes the allocator also holds cuBLAS's workspaces (32 MiB and more on Hopper), so the weights'
    # leaving is checked on the tensors themselves
    encoder.to_host()
    assert all(t.device.type == "cpu" for t in (*encoder.model.parameters(), *encoder.model.buffers()))
    assert encoder.encode("a fox runs").embeds.device.type == "cpu" and not encoder.streamed  # placed again


def test_refusals_name_the_file_and_read_no_weight(pair, tmp_path, monkeypatch):
    folder, file = pair
    read = _reads(monkeypatch)
    state = load_file(str(file))

    def written(name, tensors):
        path = tmp_path / name
        save_file(tensors, str(path))
        return path

    def refused(path, pattern):
        with pytest.raises(H3InputError, match=pattern):
            describe_text_encoder_file(path)
        with pytest.raises(H3InputError, match=pattern):
            load_text_encoder(path, tokenizer=host_tokenizer_dir(), layer=1)

    dit = written(
        "dit.safetensors", {"blocks.0.adaln_proj.linear.weight": torch.zeros(4, 2), "proj_in.weight": torch.zeros(2, 2)}
    )
    refused(
        dit,
        r"dit\.safetensors: not a Qwen3-VL text encoder: it looks like a diffusion model \(DiT\): 2 "
        r"tensors .*expected ComfyUI's Qwen3-VL-32B text encoder",
    )
    vae = written("vae.safetensors", {"decoder.conv.weight": torch.zeros(2), "encoder.conv.weight": torch.zeros(2)})
    refused(vae, r"vae\.safetensors: not a Qwen3-VL text encoder: it looks like a VAE")
    text_only = written("llm.safetensors", {k: v for k, v in state.items() if not k.startswith("visual.")})
    refused(text_only, r"llm\.safetensors: not a Qwen3-VL text encoder: it looks like a language model without")
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    refused(truncated, r"cut\.safetensors: truncated")
    gap = written("gap.safetensors", {k: v for k, v in state.items() if not k.startswith("model.layers.1.")})
    refused(gap, r"gap\.safetensors: decoder layers \[1\] are missing")
    short = written("short.safetensors", {k: v for k, v in state.items() if k != "visual.merger.norm.bias"})
    refused(
        short,
        r"short\.safetensors: not a complete Qwen3-VL text encoder in ComfyUI's layout: missing 1 "
        r"tensors, first \['visual.merger.norm.bias'\]",
    )
    wide = dict(state, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(65, TINY_TEXT_WIDTH)})
    refused(
        written("wide.safetensors", wide),
        r"1 of the wrong shape, first \['model.layers.0.mlp.up_proj.weight "
        r"\[65, 32\] \(expected \[64, 32\]\)'\]",
    )
    quantized = dict(
        state,
        **{
            "model.layers.0.mlp.up_proj.weight": torch.zeros(64, 32, dtype=torch.int8),
            "model.layers.0.mlp.up_proj.weight_scale": torch.ones(64, 1),
        },
    )
    refused(
        written("int8.safetensors", quantized),
        r"int8\.safetensors: a quantized Qwen3-VL text encoder \(I8 "
        r"weights\) is not supported; use the bf16 file",
    )
    other = {k: (v[:64] if k.endswith("q_norm.weight") else v) for k, v in state.items()}
    refused(written("q64.safetensors", other), r"not of Qwen3-VL-32B's family: head_dim 64 \(q_norm\) is not the 128")
    not_safetensors = tmp_path / "notes.safetensors"
    not_safetensors.write_bytes(b"\xff" * 64)
    refused(not_safetensors, r"notes\.safetensors: not a safetensors file")
    assert read == []
    with pytest.raises(H3InputError, match=r"conditioning layer 50 is outside the text model's 3 layers"):
        load_text_encoder(file, tokenizer=host_tokenizer_dir())
    with pytest.raises(H3InputError, match=r"a single-file text encoder holds no tokenizer; pass tokenizer="):
        load_text_encoder(file, layer=1)
    with pytest.raises(H3InputError, match=r"no vocab.json and merges.txt"):
        load_text_encoder(file, tokenizer=tmp_path, layer=1)
    assert read == []


def test_the_tiny_demo_file_loads_with_the_hosts_tokenizer(tmp_path):
    path = write_tiny_text_encoder_file(tmp_path, layers=4)
    assert path.parent.name == "text_encoders" and "RANDOM" in CheckpointFiles(path).metadata["h3_hybrid.note"]
    encoder = load_text_encoder(path, tokenizer=host_tokenizer_dir(), dtype=torch.float32, layer=4)
    embedding = encoder.encode("a fox runs", keyframes=[pixels(40, 64, 3)])
    assert embedding.embeds.shape[1] == TINY_TEXT_WIDTH and torch.isfinite(embedding.embeds).all()


# ---- the full-size file, from its header alone --------------------------------------------------


def comfyui_32b_header(layers: int = 50) -> dict:
    """Every tensor of ComfyUI's qwen3vl_32b_minimax_h3_bf16.safetensors with its shape, from its layout (module
    docstring of qwen3vl_checkpoint) and Qwen3-VL-32B's config: hidden 5120, MLP 25600, 64 heads and 8 KV heads
    of 128, vocabulary 151936; tower of 27 blocks of 1152 (MLP 4304), patch 16, temporal 2, merge 2, 2304
    positions, 3 deepstack mergers."""
    hidden, mlp, head, heads, kv, vocab = 5120, 25600, 128, 64, 8, 151936
    width, inner, depth, merged = 1152, 4304, 27, 1152 * 4
    shapes = {"model.embed_tokens.weight": [vocab, hidden]}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": [hidden],
                p + "post_attention_layernorm.weight": [hidden],
                p + "self_attn.q_proj.weight": [heads * head, hidden],
                p + "self_attn.k_proj.weight": [kv * head, hidden],
                p + "self_attn.v_proj.weight": [kv * head, hidden],
                p + "self_attn.o_proj.weight": [hidden, heads * head],
                p + "self_attn.q_norm.weight": [head],
                p + "self_attn.k_norm.weight": [head],
                p + "mlp.gate_proj.weight": [mlp, hidden],
                p + "mlp.up_proj.weight": [mlp, hidden],
                p + "mlp.down_proj.weight": [hidden, mlp],
            }
        )
    shapes.update(
        {
            "visual.patch_embed.proj.weight": [width, 3, 2, 16, 16],
            "visual.patch_embed.proj.bias": [width],
            "visual.pos_embed.weight": [2304, width],
        }
    )
    for j in range(depth):
        p = f"visual.blocks.{j}."
        shapes.update(
            {
                p + "norm1.weight": [width],
                p + "norm1.bias": [width],
                p + "norm2.weight": [width],
                p + "norm2.bias": [width],
                p + "attn.qkv.weight": [3 * width, width],
                p + "attn.qkv.bias": [3 * width],
                p + "attn.proj.weight": [width, width],
                p + "attn.proj.bias": [width],
                p + "mlp.linear_fc1.weight": [inner, width],
                p + "mlp.linear_fc1.bias": [inner],
                p + "mlp.linear_fc2.weight": [width, inner],
                p + "mlp.linear_fc2.bias": [width],
            }
        )
    for p, norm in [("visual.merger.", width)] + [(f"visual.deepstack_merger_list.{k}.", merged) for k in range(3)]:
        shapes.update(
            {
                p + "norm.weight": [norm],
                p + "norm.bias": [norm],
                p + "linear_fc1.weight": [merged, merged],
                p + "linear_fc1.bias": [merged],
                p + "linear_fc2.weight": [hidden, merged],
                p + "linear_fc2.bias": [hidden],
            }
        )
    return {k: {"dtype": "BF16", "shape": s} for k, s in shapes.items()}


def test_full_size_files_held_bytes_from_their_headers():
    header = comfyui_32b_header()
    assert len(header) == 902  # 50 layers of 11, the embeddings, the tower's 351
    layout, config, layers = describe_text_encoder_header(header, "qwen3vl_32b_minimax_h3_bf16.safetensors")
    text, vision = config.text_config, config.vision_config
    assert layout.name == "ComfyUI" and layers == 50
    assert (
        text.hidden_size,
        text.num_attention_heads,
        text.num_key_value_heads,
        text.head_dim,
        text.intermediate_size,
        text.vocab_size,
    ) == (5120, 64, 8, 128, 25600, 151936)
    assert (
        vision.depth,
        vision.hidden_size,
        vision.intermediate_size,
        vision.patch_size,
        vision.spatial_merge_size,
        vision.temporal_patch_size,
        vision.out_hidden_size,
    ) == (27, 1152, 4304, 16, 2, 2, 5120)
    built = qwen3vl_header(config, layout)
    assert {k: v["shape"] for k, v in built.items()} == {k: v["shape"] for k, v in header.items()}
    # independent count: bf16 bytes of one decoder layer, the embeddings, the tower
    layer = 2 * (2 * 5120 + 2 * 128 + 2 * 8192 * 5120 + 2 * 1024 * 5120 + 3 * 25600 * 5120)
    embeddings = 2 * 151936 * 5120
    block = 4 * 1152 + 3 * 1152 * 1152 + 3 * 1152 + 1152 * 1152 + 1152 + 2 * 4304 * 1152 + 4304 + 1152
    merger = 4608 * 4608 + 4608 + 5120 * 4608 + 5120
    tower = 2 * (1152 * 3 * 2 * 16 * 16 + 1152 + 2304 * 1152 + 27 * block + merger + 2 * 1152 + 3 * (merger + 2 * 4608))
    data = 50 * layer + embeddings + tower
    comfy = held_bytes(header, 50)
    text_json = len(json.dumps(header, separators=(",", ":")))
    assert comfy.held == data and comfy.file == 8 + math.ceil(text_json / 8) * 8 + data and comfy.saved < 2**20
    assert round(data / 2**30, 2) == 47.97  # the bf16 file's size as a public reading of it reports
    # the Hugging Face folder of Qwen3-VL-32B-Instruct: 64 layers, the final norm and the output head
    release_config = copy.deepcopy(config)
    release_config.text_config.num_hidden_layers = 64
    folder = qwen3vl_header(release_config, LAYOUTS[1])
    assert len(folder) == 1058
    total = 64 * layer + 2 * embeddings + 2 * 5120 + tower
    shards = 66_714_912_872  # the release's 14 text_encoder/ shards, headers included, as published
    assert 0 < shards - total < 14 * 16 * 2**10
    release = held_bytes(folder, 50, file_bytes=shards)
    assert release.held == data and release.saved == shards - data and release.held_tensors == 902


# ---- tokenizer and processors -------------------------------------------------------------------


def test_the_tokenizer_is_h3s_qwen3vl_tokenizer(tmp_path):
    """Checked against: transformers loading a tokenizer folder laid out as the H3 release's ``processor/``
    (whose vocab.json and merges.txt are the host's, by the pinned sha256 of the release's files; its
    tokenizer_config.json written here from Qwen3's published added_tokens_decoder and H3's seven
    additional_special_tokens, as ComfyUI's minimax.py and a public reading of H3's tokenizer_config.json give
    them, since the release's own file was not available). What is compared: every added token's id and special
    flag, the vocabulary size and the ids of prompts mixing labels, dialogue marks, chat and vision tokens,
    CJK, emoji and whitespace runs. Not compared: the BPE merge results on text beyond these prompts (they
    follow from identical vocab.json and merges.txt)."""
    host = host_tokenizer_dir()
    assert hashlib.sha256((host / "vocab.json").read_bytes()).hexdigest() == VOCAB_SHA256
    merges = "".join(
        line
        for line in (host / "merges.txt").read_text(encoding="utf-8").splitlines(keepends=True)
        if not line.startswith("#version")
    )
    assert hashlib.sha256(merges.encode("utf-8")).hexdigest() == MERGES_SHA256
    ours = qwen3vl_tokenizer(host)
    oracle = transformers.AutoTokenizer.from_pretrained(oracle_tokenizer_dir(tmp_path))
    assert len(ours) == len(oracle) == 151643 + len(QWEN3_DECODER) + len(H3_SPECIALS)
    for i, (content, special) in enumerate(QWEN3_DECODER + [(c, 1) for c in H3_SPECIALS]):
        assert ours.convert_tokens_to_ids(content) == oracle.convert_tokens_to_ids(content) == 151643 + i
        assert ours.added_tokens_decoder[151643 + i].special == oracle.added_tokens_decoder[151643 + i].special
        assert ours.added_tokens_decoder[151643 + i].special == bool(special)
    for prompt in PROMPTS:
        ids = ours(prompt, add_special_tokens=False).input_ids
        assert ids == oracle(prompt, add_special_tokens=False).input_ids, prompt
        assert ours.decode(ids) == prompt
    assert ours("<d>hi</d>", add_special_tokens=False).input_ids[0] == 151669  # one token, not '<d' '>'
    # the host's own files, read as ComfyUI reads them, agree on plain text
    hosts = transformers.Qwen2Tokenizer.from_pretrained(host)
    assert hosts(PROMPTS[0]).input_ids == ours(PROMPTS[0]).input_ids


def test_published_processors_equal_those_read_from_published_configs(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(IMAGE_CONFIG))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    image, video = published_processors()

    def settings(processor):  # transformers 4.57 also records the processor class it was read for
        return {k: v for k, v in processor.to_dict().items() if k != "_processor_class"}

    assert settings(image) == settings(transformers.AutoImageProcessor.from_pretrained(tmp_path))
    assert settings(video) == settings(transformers.AutoVideoProcessor.from_pretrained(tmp_path))
