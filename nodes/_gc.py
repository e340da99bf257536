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


def _queue_lock(prompt_queue):
    """The host queue's lock where it has the lock, the count and the waiting list this module reads; else None."""
    lock = getattr(prompt_queue, "mutex", None)
    if not isinstance(getattr(prompt_queue, "task_counter", None), int) or not hasattr(prompt_queue, "queue"):
        return None
    return lock


def _never_queued(prompt_queue) -> bool:
    # the host counts a prompt when its worker takes it (PromptQueue.get); one still waiting is in its list
    return prompt_queue.task_counter == 0 and not prompt_queue.queue


def set_aside_startup_objects(prompt_queue) -> tuple[int, float] | None:
    """Collect, then freeze every object the collector tracks, unless ``$H3_GC_FREEZE`` is ``0`` or a prompt was ever
    queued on ``prompt_queue`` (the host's ``PromptQueue``: none taken by its worker and none waiting, checked under
    its lock so that none is queued meanwhile; without one that can be checked, nothing is frozen). Returns the
    objects frozen in all (``gc.get_freeze_count``) and the seconds it took, or None when nothing was done."""
    if os.environ.get(SWITCH, "1") == "0":
        return None
    lock = _queue_lock(prompt_queue)
    if lock is None or not _never_queued(prompt_queue):
        return None
    started = time.perf_counter()
    gc.collect()
    with lock:
        if not _never_queued(prompt_queue):
            return None
        gc.freeze()
    return gc.get_freeze_count(), time.perf_counter() - started
