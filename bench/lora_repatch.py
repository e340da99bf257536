"""What a LoRA strength change costs against a fresh load of the DiT, as the nodes run them: the H3 DiT Loader's
``load_h3_model`` into host memory, the pack's ``H3DiTPatcher`` (the host's ModelPatcher) with the LoRA node's
patches, and the host's ``load_models_gpu`` putting the patched model on the GPU.

* fresh load: the file's pages dropped from the page cache first (``posix_fadvise(DONTNEED)``), then the loader and
  the first load to the GPU with the LoRA at one strength;
* strength change: a clone with the LoRA at another strength loaded by the host (the patched weights taken off and
  computed again from the base weights; nothing read from the file); median of ``--reps``;
* the base model again (every patch taken off).

``--write`` first writes a release-size random checkpoint at ``--dit`` in the layout users have for fp8 — ComfyUI's
pruned fp8-scaled single file (per-layer e4m3 codes with ``weight_scale``, ``input_scale`` and ``comfy_quant``; the
AdaLN curve table) — labelled random in its metadata, and a rank-``--rank`` LoRA on every block's qkv, output and
FFN projections. Needs the host (ComfyUI) importable: ``--host`` names its folder.

    python3 bench/lora_repatch.py --dit /tmp/h3_fp8.safetensors --write --out bench/results/lora_repatch.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

from h3_core.formats.sizes import sizes_metadata
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.models.fp8_linear import FP8_LAYERS
from h3_core.models.precision import keeps_fp32

NOTE = "H3 Hybrid benchmark RANDOM weights: not a trained model"
# The AdaLN curve of the pruned form: a table this many rows long (its size hardly counts), 8 wide as published.
CURVE_GRID, CURVE_WIDTH = 1001, 8
SIDECAR = list(json.dumps({"format": "float8_e4m3fn"}).encode())


def release_config(layers: int | None = None) -> DiTConfig:
    cfg = replace(DiTConfig(), adaln_curve_grid=CURVE_GRID, time_embed=CURVE_WIDTH)
    return cfg if layers is None else replace(cfg, layers=layers)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only dry-runs the script (--layers 1)


def write_checkpoint(path: Path, cfg: DiTConfig) -> int:
    """The pruned fp8-scaled file, every tensor random, written whole (the host memory holds it once)."""
    from safetensors.torch import save_file

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in H3DiT(cfg).state_dict().items()}
    fp8 = {f"{name}.weight" for name in FP8_LAYERS}
    g = torch.Generator(device=DEVICE).manual_seed(0)
    state = {}
    for key, shape in shapes.items():
        value = torch.randn(shape, generator=g, device=DEVICE) * 0.02
        if any(key.endswith(suffix) for suffix in fp8) and ".adaln_proj." not in key:
            layer = key.removesuffix(".weight")
            scale = value.abs().amax() / 448
            state[key] = (value / scale).to(torch.float8_e4m3fn).cpu()
            state[f"{layer}.weight_scale"] = scale.float().cpu()
            state[f"{layer}.input_scale"] = torch.tensor(1.0)
            state[f"{layer}.comfy_quant"] = torch.tensor(SIDECAR, dtype=torch.uint8)
        else:
            state[key] = value.to(torch.float32 if keeps_fp32(key, curve=True) else torch.bfloat16).cpu()
    partial = path.with_name(path.name + ".partial")
    save_file(state, str(partial), metadata=sizes_metadata(cfg, NOTE))
    os.replace(partial, path)
    return path.stat().st_size


def write_lora(path: Path, cfg: DiTConfig, rank: int) -> int:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    inner = cfg.heads * cfg.head_dim
    shapes = {
        "attn.qkv_proj": (cfg.hidden, 3 * inner),
        "attn.out_proj": (inner, cfg.hidden),
        "mlp.fc1": (cfg.hidden, 2 * cfg.ffn),
        "mlp.fc2": (cfg.ffn, cfg.hidden),
    }
    tensors = {}
    for block in range(cfg.layers):
        for module, (fan_in, fan_out) in shapes.items():
            stem = f"diffusion_model.blocks.{block}.{module}"
            tensors[f"{stem}.lora_down.weight"] = (torch.randn(rank, fan_in, generator=g) * 0.01).to(torch.bfloat16)
            tensors[f"{stem}.lora_up.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.01).to(torch.bfloat16)
            tensors[f"{stem}.alpha"] = torch.tensor(float(rank))
    save_file(tensors, str(path))
    return len(tensors) // 3


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dit", type=Path, required=True)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--layers", type=int, help="fewer blocks than released (a dry run)")
    parser.add_argument("--host", type=Path, default=ROOT / ".host" / "comfyui-0.3.75")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result = record.header("lora_repatch.py", argv)

    sys.path.insert(0, str(args.host))
    import comfy.options

    comfy.options.enable_args_parsing(False)
    from comfy.cli_args import args as host_args

    host_args.cpu = DEVICE == "cpu"
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "h3_hybrid", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
    )
    pack = importlib.util.module_from_spec(spec)
    sys.modules["h3_hybrid"] = pack
    spec.loader.exec_module(pack)
    import comfy.model_management as mm
    from h3_hybrid.nodes.lora import host_patches
    from h3_hybrid.nodes.patchers import DiTRun, H3DiTPatcher

    from h3_core.formats.checkpoints import load_h3_model
    from h3_core.formats.lora import lora_patches, read_lora
    from h3_core.pipeline.packing import pack_sequence

    cfg = release_config(args.layers)
    lora = args.dit.with_name(args.dit.stem + "_lora.safetensors")
    if args.write or not args.dit.is_file():
        t0 = time.perf_counter()
        result["file_bytes"] = write_checkpoint(args.dit, cfg)
        result["lora_modules"] = write_lora(lora, cfg, args.rank)
        result["write_s"] = time.perf_counter() - t0
    result["file_bytes"] = args.dit.stat().st_size
    run = DiTRun(pack_sequence(torch.ones(64, dtype=torch.long), 2, 24, 42, 40), "auto", 8)

    def synchronize():
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    def load(patcher) -> float:
        synchronize()
        t0 = time.perf_counter()
        patcher.fit(run)
        synchronize()
        return time.perf_counter() - t0

    drop_page_cache(args.dit)
    t0 = time.perf_counter()
    model = load_h3_model(args.dit, device="cpu", dtype=torch.bfloat16, linears="fp8", run_device=mm.get_torch_device())
    loaded = time.perf_counter() - t0
    base = H3DiTPatcher.wrap(model, "auto")
    patches = host_patches(lora_patches(model, read_lora(lora, 1.0)))

    def with_strength(strength):
        clone = base.clone()
        clone.add_patches(patches, strength_patch=strength)
        return clone

    first = load(with_strength(1.0))
    result["fresh_load_s"] = {
        "read_into_host_memory": loaded,
        "patched_and_loaded_to_gpu": first,
        "total": loaded + first,
    }
    changes = [load(with_strength(s)) for s in [0.5, 1.0, 0.75, 0.25][: args.reps]]
    result["strength_change_s"] = {"each": changes, "median": statistics.median(changes)}
    result["base_again_s"] = load(base)
    result["patched_weights"] = len(patches)
    keys = {key if isinstance(key, str) else key[0] for key in patches}
    result["patched_bytes"] = sum(model.get_parameter(k).numel() * model.get_parameter(k).element_size() for k in keys)
    result["ratio_change_to_fresh"] = result["strength_change_s"]["median"] / result["fresh_load_s"]["total"]
    if DEVICE == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    result["lora_rank"] = args.rank
    print(record.write(result, args.out))
    return result


if __name__ == "__main__":
    main()
