"""Host memory of loading a DiT checkpoint: how far the process's resident memory rises, as a multiple of
the file's size, while ``load_h3_model`` runs and after every parameter has been read once (a lazily mapped
tensor costs nothing until it is touched, so the touch is what makes the number honest).

Writes a synthetic checkpoint of about ``--gib`` GiB (H3's layout, bf16 with the fp32 islands, smaller
sizes) unless it exists, then measures in a fresh process so nothing from the writing is counted.

    python3 bench/checkpoint_memory.py --gib 2 --out result.json
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
from resident_memory import peak_while, resident

from h3_core.formats.checkpoints import load_h3_model
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.models.precision import keeps_fp32


def config(gib: float) -> DiTConfig:
    per_layer = 2 * (4 * 1024 * 1024 + 3 * 1024 * 4096 + 6 * 512 * 1024 * 3)  # attn, mlp, adaln, bf16 bytes
    return DiTConfig(
        hidden=1024,
        layers=max(1, round(gib * 2**30 / per_layer)),
        heads=8,
        head_dim=128,
        ffn=4096,
        text_dim=1024,
        freq_dim=256,
        time_hidden=1024,
        time_embed=512,
        rope_freqs=16,
    )


def write(path: Path, cfg: DiTConfig) -> None:
    from safetensors.torch import save_file

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in H3DiT(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    state = {
        k: torch.randn(s, generator=g).to(torch.float32 if keeps_fp32(k) else torch.bfloat16) for k, s in shapes.items()
    }
    tmp = path.with_suffix(".partial")
    save_file(state, str(tmp))
    os.replace(tmp, path)


def measure(path: Path, cfg: DiTConfig) -> dict:
    """In this process: the peak and final rise of resident memory over loading and touching every weight."""

    def load_and_touch():
        model = load_h3_model(path, cfg=cfg, dtype=torch.bfloat16)
        with torch.no_grad():
            return model, sum(float(p.double().sum()) for p in model.parameters())

    (model, checksum), before, peak = peak_while(load_and_touch)  # the model held while "after" is read
    after = resident()
    size = path.stat().st_size
    return {
        "file_bytes": size,
        "peak_rise_x_file": {k: (peak[k] - before[k]) / size for k in peak},  # VmRSS: the high-water mark
        "final_rise_x_file": {k: (after[k] - before[k]) / size for k in before},
        "checksum_finite": checksum == checksum,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--file", type=Path, default=None, help="where the synthetic checkpoint lives")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cfg = config(args.gib)
    path = args.file or Path(f"/tmp/h3_synthetic_dit_{args.gib:g}gib.safetensors")
    if args.measure_only:
        result = measure(path, cfg)
    else:
        if not path.exists():
            write(path, cfg)
        run = subprocess.run(
            [sys.executable, __file__, "--gib", str(args.gib), "--file", str(path), "--measure-only"],
            check=True,
            capture_output=True,
            text=True,
        )
        result = json.loads(run.stdout)
        result.update(record.header("checkpoint_memory.py", argv), device="cpu (host memory)", cpus=os.cpu_count())
    text = record.write(result, args.out, indent=2)
    print(text)
    return result


if __name__ == "__main__":
    main()
