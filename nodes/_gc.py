"""The objects a ComfyUI server keeps for its whole life, set aside from the host's garbage collections.

After every prompt the host's worker calls ``gc.collect()``, which walks every object the collector tracks while it
holds the interpreter lock; the server's messages (the prompt's end among them) wait behind it. Nearly all of those
objects are the modules, functions and classes imported at start-up, alive until the process ends.
``gc.freeze()`` moves every object tracked at that moment into a generation the collections skip. That is safe
only while nothing alive will later become garbage the collector alone could free: at start-up, before any prompt
was queued (a model or an output frozen in a reference cycle would never be freed). Cyclic garbage still pending
is collected first. ``H3_GC_FREEZE=0`` in the server's environment leaves the collections as they are."""

from __future__ import annotations

import gc
import os
import time

__all__ = ["SWITCH", "set_aside_startup_objects"]

SWITCH = "H3_GC_FREEZE"


def _queue_lock_and_count(prompt_queue):
    """The host queue's lock and how many prompts were ever queued on it; ``(None, None)`` where it has neither."""
    lock, counter = getattr(prompt_queue, "mutex", None), getattr(prompt_queue, "task_counter", None)
    if lock is None or not isinstance(counter, int):
        return None, None
    return lock, counter


def set_aside_startup_objects(prompt_queue) -> tuple[int, float] | None:
    """Collect, then freeze every object the collector tracks, unless ``$H3_GC_FREEZE`` is ``0`` or a prompt was ever
    queued on ``prompt_queue`` (the host's ``PromptQueue``, checked under its lock so that none is queued meanwhile;
    without one that can be checked, nothing is frozen). Returns the objects frozen in all (``gc.get_freeze_count``)
    and the seconds it took, or None when nothing was done."""
    if os.environ.get(SWITCH, "1") == "0":
        return None
    lock, counter = _queue_lock_and_count(prompt_queue)
    if lock is None or counter:
        return None
    started = time.perf_counter()
    gc.collect()
    with lock:
        if prompt_queue.task_counter:
            return None
        gc.freeze()
    return gc.get_freeze_count(), time.perf_counter() - started
