"""The video decode as H3 Decode & Save runs it, beside the decode bench's own call, in one process: where the
server's decode stage (``end_to_end.py``'s ``decode_s``) loses time against ``vae_decode.py``'s.

The steps of ``--plan`` run in order on one random-weight video VAE of the released shapes and one clip's latents
(345 frames at 1344×768):
  * ``bench``: ``decode_video`` alone, as ``vae_decode.py`` times it;
  * ``node``: ``decode_to_mp4`` into an ``Mp4Writer`` with a soundtrack, as the node runs it (each window's frames
    handed to the encoder's thread as 8-bit values), with a progress callback per tile and a cancel check;
  * ``heatN``: N seconds of bf16 matrix products first, as the sampling before a decode in the server.
Each decode reports its seconds to the last tile's progress and to its return, the encoder's tail, and the GPU's
SM clock and temperature just before it. ComfyUI sets ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``: run the
script once under it and once without to compare the allocators.

    python3 bench/decode_stage.py --plan bench node heat80 bench node --out results.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record
from vae_decode import random_video_vae

from h3_core.media.mp4 import Mp4Writer
from h3_core.media.tiling import DecodeHooks, decode_video
from h3_core.models.video_vae import VideoVAEConfig
from h3_core.pipeline.decode_to_mp4 import decode_to_mp4
from h3_core.pipeline.geometry import latent_frames

TINY_VAE = dict(decoder_layers=2, decoder_heads=2, decoder_head_dim=16, block_out_channels=(8,) * 6, norm_groups=4)


def gpu_state() -> dict:
    """The SM clock (MHz) and temperature (°C) nvidia-smi reports now; empty without it."""
    try:
        line = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,temperature.gpu", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.splitlines()[0]
        clock, temperature = (int(part) for part in line.split(","))
        return dict(sm_clock_mhz=clock, temperature_c=temperature)
    except Exception:
        return {}


def heat(seconds: float, device) -> None:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize(device)


def decode_once(kind: str, vae, latents, waveform, folder: Path) -> dict:
    last_tick = [0.0]
    ticks = [0]

    def progress(done, total):
        last_tick[0] = time.perf_counter()
        ticks[0] += 1

    state = gpu_state()
    cuda = latents.is_cuda
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    tail = None
    if kind == "bench":
        decode_video(vae, latents, hooks=DecodeHooks(progress=progress))
    else:
        height, width = (side * vae.cfg.spatial_ratio for side in latents.shape[-2:])
        writer = Mp4Writer(folder / f"{kind}_{start:.0f}.mp4", width, height, fps=24, waveform=waveform)
        hooks = DecodeHooks(progress=progress, check_cancel=lambda: None, report=print)
        clip = decode_to_mp4(vae, latents, writer, hooks=hooks)
        tail = clip.tail_s
    if cuda:
        torch.cuda.synchronize()
    end = time.perf_counter()
    return dict(
        kind=kind,
        to_last_progress_s=last_tick[0] - start,
        total_s=end - start,
        mp4_tail_s=tail,
        tiles=ticks[0],
        **state,
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", nargs="+", default=["bench", "node", "heat80", "bench", "node"])
    parser.add_argument("--frames", type=int, default=None, help="the clip's frames (default 345; 39 with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="a tiny VAE and clip on the CPU: a dry run of the code")
    parser.add_argument("--out", type=Path, default=None)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    for step in args.plan:
        if step not in ("bench", "node") and not (step.startswith("heat") and step[4:].replace(".", "", 1).isdigit()):
            parser.error(f"--plan: each step is bench, node or heatN (N seconds), got {step!r}")
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    cfg = VideoVAEConfig(**TINY_VAE) if args.tiny else VideoVAEConfig()
    vae = random_video_vae(device, torch.float16 if cuda else torch.float32, cfg)
    frames = args.frames or (39 if args.tiny else 345)
    count = latent_frames(frames)
    height, width = (6, 8) if args.tiny else (48, 84)
    latents = torch.randn(cfg.latent_channels, count, height, width, device=device)
    waveform = torch.rand(2, int(frames / 24 * 32000)) * 0.2 - 0.1
    decode_video(vae, latents[:, : min(count, 7), : height // 3])  # kernels, probes, compiled shapes
    result = dict(
        record.header("decode_stage.py", argv),
        alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        frames=frames,
        steps=[],
    )
    with tempfile.TemporaryDirectory() as folder:
        for step in args.plan:
            if step.startswith("heat"):
                if cuda:
                    heat(float(step[4:]), device)
                result["steps"].append(dict(kind=step, **gpu_state()))
            else:
                result["steps"].append(decode_once(step, vae, latents, waveform, Path(folder)))
            print(result["steps"][-1], flush=True)
    record.write(result, args.out)
    return result


if __name__ == "__main__":
    main()
