"""The text encoder holds only what H3 reads, in resident memory (``h3_core.pipeline.text_encoder``): a synthetic
bf16 file in ComfyUI's layout (a narrower Qwen3-VL of the family, 20 decoder layers) loaded in a fresh process for
conditioning layer 8 leaves the process smaller than holding all 20 by the 12 later layers' bytes that
``held_bytes`` predicts, measured after every held weight was read once (the weights are memory-mapped: a
tensor costs nothing until it is touched)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
LAYERS, LAYER = 20, 8

# In a fresh process, after the tokenizer was built once (the libraries' own first-use memory is not the
# encoder's): the rise of resident memory (VmRSS, RssAnon, RssFile, bytes) over loading for a layer and reading
# every held weight, the encoder's resident bytes and what ``held_bytes`` predicts from the file's header.
MEASURE = textwrap.dedent(
    """
    import json, sys
    import torch
    from h3_core.formats.qwen3vl_checkpoint import held_bytes
    from h3_core.pipeline.qwen3vl_tokens import qwen3vl_tokenizer
    from h3_core.pipeline.text_encoder import load_text_encoder
    from resident_memory import resident

    path, tokenizer, layer = sys.argv[1], sys.argv[2], int(sys.argv[3])
    qwen3vl_tokenizer(tokenizer)
    before = resident()
    encoder = load_text_encoder(path, tokenizer=tokenizer, dtype=torch.bfloat16, layer=layer)
    with torch.no_grad():
        finite = all(bool(torch.isfinite(p.sum())) for p in encoder.model.parameters())
    after = resident()
    with open(path, "rb") as fh:
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    held = held_bytes(header, layer)
    print(json.dumps(dict(rise={k: after[k] - before[k] for k in before}, held=held.held,
                          resident_bytes=encoder.resident_bytes, finite=finite)))
    """
)


def synthetic_file(path: Path) -> None:
    """A bf16 file in ComfyUI's layout: Qwen3-VL of width 1024 (8 heads, 2 KV heads of 128, MLP 2048), Qwen's
    vocabulary, ``LAYERS`` decoder layers and a 27-block vision tower of width 256, every weight 0.01."""
    from safetensors.torch import save_file
    from transformers import Qwen3VLConfig

    from h3_core.formats.qwen3vl_checkpoint import LAYOUTS, PUBLISHED, qwen3vl_header

    config = Qwen3VLConfig(
        text_config=dict(
            hidden_size=1024,
            intermediate_size=2048,
            num_hidden_layers=LAYERS,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            vocab_size=151936,
            **PUBLISHED["text"],
        ),
        vision_config=dict(
            out_hidden_size=1024,
            patch_size=16,
            temporal_patch_size=2,
            spatial_merge_size=2,
            depth=27,
            hidden_size=256,
            intermediate_size=512,
            num_position_embeddings=256,
            **PUBLISHED["vision"],
        ),
        **PUBLISHED["ids"],
    )
    header = qwen3vl_header(config, LAYOUTS[0])
    save_file({k: torch.full(v["shape"], 0.01, dtype=torch.bfloat16) for k, v in header.items()}, str(path))


def measure(path: Path, tokenizer: Path, layer: int) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), str(tokenizer), str(layer)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")])),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads resident memory from /proc")
def test_the_later_layers_never_become_resident(tmp_path):
    pytest.importorskip("transformers")
    from comfy_host import comfyui_root

    try:
        tokenizer = comfyui_root() / "comfy" / "text_encoders" / "qwen25_tokenizer"
    except RuntimeError as exc:
        pytest.skip(str(exc))
    path = tmp_path / "qwen3vl.safetensors"
    synthetic_file(path)
    held, every = measure(path, tokenizer, LAYER), measure(path, tokenizer, LAYERS)
    assert held["finite"] and every["finite"]
    tables = held["resident_bytes"] - held["held"]  # the rotary tables, computed at load
    assert 0 < tables == every["resident_bytes"] - every["held"]
    saved = every["held"] - held["held"]
    assert saved > 200 * 2**20  # the 12 later layers
    assert abs((every["rise"]["VmRSS"] - held["rise"]["VmRSS"]) - saved) < 0.1 * saved
    assert held["rise"]["RssFile"] >= held["held"]  # the held weights were all read once
