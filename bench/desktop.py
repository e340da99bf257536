"""The desktop envelope through a real ComfyUI server: the bundled T2VA workflow at the release size (345 frames,
1344×768, VDN-H3, 8 steps, the fp8 DiT) on this card with the host's budget narrowed by ``--reserve-vram`` so that
the pack sees a desktop card's memory, and the machine's host memory limited to a desktop's, each configuration
one new server (``end_to_end.serve``: the same files, workflow and stages as ``bench/end_to_end.py``).

A configuration is ``BUDGET:HOST``: the device budget in GiB (``none``: the whole card) and the host memory in GiB
(``0``: no limit). The host memory is limited by a cgroup v2 child of this process's cgroup (``memory.max``, swap
off) that this process joins before starting the server, so the server and everything it starts are counted, page
cache included; where no cgroup can be made (a read-only or controller-less hierarchy), by a ballast process that
takes and locks the rest of the machine's memory (``MemTotal`` less the limit). Each record says which, and the
memory available once the limit held.

Per run: completed or not (and the error), the stages of ``end_to_end.stages`` (total, sampling, decode, ...), torch's
device peak, the server's resident peak (``VmHWM``), the bytes the server read and those it made the kernel fetch
from storage during the run (page-cache misses), the DiT's placement (its memory plan, the streamed blocks and the
bytes copied to the device per evaluation: the PCIe traffic of a step, one evaluation a step).

``--estimate`` (with the uncapped run measured) adds an estimate for desktop cards: per card its memory plan for
its memory less a desktop's 1.5 GiB (``plan_for_memory`` on the card's speed from its published multiprocessors,
boost clock and PCIe generation, ``h3_core.memory.speed``); the sampling time scaled from the uncapped H100 run by
the ratio of the plans' predicted seconds, the rest of the run by the ratio of the bf16 tensor rates. Labelled an
estimate in the output: nothing was run on those cards.

Each record says whether its server found the compile cache empty (its first step then compiles: not a fair time
beside the others); ``--warm-up`` first runs the uncapped workflow in a server of its own where the cache is empty,
recorded apart (``warm_up``), so that every measured server finds it filled.

The files are ``bench/end_to_end.py --phase write``'s (run that first, same ``--base``). Results gather in
``--state`` across calls (one 10-minute call holds about three servers); ``--out`` writes the JSON and the same path
with ``.md``. ``--tiny``: a dry run on the CPU with the tiny checkpoints (budgets are then not applied).

    python3 bench/end_to_end.py --base /root/h3_e2e --phase write
    python3 bench/desktop.py --base /root/h3_e2e --configs none:0 24:64 16:32 --out bench/results/desktop.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
import end_to_end
import record

GiB = 2**30
WORKFLOW = "h3_t2va.json"
DESKTOP_RESERVED_GIB = 1.5  # a desktop's display and other programs' share of its card
# Desktop cards for the estimate: name, compute capability, multiprocessors, boost clock (Hz), memory (GiB), host
# copy rate (bytes/s: PCIe 4.0 x16 ~25 GB/s, 5.0 x16 ~50 GB/s of pinned copies), from the vendors' published
# specifications.
DESKTOP_CARDS = (
    ("NVIDIA GeForce RTX 4090", (8, 9), 128, 2.52e9, 24, 25e9),
    ("NVIDIA GeForce RTX 5090", (12, 0), 170, 2.41e9, 32, 50e9),
)


@dataclass(frozen=True)
class Config:
    budget_gib: float | None  # None: the whole card
    host_gib: float | None  # None: no limit

    @classmethod
    def parse(cls, text: str) -> "Config":
        try:
            budget, host = text.split(":")
            return cls(None if budget == "none" else float(budget), float(host) or None)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--configs: got {text!r}; allowed: BUDGET:HOST, e.g. 24:64 or none:0")

    @property
    def label(self) -> str:
        budget = "card" if self.budget_gib is None else f"{self.budget_gib:g}gib"
        host = "host" if self.host_gib is None else f"{self.host_gib:g}gib_host"
        return f"{budget}_{host}"


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes."""
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":")
        parts = value.split()
        fields[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return fields


BALLAST = """
import ctypes, mmap, sys
size = int(sys.argv[1])
region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for offset in range(0, size, mmap.PAGESIZE):
    region[offset] = 1
locked = ctypes.CDLL(None, use_errno=True).mlockall(1) == 0  # MCL_CURRENT
print("locked" if locked else "touched", flush=True)
sys.stdin.read()
"""


class HostMemoryLimit:
    """Limits the machine's memory for this process and what it starts afterwards to ``gib``: a cgroup v2 child
    joined by this process, else a ballast process holding the rest of the machine's memory."""

    def __init__(self, gib: float | None):
        self.gib, self.method, self.cgroup, self.ballast, self.previous = gib, "none", None, None, None

    def __enter__(self) -> "HostMemoryLimit":
        if self.gib is None:
            return self
        try:
            self._join_cgroup()
        except OSError as exc:
            self._cgroup_failed = f"{type(exc).__name__}: {exc}"
            self._take_ballast()
        return self

    def _join_cgroup(self) -> None:
        relative = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]  # v2's one line: 0::/path
        here = Path("/sys/fs/cgroup") / relative.lstrip("/")
        if "memory" not in (here / "cgroup.subtree_control").read_text().split():
            (here / "cgroup.subtree_control").write_text("+memory")
        group = here / f"h3_desktop_{os.getpid()}"
        group.mkdir()
        try:
            (group / "memory.max").write_text(str(int(self.gib * GiB)))
            if (group / "memory.swap.max").exists():
                (group / "memory.swap.max").write_text("0")
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            group.rmdir()
            raise
        self.cgroup, self.previous, self.method = group, here, f"cgroup v2 memory.max ({group})"

    def _take_ballast(self) -> None:
        total = meminfo()["MemTotal"]
        size = total - int(self.gib * GiB)
        if size <= 0:
            self.method = f"none: the machine has {total / GiB:.1f} GiB, not more than the limit"
            return
        self.ballast = subprocess.Popen(
            [sys.executable, "-c", BALLAST, str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        state = self.ballast.stdout.readline().strip()
        if not state:
            raise RuntimeError(f"the ballast process for {self.gib:g} GiB of host memory failed to start")
        self.method = (
            f"ballast process holding {size / GiB:.1f} GiB ({state}; no cgroup: {self._cgroup_failed}; swap "
            f"{meminfo().get('SwapTotal', 0) / GiB:.1f} GiB)"
        )

    def describe(self) -> dict:
        """The limit, how it is held, and the memory available under it (the cgroup's room, or the machine's)."""
        available = meminfo()["MemAvailable"]
        if self.cgroup is not None:
            used = int((self.cgroup / "memory.current").read_text())
            available = min(available, int(self.gib * GiB) - used)
        return dict(limit_gib=self.gib, method=self.method, available_gib=available / GiB)

    def __exit__(self, *exc) -> None:
        if self.cgroup is not None:
            (self.previous / "cgroup.procs").write_text(str(os.getpid()))
            try:
                self.cgroup.rmdir()
            except OSError:  # a process the server left behind still in it: the group goes when it does
                pass
        if self.ballast is not None:
            self.ballast.stdin.close()
            self.ballast.wait(timeout=60)


def compile_cache_empty(compile_cache: Path) -> bool:
    """Whether no compiled kernel is kept under ``compile_cache`` yet."""
    return not compile_cache.exists() or not any(path.is_file() for path in compile_cache.rglob("*"))


def run_config(config: Config, base: Path, compile_cache: Path, size: dict, timeout: float, seed: int) -> dict:
    server_args = ()
    setting = {"compile_cache_empty": compile_cache_empty(compile_cache)}  # what the server starts with
    if config.budget_gib is not None and size is not end_to_end.TINY:
        reserve = end_to_end.reserve_for_budget(config.budget_gib)
        server_args = ("--reserve-vram", f"{reserve:.3f}")
        setting["reserve_vram_gb"] = reserve
    with HostMemoryLimit(config.host_gib) as limit:
        host = limit.describe()
        try:
            served = end_to_end.serve(base, compile_cache, [("run", WORKFLOW, seed)], size, timeout, server_args)
        except Exception as exc:  # noqa: BLE001 - a run that fails is a result here
            return dict(config=config.__dict__, host=host, **setting, completed=False, error=f"{exc}"[-2000:])
    run = served["run"]
    peak = run.get("peak") or {}
    return dict(
        config=config.__dict__,
        host=host,
        **setting,
        completed=run.get("total_s") is not None,
        total_s=run.get("total_s"),
        sampling_s=run.get("sampling_s"),
        decode_s=run.get("decode_s"),
        device_peak_gib=peak.get("allocated_gib"),
        device_reserved_peak_gib=peak.get("reserved_gib"),
        server_rss_peak_gib=run.get("server_rss_peak_gib"),
        read_gib=run.get("read_gib"),
        storage_read_gib=run.get("storage_read_gib"),
        placement=peak.get("placement_said"),
        streamed_blocks=peak.get("streamed_blocks"),
        pcie_gib_per_step=peak.get("copied_gib_per_evaluation"),  # one evaluation a step
        stages=run,
        server_start_s=served.get("server_start_s"),
        pack_lines=served.get("pack_lines"),
    )


def estimate(uncapped: dict, tiny: bool) -> list[dict]:
    """Desktop cards' runs estimated from the uncapped H100 run (see the module's docstring)."""
    import torch

    from h3_core.memory.predict import BlockShape, ModelForm, plan_for_memory
    from h3_core.memory.speed import H100, CardSpeed
    from h3_core.models.dit import DiTConfig
    from h3_core.pipeline.geometry import audio_latents, latent_frames
    from h3_core.pipeline.packing import pack_sequence

    size = end_to_end.TINY if tiny else end_to_end.RELEASE
    cfg = DiTConfig(hybrid=True)
    packed = pack_sequence(
        torch.ones(size["text"], dtype=torch.long),
        latent_frames(size["length"]),
        size["height"] // 16,
        size["width"] // 16,
        audio_latents(size["length"]),
    )
    shape = BlockShape.of(cfg, packed, torch.bfloat16)

    def plan(speed, gib):
        form = ModelForm(cfg, hybrid=True, linears="fp8" if speed.fp8 else "dtype", fused=True)
        return plan_for_memory(form, shape, gib * GiB, steps=size["steps"], speed=speed)

    h100 = _predicted_seconds(plan(H100, 80 - DESKTOP_RESERVED_GIB), H100, cfg, shape, size)
    estimates = []
    for name, capability, sms, clock, memory, copy in DESKTOP_CARDS:
        speed = CardSpeed.of(name, capability, sms, clock, copy)
        chosen = plan(speed, memory - DESKTOP_RESERVED_GIB)
        card_seconds = _predicted_seconds(chosen, speed, cfg, shape, size)
        sampling = uncapped["sampling_s"] * card_seconds / h100
        rest = (uncapped["total_s"] - uncapped["sampling_s"]) * H100.bf16_ops_per_s / speed.bf16_ops_per_s
        estimates.append(
            dict(
                card=speed.describe(),
                memory_gib=memory,
                plan=list(chosen.steps),
                fits=chosen.fits,
                estimated_sampling_s=sampling,
                estimated_total_s=sampling + rest,
                basis="estimate, not a measurement: the uncapped H100 run scaled by predicted seconds per "
                "evaluation (sampling) and bf16 tensor rates (the rest)",
            )
        )
    return estimates


def _predicted_seconds(plan, speed, cfg, shape, size) -> float:
    from h3_core.memory.predict import ModelForm, predicted_seconds

    form = ModelForm(cfg, hybrid=True, linears="fp8" if speed.fp8 else "dtype", fused=True)
    return predicted_seconds(
        form, shape, speed, plan.options, plan.adaln_on_host, plan.resident_blocks, steps=size["steps"]
    )


def markdown(result: dict) -> str:
    lines = [
        "| configuration | completed | total s | sampling s | decode s | device peak GiB | host RSS peak GiB | "
        "storage read GiB | PCIe GiB/step | plan | host limit |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, run in result["runs"].items():
        cells = [
            label,
            "yes" if run.get("completed") else f"no: {run.get('error', '')[:120]}",
            *(end_to_end._cell(run.get(k)) for k in ("total_s", "sampling_s", "decode_s", "device_peak_gib")),
            *(end_to_end._cell(run.get(k)) for k in ("server_rss_peak_gib", "storage_read_gib", "pcie_gib_per_step")),
            "; ".join(run.get("placement") or []),
            run["host"]["method"],
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    for item in result.get("estimates", []):
        lines.append(
            f"\n{item['card']}: **estimate** {item['estimated_total_s']:.1f} s ({item['basis']}); plan: "
            + "; ".join(item["plan"])
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="bench/end_to_end.py's --base (its files)")
    parser.add_argument("--configs", nargs="*", type=Config.parse, default=[], help="BUDGET:HOST, e.g. 24:64")
    parser.add_argument("--state", type=Path, default=None, help="default: <base>/desktop_state.json")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--estimate", action="store_true", help="add the desktop cards' estimate")
    parser.add_argument(
        "--warm-up", action="store_true", help="fill an empty compile cache with an unrecorded uncapped server first"
    )
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoints on the CPU: a dry run")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    base = args.base.resolve()
    state_path = args.state or base / "desktop_state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {"runs": {}}
    size = end_to_end.TINY if args.tiny else end_to_end.RELEASE
    compile_cache = base / f"compile_cache_{end_to_end.environment()}"
    if args.warm_up and args.configs and compile_cache_empty(compile_cache):
        state["warm_up"] = run_config(Config(None, None), base, compile_cache, size, args.timeout, args.seed)
        print("warm-up", json.dumps({k: v for k, v in state["warm_up"].items() if k != "stages"}), flush=True)
        state_path.write_text(json.dumps(state, indent=1))
    for config in args.configs:
        started = time.perf_counter()
        state["runs"][config.label] = dict(
            run_config(config, base, compile_cache, size, args.timeout, args.seed),
            header=record.header("desktop.py", argv),
        )
        print(config.label, json.dumps({k: v for k, v in state["runs"][config.label].items() if k != "stages"}))
        print(f"{config.label}: {time.perf_counter() - started:.1f} s", flush=True)
        state_path.write_text(json.dumps(state, indent=1))
    uncapped = state["runs"].get(Config(None, None).label)
    if args.estimate:
        if not uncapped or not uncapped.get("completed"):
            parser.error("--estimate needs the uncapped run (none:0) measured first")
        state["estimates"] = estimate(uncapped, args.tiny)
        state_path.write_text(json.dumps(state, indent=1))
    if args.out is not None:
        record.write(state, args.out)
        args.out.with_suffix(".md").write_text(markdown(state))
    return state


if __name__ == "__main__":
    main()
