"""What a process's first Triton launch costs, and what the server's start thread takes off the first step
(``triton_forms.launch_once``): ``--processes`` new processes one after the other share one Triton cache folder
(the first fills it); each times importing torch and Triton, ``launch_once`` (the process's first launch), a
second kernel of its own, the same kernel at another block size (a new specialisation) and a launch again.

    python3 bench/first_launch.py --processes 3 --out bench/results/first_launch.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import record

ONE_PROCESS = """
import json, sys, time
start = time.perf_counter()
import torch, triton, triton.language as tl
imported = time.perf_counter()
sys.path.insert(0, {root!r})
from h3_core.triton_forms import launch_once

@triton.jit
def _twice(x, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + offsets, tl.load(x + offsets, mask=offsets < n) * 2, mask=offsets < n)

device = torch.device({device!r})
x = torch.ones(1000, device=device)

def timed(fn):
    begin = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - begin

context = timed(lambda: torch.zeros(1, device=device))
first = launch_once(device)
second = timed(lambda: _twice[(8,)](x, 1000, BLOCK=128))
other = timed(lambda: _twice[(4,)](x, 1000, BLOCK=256))
again = timed(lambda: _twice[(8,)](x, 1000, BLOCK=128))
print(json.dumps(dict(import_s=imported - start, device_context_s=context, first_launch_s=first,
                      second_kernel_s=second, new_specialisation_s=other, launch_again_s=again)))
"""


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result = record.header("first_launch.py", argv)
    runs = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        script = Path(cache) / "one_process.py"  # a file: Triton's JIT reads a kernel's source from it
        script.write_text(ONE_PROCESS.format(root=str(ROOT), device=args.device))
        for _ in range(args.processes):
            done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(runs[-1], flush=True)
    result.update(triton=_triton_version(), runs=runs, note="the first process fills the Triton cache")
    return record.finish(result, args.out, False)


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    main()
