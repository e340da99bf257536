"""Every full (generation 2) garbage collection of a Python process, timed: imported at start-up by any process
with this folder first on ``PYTHONPATH`` (``bench/h200_host.sh`` with ``E2E_GC=1`` puts it there for the
ComfyUI servers). One JSON line per collection is appended to ``$H3_GC_LOG``: the process, its wall-clock time,
the seconds the collection held the interpreter and what it freed; for the first three collections longer than
``$H3_GC_DETAIL_S`` seconds (default 0.05) in each process, also how many objects the collector tracks, by
type and by the top-level package that defines each object's type (and, for functions and classes, the package
they were defined in)."""

import collections
import gc
import json
import os
import sys
import time

_LOG = os.environ.get("H3_GC_LOG")
_DETAIL_S = float(os.environ.get("H3_GC_DETAIL_S", "0.05"))
_started = [0.0]
_detailed = [0]


def _package(obj) -> str:
    module = getattr(obj, "__module__", None) if isinstance(obj, (type, type(_package))) else None
    if not isinstance(module, str):
        module = type(obj).__module__
    return module.split(".")[0]


def _record(phase: str, info: dict) -> None:
    if info.get("generation") != 2:
        return
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    line = {
        "pid": os.getpid(),
        "argv": " ".join(sys.argv[:2]),
        "wall": time.time(),
        "seconds": time.perf_counter() - _started[0],
        "collected": info.get("collected"),
    }
    if line["seconds"] > _DETAIL_S and _detailed[0] < 3:
        _detailed[0] += 1
        tracked = gc.get_objects()
        line["tracked"] = len(tracked)
        line["by_type"] = collections.Counter(type(o).__qualname__ for o in tracked).most_common(25)
        line["by_package"] = collections.Counter(_package(o) for o in tracked).most_common(25)
        del tracked
    with open(_LOG, "a") as log:
        log.write(json.dumps(line) + "\n")


if _LOG:
    gc.callbacks.append(_record)
