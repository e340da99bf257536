"""This process's resident memory from ``/proc/self/status`` (VmRSS, RssAnon, RssFile, in bytes), and its peak
while a call runs (sampled every 2 ms on a thread of its own): what the memory benches and tests measure loads
with."""

from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

KEYS = ("VmRSS", "RssAnon", "RssFile")
T = TypeVar("T")


def resident() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in KEYS:
                out[key] = int(value.split()[0]) * 1024
    return out


def peak_while(fn: Callable[[], T]) -> tuple[T, dict[str, int], dict[str, int]]:
    """``fn()``'s result, the resident memory before it and the peak while it ran."""
    before = resident()
    peak, done = dict(before), threading.Event()

    def watch():
        while not done.is_set():
            for key, value in resident().items():
                peak[key] = max(peak[key], value)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = fn()
    finally:
        done.set()
        watcher.join()
    return result, before, peak
