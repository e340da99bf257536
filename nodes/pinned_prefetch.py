"""The VAEs' weights made ready for their move to the GPU while the DiT samples.

A VAE loader hands its patcher to ``offer``. Once the sampler's first step is done (its first launches and
compilation past, the GPU busy for the steps that follow), ``start`` copies, on a thread, the weights of every
offered VAE that sits in host memory and runs on a GPU into page-locked memory
(``h3_core.memory.pinned_weights``), when the host has the memory free. ``load_pinned`` is how a node has the
host load a VAE: it waits for that VAE's copy, points the VAE at it, lets the host's model management move it
(at the copy engine's rate instead of through the driver's bounce buffers) and gives the page lock back.
A VAE whose copy has not started is loaded as without it, and the copy is not made.
"""

from __future__ import annotations

import threading
import weakref

import torch

from ..h3_core.memory.pinned_weights import copy_to_pinned, pinnable_bytes
from . import _host

# the host memory that must stay free beside the copies (the share of the machine's memory)
KEEP_FREE_SHARE = 0.25

_lock = threading.Lock()
_offered: weakref.WeakSet = weakref.WeakSet()
_jobs: dict[int, "_Job"] = {}  # id(patcher) -> its copy, started or done


class _Job:
    def __init__(self, patcher):
        self.cancelled = False
        self.result = None
        self.patcher = weakref.ref(patcher)
        self.thread = threading.Thread(target=self._run, args=(patcher.model,), name="h3-pin-weights", daemon=True)

    def _run(self, model) -> None:
        try:
            self.result = copy_to_pinned(model, should_stop=lambda: self.cancelled)
        except Exception as exc:  # the load then runs from pageable memory, as without the copy
            _host.say(f"copying a VAE's weights to page-locked memory failed, loading without: {exc}")

    def drop(self) -> None:
        """Stops the copy and gives back what it registered."""
        self.cancelled = True
        self.thread.join()
        if self.result is not None:
            self.result.release()
            self.result = None


def offer(patcher) -> None:
    """A VAE patcher whose weights ``start`` may copy while the DiT samples."""
    with _lock:
        _offered.add(patcher)


def _wanted(patcher) -> bool:
    device = torch.device(patcher.load_device)
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and id(patcher) not in _jobs
        and next(patcher.model.parameters(), torch.empty(0, device=device)).device.type == "cpu"
    )


def _room_for(count: int) -> bool:
    import comfy.model_management as mm
    import psutil

    cpu = torch.device("cpu")
    return mm.get_free_memory(cpu) - count > KEEP_FREE_SHARE * psutil.virtual_memory().total


def start() -> None:
    """Starts the copies of the offered VAEs that are in host memory and run on a GPU, one thread each, when
    the host has the memory free for them."""
    with _lock:
        for key, job in list(_jobs.items()):  # copies of VAEs no node holds any more
            if job.patcher() is None:
                del _jobs[key]
                job.drop()
        for patcher in list(_offered):
            if not _wanted(patcher):
                continue
            count = pinnable_bytes(patcher.model)
            if count == 0 or not _room_for(count):
                continue
            job = _jobs[id(patcher)] = _Job(patcher)
            job.thread.start()


def _take(patcher):
    """The finished copy of ``patcher``'s weights (waiting for one under way), or None; a copy not wanted any
    more is stopped."""
    with _lock:
        job = _jobs.pop(id(patcher), None)
    if job is None:
        return None
    if job.patcher() is not patcher:  # an earlier patcher's, under the same id
        job.drop()
        return None
    job.thread.join()
    return job.result


def load_pinned(patcher, load) -> None:
    """``load()`` (the host's ``load_models_gpu`` for ``patcher``) with ``patcher``'s weights in page-locked
    memory when their copy was made; the page lock is given back after it."""
    pinned = _take(patcher)
    if pinned is None:
        load()
        return
    try:
        pinned.swap_in()
        load()
    finally:
        pinned.release()
