"""The video decode alone against the same decode streamed into an mp4 as H3 Decode & Save runs it
(``decode_to_mp4``: each window's frames handed to the encoder's thread as they are final), and with the frames
handed over as floats (converted on the host by the worker) instead of the 8-bit values made on the GPU. Random
release-size decoder weights (``vae_decode.random_video_vae``); the variants alternate, each run ``--reps``
times after a warm-up, so a difference between them is not the machine's drift.

    python3 bench/decode_streaming.py --frames 345 --reps 2 --out bench/results/decode_streaming.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record
from vae_decode import random_video_vae

from h3_core.media.mp4 import Mp4Worker, Mp4Writer
from h3_core.media.tiling import DecodeHooks, decode_video

VARIANTS = ("decode", "mp4-uint8", "mp4-float")


def run(variant: str, vae, z, folder: Path) -> dict:
    """One decode of ``z`` as ``variant`` says: seconds to the decode's end, and the mp4's tail after it."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    if variant == "decode":
        decode_video(vae, z)
        return dict(decode_s=time.perf_counter() - started, tail_s=0.0)
    height, width = z.shape[-2] * 16, z.shape[-1] * 16
    writer = Mp4Writer(folder / f"{variant}.mp4", width, height, fps=24)
    with Mp4Worker(writer) as worker:
        hooks = DecodeHooks(on_frames=lambda start, ready: worker.put(ready), uint8_frames=variant == "mp4-uint8")
        decode_video(vae, z, hooks=hooks)
        decoded = time.perf_counter()
        worker.close()
    return dict(decode_s=decoded - started, tail_s=worker.tail_s, frames_behind=worker.frames_behind)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=345)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_streaming.py times the decode on a GPU: run it where CUDA is available")
    device = torch.device("cuda")
    result = dict(record.header("decode_streaming.py", argv), frames=args.frames, runs=[])
    vae = random_video_vae(device)
    latents = (args.frames - 5) // 17 * 5 + 2
    z = torch.randn(24, latents, 48, 84, device=device)
    decode_video(vae, z[:, :7, :16])  # warm-up: the kernels built or read from their cache
    with tempfile.TemporaryDirectory() as folder:
        for rep in range(args.reps):
            for variant in args.variants:
                row = dict(variant=variant, rep=rep, **run(variant, vae, z, Path(folder)))
                result["runs"].append(row)
                print(row, flush=True)
                record.write(result, args.out)
    return result


if __name__ == "__main__":
    main()
