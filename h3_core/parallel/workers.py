"""Worker processes for the ranks beyond this one: ``RankWorkers(n)`` starts n processes (``torch.multiprocessing``,
spawned), joins them with this process in one ``torch.distributed`` group (this process rank 0; NCCL with a GPU
each, gloo on the CPU) and runs jobs on every rank at once: ``run(job)`` hands ``job`` to the workers and runs it
here, each rank calling ``job(rank, device, state)`` (``state``: the worker's own dict, kept between jobs, e.g.
its copy of the weights). A job raising on a worker is reported to rank 0, whose ``run`` raises it and closes the
workers.

The workers start from ``rank_main.py`` (``spawn_from_pack``), never from the starting process's own script (a
host's ``main.py`` would start a second host): it registers this pack's package under the name the starting process
imported it by (a host imports it under a path of its own choosing), so the jobs it is handed unpickle there.

Stopping: ``close()`` asks the workers to leave, waits, terminates any that do not, and leaves the group; a worker
whose parent process is gone exits by itself (a watchdog), so none outlives the process that started it. A cancel
reaches every rank through ``shared_cancel``: the check each rank calls between steps of a job."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import sys
import tempfile
import threading
import time
import traceback
import types
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import H3BackendUnavailable, H3InputError

__all__ = ["RankWorkers", "RanksCancelled", "shared_cancel", "HeldRaise"]

_LEAVE = "leave"
# what rank_main.py reads in a starting worker: the package this module belongs to, and its folder
PACKAGE_VARIABLE, FOLDER_VARIABLE = "H3_RANKS_PACKAGE", "H3_RANKS_PACKAGE_FOLDER"
_starting = threading.Lock()


class RanksCancelled(InterruptedError):
    """Another rank of the group was cancelled: this one stops with it."""


def shared_cancel(check_cancel, group=None, device="cpu"):
    """A cancel check every rank of ``group`` calls at the same points: each runs its own ``check_cancel`` (None on
    ranks that have none), the outcomes are summed over the ranks (one ``all_reduce`` of a flag on ``device``),
    and every rank stops when any was cancelled — the rank cancelled with its own exception, the others with
    ``RanksCancelled``."""

    def check() -> None:
        raised = None
        if check_cancel is not None:
            try:
                check_cancel()
            except BaseException as exc:  # the host's interrupt, whatever its type
                raised = exc
        flag = torch.tensor([0.0 if raised is None else 1.0], device=device)
        dist.all_reduce(flag, group=group)
        if raised is not None:
            raise raised
        if flag.item():
            raise RanksCancelled("another rank of the group was cancelled")

    return check


class HeldRaise:
    """A callback that may raise (the host's progress hook raises its interrupt) made safe to call where only
    this rank is: ``wrap(callback)`` keeps what it raises, and ``check()`` raises it at a point every rank
    reaches (before the shared cancel check), or ``raise_kept()`` once the ranks are done."""

    def __init__(self):
        self.kept: BaseException | None = None

    def wrap(self, callback):
        if callback is None:
            return None

        def call(*args):
            try:
                return callback(*args)
            except BaseException as exc:
                if self.kept is None:
                    self.kept = exc
                return None

        return call

    def raise_kept(self) -> None:
        if self.kept is not None:
            kept, self.kept = self.kept, None
            raise kept

    def check(self, then=None):
        """A cancel check: what a wrapped callback raised, then ``then()``."""

        def check() -> None:
            self.raise_kept()
            if then is not None:
                then()

        return check


@contextlib.contextmanager
def spawn_from_pack():
    """While workers start: their first code is ``rank_main.py`` in place of this process's main script, told
    this package's name and folder."""
    package = __name__.rpartition(".h3_core.")[0]
    folder = str(Path(__file__).resolve().parents[2]) if package else ""
    main = sys.modules["__main__"]
    stand_in = types.ModuleType("__main__")
    stand_in.__file__ = str(Path(__file__).with_name("rank_main.py"))
    with _starting:
        os.environ[PACKAGE_VARIABLE], os.environ[FOLDER_VARIABLE] = package, folder
        sys.modules["__main__"] = stand_in
        try:
            yield
        finally:
            sys.modules["__main__"] = main
            os.environ.pop(PACKAGE_VARIABLE, None)
            os.environ.pop(FOLDER_VARIABLE, None)


class RankWorkers:
    """``count`` worker processes, ranks 1..count, beside this process (rank 0), in one process group.

    Args:
        count: the workers (at least 1).
        devices: each rank's device, this process's first (default: ``cuda:r`` for rank r where CUDA has that many
            devices, else the CPU for all).
        timeout_s: how long a collective may wait for a rank before the group gives up (a rank that died).
    """

    def __init__(self, count: int, devices: list[str] | None = None, timeout_s: float = 600.0):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise H3InputError(f"workers: got {count!r}; allowed: a count of at least 1 (the ranks beside this one)")
        world = count + 1
        if devices is None:
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            devices = [f"cuda:{r}" for r in range(world)] if gpus >= world else ["cpu"] * world
        if len(devices) != world:
            raise H3InputError(f"devices: got {len(devices)} for {world} ranks; allowed: one per rank")
        if dist.is_initialized():
            raise H3InputError("this process is already in a process group: close the RankWorkers that made it first")
        self.devices = [torch.device(d) for d in devices]
        self.backend = _backend(self.devices[0])
        handle, store = tempfile.mkstemp(prefix="h3_ranks_")
        os.close(handle)
        os.unlink(store)  # the group's file store creates it
        self._store = Path(store)
        init = f"file://{store}"
        context = mp.get_context("spawn")
        self._jobs = [context.SimpleQueue() for _ in range(count)]
        self._results = context.Queue()
        self.processes = [
            context.Process(
                target=_worker_main,
                args=(
                    rank,
                    world,
                    init,
                    self.backend,
                    str(self.devices[rank]),
                    timeout_s,
                    os.getpid(),
                    jobs,
                    self._results,
                ),
                name=f"h3-rank-{rank}",
                daemon=True,
            )
            for rank, jobs in zip(range(1, world), self._jobs)
        ]
        with spawn_from_pack():
            for process in self.processes:
                process.start()
        if self.devices[0].type == "cuda":
            torch.cuda.set_device(self.devices[0])
        dist.init_process_group(
            self.backend, init_method=init, rank=0, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
        self.group = dist.group.WORLD
        self.closed = False
        self.reports: dict = {}

    @property
    def world(self) -> int:
        return len(self.processes) + 1

    def run(self, job, state: dict | None = None, settle_s: float = 10.0, here=None):
        """Run ``job(rank, device, state)`` on every rank (``here()`` in its place on this one, when given);
        returns rank 0's result (the workers' results, which travel pickled, are in ``reports`` by rank after it),
        raises the first failure. A worker that fails reports its error and leaves the group, one that dies is
        noticed (``_gather_reports``): a collective waiting on either fails at once (gloo: its connection closes;
        NCCL: the group is aborted); the workers are then closed and ``run`` raises that error. When rank 0 fails and
        the workers do not report within ``settle_s`` (they wait in a collective rank 0 left), they are closed too.
        Once closed, the next run needs new ``RankWorkers``."""
        if self.closed:
            raise H3InputError("these ranks were closed: start new RankWorkers")
        for jobs in self._jobs:
            jobs.put(job)
        reports: list = []
        stop = threading.Event()
        watcher = threading.Thread(
            target=self._gather_reports, args=(reports, stop), daemon=True, name="h3-rank-reports"
        )
        watcher.start()
        try:
            result = here() if here is not None else job(0, self.devices[0], {} if state is None else state)
            failed = None
        except BaseException as exc:
            failed = exc
        watcher.join(None if failed is None else settle_s)
        if watcher.is_alive():  # the workers wait in a collective rank 0 left
            stop.set()
            watcher.join()
            self.close(wait_s=0)
        errors = [(rank, error) for rank, error, _ in sorted(reports, key=lambda report: report[0]) if error]
        if errors:  # the failed workers left the group (so that no rank waits on them): it is closed
            self.close()
            rank, error = errors[0]
            raise RuntimeError(f"rank {rank} failed: {error}") from failed
        if failed is not None:
            raise failed
        self.reports = {rank: value for rank, _, value in reports}
        return result

    def _gather_reports(self, reports: list, stop: threading.Event) -> None:
        """Every worker's report of the job into ``reports``, as they come; a worker that died without one is
        reported as failed. On a failure the NCCL group is aborted, so that rank 0 does not wait for the failed
        rank until the group's timeout (gloo's collectives fail by themselves when the rank's connection closes)."""
        reported: set[int] = set()
        while len(reported) < len(self.processes) and not stop.is_set():
            try:
                report = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.processes, start=1) if r not in reported and not p.is_alive()]
                if not dead:
                    continue
                try:  # a report sent just before the worker ended may still be on its way
                    report = self._results.get(timeout=1.0)
                except queue.Empty:
                    code = self.processes[dead[0] - 1].exitcode
                    report = (dead[0], f"the worker exited (code {code}) without reporting", None)
            reports.append(report)
            reported.add(report[0])
            if report[1] is not None and self.backend == "nccl":
                try:
                    self.group.abort()
                except RuntimeError:  # already torn down
                    pass

    def close(self, wait_s: float = 30.0) -> None:
        """Ask the workers to leave, wait up to ``wait_s``, terminate those still running, leave the group."""
        if self.closed:
            return
        self.closed = True
        for jobs, process in zip(self._jobs, self.processes):
            if process.is_alive():
                jobs.put(_LEAVE)
        deadline = time.monotonic() + wait_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(5)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:  # a group aborted after a worker failed
                pass
        self._store.unlink(missing_ok=True)

    def __enter__(self) -> "RankWorkers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _backend(device: torch.device) -> str:
    """The process group's backend for ranks on ``device``'s type: NCCL on CUDA, gloo on the CPU; an error saying
    what is missing where this PyTorch build lacks it (its Windows and macOS builds have no NCCL)."""
    wanted = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_available() and (dist.is_nccl_available() if wanted == "nccl" else dist.is_gloo_available()):
        return wanted
    missing = ("NCCL" if wanted == "nccl" else "gloo") if dist.is_available() else "torch.distributed"
    why = " (PyTorch's builds for Windows and macOS come without it)" if missing == "NCCL" else ""
    raise H3BackendUnavailable(
        f"H3 Multi-GPU needs {missing} for ranks on {device.type.upper()}, which this PyTorch build lacks{why}; "
        "remove the H3 Multi-GPU node to sample on one device"
    )


def _parent_gone(parent: int) -> bool:
    """Whether the process that started this worker (``parent``, its id) has ended. A POSIX orphan is adopted by
    another process, so ``os.getppid()`` changes; on Windows it never does, and the parent's sentinel that
    multiprocessing keeps in a worker it spawned (the parent's process handle there) tells instead."""
    if os.getppid() != parent:
        return True
    process = multiprocessing.parent_process()
    return process is not None and not process.is_alive()


def _watch_parent(parent: int) -> None:
    """Exit this worker once the process that started it is gone."""
    while True:
        if _parent_gone(parent):
            os._exit(3)
        time.sleep(0.5)


def _worker_main(rank, world, init, backend, device, timeout_s, parent, jobs, results) -> None:
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="h3-parent-watch").start()
    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    state: dict = {}
    try:
        while (job := jobs.get()) != _LEAVE:
            try:
                results.put((rank, None, job(rank, device, state)))
            except BaseException as exc:
                if isinstance(exc, RanksCancelled):
                    results.put((rank, None, None))
                else:
                    results.put((rank, "".join(traceback.format_exception_only(type(exc), exc)).strip(), None))
                    break  # leave: a rank waiting on this one in a collective fails now, not at the timeout
    finally:
        dist.destroy_process_group()
