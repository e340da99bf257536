"""A decoded clip's host frames on ordinary pages against huge pages (``h3_core.media.host_frames``): the seconds
to write them for the first time, as the decode does (one band of rows of one window at a time, from a
page-locked staging copy where CUDA runs, else from an ordinary tensor), and to free them, as the host does when it
drops a run's outputs. Release size by default: 345 frames of 1344×768, fp32 (the IMAGE output) and 8-bit (the
mp4's frames); each variant ``--reps`` times, in turn, the median reported.

    python3 bench/host_frames.py --out bench/results/host_frames.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

from h3_core.media.host_frames import empty_frames

VARIANTS = {"torch.empty": lambda shape, dtype: torch.empty(shape, dtype=dtype), "huge pages": empty_frames}


def fill_and_free(make, shape, dtype, band_frames: int, band_rows: int) -> dict:
    """Allocate with ``make``, write every value once band by band, free; the seconds of each."""
    staging = torch.full((band_frames, band_rows, *shape[2:]), 0.5, dtype=dtype)
    if torch.cuda.is_available():
        staging = staging.pin_memory()
    started = time.perf_counter()
    frames = make(shape, dtype)
    made = time.perf_counter()
    for f0 in range(0, shape[0], band_frames):
        for r0 in range(0, shape[1], band_rows):
            part = frames[f0 : f0 + band_frames, r0 : r0 + band_rows]
            part.copy_(staging[: part.shape[0], : part.shape[1]])
    written = time.perf_counter()
    del frames, part  # the last references: freed here
    freed = time.perf_counter()
    return dict(allocate_s=made - started, write_s=written - made, free_s=freed - written)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=345)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--width", type=int, default=1344)
    parser.add_argument("--band-frames", type=int, default=17, help="a decoder window's frames")
    parser.add_argument("--band-rows", type=int, default=192, help="a tile row's finished rows")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    hugepages = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    report = dict(
        record.header("host_frames.py", argv),
        cpus=torch.get_num_threads(),
        transparent_hugepage=hugepages.read_text().strip() if hugepages.exists() else None,
        rows=[],
    )
    shape = (args.frames, args.height, args.width, 3)
    for dtype in (torch.float32, torch.uint8):
        times = {name: [] for name in VARIANTS}
        for _ in range(args.reps):
            for name, make in VARIANTS.items():
                times[name].append(fill_and_free(make, shape, dtype, args.band_frames, args.band_rows))
        for name, runs in times.items():
            row = dict(
                dtype=str(dtype).removeprefix("torch."),
                variant=name,
                gib=dtype.itemsize * math.prod(shape) / 2**30,
                **{k: statistics.median(run[k] for run in runs) for k in runs[0]},
                runs=runs,
            )
            report["rows"].append(row)
            print({k: v for k, v in row.items() if k != "runs"}, flush=True)
    record.write(report, args.out)
    return report


if __name__ == "__main__":
    main()
