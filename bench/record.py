"""What every benchmark writes beside its numbers: the command that produced them, the machine and library
versions, the date; the JSON written to ``--out`` and printed; and the CUDA-event timing loop and the device
peak-memory reading they share; a call's profile by function."""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

GiB = 2**30


def header(script: str, argv) -> dict:
    """``command`` (as run from the repository root), ``device``, ``torch``, ``cuda``, ``cudnn``, ``python``
    and ``date`` (UTC)."""
    args = argv if argv is not None else sys.argv[1:]
    cuda = torch.cuda.is_available()
    return dict(
        command=f"python3 bench/{script} " + " ".join(str(a) for a in args),
        device=torch.cuda.get_device_name() if cuda else "cpu",
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if cuda else None,
        python=platform.python_version(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )


def write(result: dict, out: Path | None, indent: int = 1) -> str:
    """``result`` as JSON, written to ``out`` when given; returns the text."""
    text = json.dumps(result, indent=indent)
    if out:
        Path(out).write_text(text + "\n")
    return text


def finish(result: dict, out: Path | None, cuda: bool) -> dict:
    """A stage benchmark's end: the device's peak memory added (on a GPU), the JSON written and printed."""
    if cuda:
        result["peak_gib"] = torch.cuda.max_memory_allocated() / GiB
    print(write(result, out))
    return result


def event_times_ms(fn, reps: int, cuda: bool) -> list[float]:
    """Milliseconds of ``reps`` calls of ``fn``, each between two CUDA events on a GPU, by the wall clock on the
    CPU (where a benchmark only dry-runs its code)."""
    times = []
    for _ in range(reps):
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def peak_gib(fn, cuda: bool):
    """``fn()``'s result and the GiB of device memory it held at its peak above what was allocated before the
    call (None on the CPU)."""
    if not cuda:
        return fn(), None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - base) / GiB


def timer(cuda: bool, reps: int):
    """A function timing ``fn`` after one warm-up call: the median of ``reps`` ``event_times_ms``, in ms."""

    def run(fn) -> float:
        fn()
        if cuda:
            torch.cuda.synchronize()
        return round(statistics.median(event_times_ms(fn, reps, cuda)), 3)

    return run


def stage_arguments(description: str, argv, parts: tuple[str, ...] = ()):
    """The arguments of a stage-by-stage benchmark: ``--tiny`` (a dry run on the CPU), ``--reps``, ``--out``,
    with ``parts`` also ``--only NAME...`` (some of those parts; None for all); and whether it runs on CUDA."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    if parts:
        parser.add_argument("--only", nargs="+", default=None, choices=parts, help="run only these parts")
    args = parser.parse_args(argv)
    return args, torch.cuda.is_available() and not args.tiny


def profiled(fn, top: int):
    """``fn()``'s result, its wall seconds and the ``top`` functions by own time and by cumulative time
    (``cProfile``)."""
    profile = cProfile.Profile()
    start = time.perf_counter()
    result = profile.runcall(fn)
    seconds = time.perf_counter() - start
    stats = pstats.Stats(profile)

    def rows(key):
        entries = sorted(stats.stats.items(), key=lambda item: item[1][key], reverse=True)[:top]
        return [
            dict(function=f"{Path(file).name}:{line} {name}", calls=calls, own_s=own, cumulative_s=cumulative)
            for (file, line, name), (_, calls, own, cumulative, _) in entries
        ]

    return result, seconds, dict(by_own_time=rows(2), by_cumulative=rows(3))
