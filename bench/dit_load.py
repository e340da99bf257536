"""Where a DiT load's seconds go, as the nodes run it, and against the form it replaced: ``load_h3_model``
straight onto the device (H3 DiT Loader's form where the host loads diffusion models to the GPU: the files read
through pinned staging buffers, ``h3_core.formats.staged_read``) beside the earlier form, the load into host
memory then ``model.to(device)`` (the node's arguments otherwise: fp8 linears, bf16 compute, the run device
named), each under ``cProfile`` so the functions that take the time are listed beside the wall seconds. The
file's pages are read once first (the page cache filled, as for a restarted server), or dropped from the cache
with ``--cold``; filled, the pages are also read by 1, 4, 8 and 16 threads alone (the rate the machine allows a
loader).

``--phases`` times the straight load instead, without a profiler, per read-ahead variant (``--variants``
``threads:slabs:chunk_mib``, the staged reader's settings; the first is the loader's own): its wall seconds and,
by timers wrapped around the loader's steps, the checks of both files, the model built on the meta device, the
key plan, the keys outside the fp8 layers, the fp8 layers and the scales' check. Beside them the floor of the
same bytes: every range the load reads, read by the staged reader's threads into pinned slabs and copied to the
device, nothing else done.

    python3 bench/dit_load.py --dit /root/h3_e2e/models/diffusion_models/<dit>.safetensors \\
        [--branch <branch>.safetensors] --out bench/results/dit_load.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record
from lora_repatch import drop_page_cache

from h3_core.formats.checkpoints import load_h3_model


def fill_page_cache(path: Path, chunk: int = 1 << 26) -> float:
    """Read ``path`` once; returns the seconds it took."""
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        buffer = bytearray(chunk)
        while handle.readinto(buffer):
            pass
    return time.perf_counter() - start


def parallel_read_s(paths, threads: int, piece: int = 64 << 20) -> float:
    """Seconds to read ``paths`` (from the page cache when filled) with ``threads`` threads, each ``pread``-ing
    ``piece``-byte ranges into a buffer of its own: the rate the machine allows a loader, nothing else done."""
    import os
    import threading
    from concurrent.futures import ThreadPoolExecutor

    buffers = threading.local()

    def read(fd, offset):
        if not hasattr(buffers, "view"):
            buffers.view = memoryview(bytearray(piece))
        return os.preadv(fd, [buffers.view], offset)

    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            jobs = [pool.submit(read, fd, at) for fd, p in zip(fds, paths) for at in range(0, p.stat().st_size, piece)]
            for job in jobs:
                job.result()
        return time.perf_counter() - start
    finally:
        for fd in fds:
            os.close(fd)


class StepTimers:
    """Wall seconds per named step, each a function (module, attribute) replaced by a timed wrapper while the
    ``with`` block runs; a step that calls another counts both."""

    def __init__(self, steps: dict[str, tuple[object, str]]):
        self.steps, self.seconds, self._saved = steps, {}, []

    def __enter__(self):
        for name, (owner, attribute) in self.steps.items():
            original = getattr(owner, attribute)
            self._saved.append((owner, attribute, original))
            setattr(owner, attribute, self._timed(name, original))
        return self

    def _timed(self, name, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

        return timed

    def __exit__(self, *exc):
        for owner, attribute, original in reversed(self._saved):
            setattr(owner, attribute, original)


def load_steps() -> dict[str, tuple[object, str]]:
    from h3_core.formats import checkpoints, dit_layers
    from h3_core.models.dit import H3DiT

    return {
        "check_files_s": (checkpoints, "_describe_role"),
        "meta_model_s": (checkpoints, "meta_model"),
        "plan_s": (dit_layers, "_plan_keys"),
        "read_keys_s": (dit_layers, "_read_planned"),
        "assign_s": (H3DiT, "load_state_dict"),
        "fp8_layers_s": (dit_layers, "_fp8_layer"),
        "scales_check_s": (dit_layers, "_check_scales"),
    }


def staged_floor_s(spans, device) -> float:
    """Seconds to bring ``spans`` ((path, offset, bytes), the load's order) to ``device`` through the staged
    reader alone: every range asked for in order and copied into one device buffer per range."""
    from h3_core.formats.staged_read import StagedReader

    if not spans:  # a load to the CPU reads through no staged reader
        return None
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    with StagedReader(device) as reader:
        reader.expect(spans)
        for path, offset, count in spans:
            reader.read(path, offset, count, torch.uint8, (count,))
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def load_spans(dit: Path, branch: Path | None, device) -> list:
    """The ranges a straight load reads through its reader, in its order (``StagedReader.expect`` is told them)."""
    from h3_core.formats.staged_read import StagedReader

    told = []
    original = StagedReader.expect

    def keep(self, spans):
        told.extend(spans)
        return original(self, spans)

    StagedReader.expect = keep
    try:
        load_h3_model(dit, branch=branch, device=device, dtype=torch.bfloat16, linears="fp8", run_device=device)
    finally:
        StagedReader.expect = original
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return [(Path(p), o, n) for p, o, n in told]


def phases(args, device, files, result) -> dict:
    from h3_core.formats import staged_read

    defaults = (staged_read.READ_THREADS, staged_read.AHEAD_SLABS, staged_read.CHUNK_BYTES)
    for path in files:
        fill_page_cache(path)
    spans = load_spans(args.dit, args.branch, device)
    result["read_bytes"] = sum(n for _, _, n in spans)
    result["variants"] = {}
    for variant in args.variants:
        threads, slabs, chunk_mib = (int(v) for v in variant.split(":"))
        staged_read.READ_THREADS, staged_read.AHEAD_SLABS, staged_read.CHUNK_BYTES = threads, slabs, chunk_mib << 20
        runs = []
        try:
            for _ in range(args.reps):
                floor = staged_floor_s(spans, device)
                with StepTimers(load_steps()) as timers:
                    start = time.perf_counter()
                    model = load_h3_model(
                        args.dit,
                        branch=args.branch,
                        device=device,
                        dtype=torch.bfloat16,
                        linears="fp8",
                        run_device=device,
                    )
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    wall = time.perf_counter() - start
                del model
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                runs.append(dict(load_s=wall, floor_s=floor, **timers.seconds))
                print(
                    variant, json.dumps({k: v if v is None else round(v, 3) for k, v in runs[-1].items()}), flush=True
                )
        finally:
            staged_read.READ_THREADS, staged_read.AHEAD_SLABS, staged_read.CHUNK_BYTES = defaults
        result["variants"][variant] = runs
    return record.finish(result, args.out, device.type == "cuda")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dit", type=Path, required=True)
    parser.add_argument("--branch", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--cold", action="store_true", help="drop the files' pages from the page cache before each")
    parser.add_argument("--phases", action="store_true", help="the straight load's steps per read-ahead variant")
    parser.add_argument("--variants", nargs="+", default=["8:8:64"], help="threads:slabs:chunk_mib (--phases)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    files = [p for p in (args.dit, args.branch) if p is not None]
    result = record.header("dit_load.py", argv)
    result.update(files={str(p): p.stat().st_size for p in files}, cold=args.cold, runs=[])
    if args.phases:
        return phases(args, device, files, result)

    def load(to):
        return load_h3_model(
            args.dit, branch=args.branch, device=to, dtype=torch.bfloat16, linears="fp8", run_device=device
        )

    def synchronized(fn):
        def run():
            result = fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return result

        return run

    for _ in range(args.reps):
        if args.cold:
            for path in files:
                drop_page_cache(path)
        read_s = None if args.cold else sum(fill_page_cache(p) for p in files)
        threaded = {} if args.cold else {n: parallel_read_s(files, n) for n in (1, 4, 8, 16)}
        model, load_s, load_profile = record.profiled(lambda: load("cpu"), args.top)
        _, move_s, move_profile = record.profiled(synchronized(lambda: model.to(device)), args.top)
        weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        model = None  # freed before the next load
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.cold:
            for path in files:
                drop_page_cache(path)
        model, direct_s, direct_profile = record.profiled(synchronized(lambda: load(device)), args.top)
        model = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["runs"].append(
            dict(
                page_cache_read_s=read_s,
                page_cache_read_threads_s=threaded,
                load_s=load_s,
                to_device_s=move_s,
                host_then_device_s=load_s + move_s,
                direct_s=direct_s,
                weight_bytes=weights,
                load_gb_per_s=weights / load_s / 1e9,
                to_device_gb_per_s=weights / move_s / 1e9,
                direct_gb_per_s=weights / direct_s / 1e9,
                load_profile=load_profile,
                to_device_profile=move_profile,
                direct_profile=direct_profile,
            )
        )
        print(
            f"page cache read by 1/4/8/16 threads {[round(v, 2) for v in threaded.values()]} s; "
            f"host {load_s:.2f} s + to {device} {move_s:.2f} s = {load_s + move_s:.2f} s; "
            f"straight to {device} {direct_s:.2f} s ({weights / 1e9:.2f} GB)",
            flush=True,
        )
    return record.finish(result, args.out, device.type == "cuda")


if __name__ == "__main__":
    main()
