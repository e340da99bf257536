"""Host memory of the Qwen3-VL text encoder: what loading holds for conditioning layer 50, computed for the
full-size files from their headers alone, and measured on a synthetic file in ComfyUI's layout.

Computed (``held_bytes`` on headers built from Qwen3-VL-32B's shapes, nothing written): ComfyUI's
``qwen3vl_32b_minimax_h3_bf16.safetensors`` (50 layers, no final norm, no output head) and the Hugging Face
folder of Qwen3-VL-32B-Instruct (64 layers, the norm and the head).

Measured: a synthetic bf16 file of about ``--gib`` GiB in ComfyUI's layout, 64 layers of a narrower Qwen3-VL
of the same family, is loaded in a fresh process once for conditioning layer 50 and once holding all 64;
the process's resident memory rise is taken after every held weight has been read once (a memory-mapped
tensor costs nothing until touched), beside what ``held_bytes`` predicts.

    python3 bench/text_encoder_memory.py --gib 2 --out bench/results/text_encoder_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import record
from resident_memory import resident

from h3_core.formats.qwen3vl_checkpoint import LAYOUTS, PUBLISHED, held_bytes, qwen3vl_header

ROOT = Path(__file__).resolve().parents[1]
RELEASE_LAYERS, LAYER = 64, 50


def qwen3vl_config(hidden: int, intermediate: int, heads: int, kv_heads: int, layers: int, vision: dict):
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=128,
            vocab_size=151936,
            **PUBLISHED["text"],
        ),
        vision_config=dict(
            out_hidden_size=hidden,
            patch_size=16,
            temporal_patch_size=2,
            spatial_merge_size=2,
            **vision,
            **PUBLISHED["vision"],
        ),
        **PUBLISHED["ids"],
    )


def full_size() -> dict:
    """ComfyUI's bf16 file and the release folder, from Qwen3-VL-32B's shapes."""
    tower = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_position_embeddings=2304)
    out = {}
    for name, layout, layers in (
        ("comfyui_bf16_file", LAYOUTS[0], LAYER),
        ("huggingface_folder", LAYOUTS[1], RELEASE_LAYERS),
    ):
        header = qwen3vl_header(qwen3vl_config(5120, 25600, 64, 8, layers, tower), layout)
        held = held_bytes(header, LAYER)
        out[name] = {
            "tensors": held.tensors,
            "file_bytes": held.file,
            "held_bytes": held.held,
            "held_tensors": held.held_tensors,
            "saved_bytes": held.saved,
            "held_gib": held.held / 2**30,
            "file_gib": held.file / 2**30,
        }
    return out


def synthetic_config(gib: float):
    """64 layers of width 1024 (8 heads, 2 KV heads of 128) with the MLP width that makes about ``gib`` GiB."""
    hidden, heads, kv = 1024, 8, 2
    attention = 2 * hidden * heads * 128 + 2 * hidden * kv * 128
    per_layer = (gib * 2**30 - 2 * 151936 * hidden) / RELEASE_LAYERS / 2
    intermediate = max(128, round((per_layer - attention) / (3 * hidden) / 128) * 128)
    tower = dict(depth=27, hidden_size=256, intermediate_size=512, num_position_embeddings=256)
    return qwen3vl_config(hidden, intermediate, heads, kv, RELEASE_LAYERS, tower)


def write(path: Path, config) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    header = qwen3vl_header(config, LAYOUTS[0])
    state = {k: (torch.randn(v["shape"], generator=g) * 0.02).to(torch.bfloat16) for k, v in header.items()}
    tmp = path.with_suffix(".partial")
    save_file(state, str(tmp))
    os.replace(tmp, path)


def measure(path: Path, tokenizer: Path, layer: int) -> dict:
    """In this process: the rise of resident memory over loading for ``layer`` and touching every weight."""
    from h3_core.pipeline.qwen3vl_tokens import qwen3vl_tokenizer
    from h3_core.pipeline.text_encoder import load_text_encoder

    qwen3vl_tokenizer(tokenizer)  # the libraries' own first-use memory is not the encoder's
    before = resident()
    encoder = load_text_encoder(path, tokenizer=tokenizer, dtype=torch.bfloat16, layer=layer)
    with torch.no_grad():
        checksum = sum(float(p.double().sum()) for p in encoder.model.parameters())
    after = resident()
    with open(path, "rb") as fh:
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    held = held_bytes(header, layer, file_bytes=path.stat().st_size)
    return {
        "layer": layer,
        "held_bytes_predicted": held.held,
        "resident_bytes": encoder.resident_bytes,
        "rise": {k: after[k] - before[k] for k in before},
        "checksum_finite": checksum == checksum,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--file", type=Path, default=None, help="where the synthetic file lives")
    parser.add_argument("--tokenizer", type=Path, default=None, help="Qwen's BPE folder (default: the host's)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--measure-layer", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    host = Path(os.environ.get("COMFYUI_PATH") or ROOT / ".host" / "comfyui-0.3.75")
    tokenizer = args.tokenizer or host / "comfy" / "text_encoders" / "qwen25_tokenizer"
    config = synthetic_config(args.gib)
    path = args.file or Path(f"/tmp/h3_synthetic_qwen3vl_{args.gib:g}gib.safetensors")
    if args.measure_layer is not None:
        print(json.dumps(measure(path, tokenizer, args.measure_layer)))
        return {}
    if not path.exists():
        write(path, config)
    layers = config.text_config.num_hidden_layers
    runs = {}
    for name, layer in (("held_layers", LAYER), ("all_layers", layers)):
        command = [
            sys.executable,
            __file__,
            "--gib",
            str(args.gib),
            "--file",
            str(path),
            "--tokenizer",
            str(tokenizer),
            "--measure-layer",
            str(layer),
        ]
        run = subprocess.run(command, check=True, capture_output=True, text=True)
        runs[name] = json.loads(run.stdout.strip().splitlines()[-1])
    held, every = runs["held_layers"], runs["all_layers"]
    result = {
        "full_size": full_size(),
        "synthetic": {
            "file_bytes": path.stat().st_size,
            "layers": layers,
            "hidden": config.text_config.hidden_size,
            **runs,
            "rise_saved_bytes": every["rise"]["VmRSS"] - held["rise"]["VmRSS"],
            "predicted_saved_bytes": every["held_bytes_predicted"] - held["held_bytes_predicted"],
        },
        **record.header("text_encoder_memory.py", argv),
        "device": "cpu (host memory)",
        "cpus": os.cpu_count(),
    }
    print(record.write(result, args.out, indent=2))
    return result


if __name__ == "__main__":
    main()
