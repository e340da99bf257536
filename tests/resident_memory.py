"""This process's resident memory from ``/proc/self/status`` (VmRSS, RssAnon, RssFile, in bytes), and its peak
while a call runs: the kernel's own high-water mark (``VmHWM``), reset before the call through
``/proc/self/clear_refs`` (where the process may not reset it, the mark since the process started, an upper bound):
what the memory benches and tests measure loads with."""

from __future__ import annotations

from typing import Callable, TypeVar

KEYS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
T = TypeVar("T")


def resident(pid: int | str = "self") -> dict[str, int]:
    """``KEYS`` of process ``pid`` (this one by default), in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in KEYS:
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> bool:
    """Reset the process's resident high-water mark to its current resident memory; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def peak_while(fn: Callable[[], T]) -> tuple[T, dict[str, int], dict[str, int]]:
    """``fn()``'s result, the resident memory before it and the peak while it ran (``{"VmRSS": VmHWM}``)."""
    before = resident()
    reset_peak()
    result = fn()
    return result, before, {"VmRSS": resident()["VmHWM"]}
