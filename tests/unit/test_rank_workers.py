"""Worker processes beside this one (h3_core.parallel.workers) on the CPU with gloo: a clip's sampler loop across
this process and two workers gives the single process's latents; a cancel on rank 0 stops every rank and leaves the
workers ready for the next job; a worker's failure is reported by rank and closes the workers (one failing while
rank 0 waits for it in a collective too), rank 0's own closes the workers left waiting for it; closing leaves no
process behind, and workers whose parent dies without closing them exit by themselves."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from tiny_dit import ranks_clip

from h3_core.errors import H3InputError
from h3_core.parallel.workers import RankWorkers, shared_cancel

ROOT = Path(__file__).resolve().parents[2]


def generate_job(rank, device, state):
    from h3_core.parallel import RankGroup

    return ranks_clip(steps=3, ranks=RankGroup(), check_cancel=shared_cancel(None))


class CancelAt:
    """Rank 0's check raising at its ``at``-th call (the host's interrupt)."""

    def __init__(self, at):
        self.at, self.calls = at, 0

    def __call__(self):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt("cancelled")


def cancelled_job(rank, device, state):
    from h3_core.parallel import RankGroup

    state["cancels"] = state.get("cancels", 0) + 1
    return ranks_clip(steps=3, ranks=RankGroup(), check_cancel=shared_cancel(CancelAt(5) if rank == 0 else None))


def failing_job(rank, device, state):
    if rank == 2:
        raise ValueError("this rank's own failure")
    return rank


def test_a_clip_across_workers_is_the_single_process_clip_and_a_cancel_stops_every_rank():
    alone = ranks_clip(steps=3)
    with RankWorkers(2) as workers:
        assert workers.world == 3 and all(p.is_alive() for p in workers.processes)
        shared = workers.run(generate_job)
        for a, b in zip(shared, alone):
            assert float((a - b).abs().max() / b.abs().max()) <= 1e-5
        with pytest.raises(KeyboardInterrupt, match="cancelled"):
            workers.run(cancelled_job)
        again = workers.run(generate_job)  # the ranks are in step again after the cancel
        assert all(torch.equal(a, b) for a, b in zip(again, shared))
        with pytest.raises(RuntimeError, match="rank 2 failed: ValueError: this rank's own failure"):
            workers.run(failing_job)
        processes = workers.processes
    assert not any(p.is_alive() for p in processes)
    with pytest.raises(H3InputError, match="closed"):
        workers.run(generate_job)


def stranding_job(rank, device, state):
    """Rank 0 fails on its own while the workers wait for it in a collective."""
    if rank == 0:
        raise ValueError("rank 0's own failure")
    torch.distributed.all_reduce(torch.zeros(1))


def test_a_failure_of_rank_zero_alone_closes_the_workers_waiting_for_it():
    workers = RankWorkers(1)
    try:
        with pytest.raises(ValueError, match="rank 0's own failure"):
            workers.run(stranding_job, settle_s=1.0)
        assert workers.closed and not any(p.is_alive() for p in workers.processes)
    finally:
        workers.close()


def waiting_job(rank, device, state):
    """A worker fails while rank 0 waits for it in a collective."""
    if rank == 1:
        raise ValueError("this worker's own failure")
    torch.distributed.all_reduce(torch.zeros(1))


def test_a_worker_failing_while_rank_zero_waits_for_it_is_reported_and_closes_the_workers():
    workers = RankWorkers(1)  # the group's timeout (600 s) never comes into it: the failed worker leaves
    try:
        with pytest.raises(RuntimeError, match="rank 1 failed: ValueError: this worker's own failure"):
            workers.run(waiting_job)
        assert workers.closed and not any(p.is_alive() for p in workers.processes)
    finally:
        workers.close()


def dying_job(rank, device, state):
    """A worker dies (no report, no clean exit) while rank 0 waits for it in a collective."""
    if rank == 1:
        os._exit(9)
    torch.distributed.all_reduce(torch.zeros(1))


def test_a_worker_dying_while_rank_zero_waits_for_it_is_reported_and_closes_the_workers():
    workers = RankWorkers(1)
    try:
        with pytest.raises(RuntimeError, match=r"rank 1 failed: the worker exited \(code 9\) without reporting"):
            workers.run(dying_job)
        assert workers.closed and not any(p.is_alive() for p in workers.processes)
    finally:
        workers.close()


def test_the_ranks_refuse_a_count_they_cannot_start():
    with pytest.raises(H3InputError, match="at least 1"):
        RankWorkers(0)
    with pytest.raises(H3InputError, match="one per rank"):
        RankWorkers(1, devices=["cpu"])


ORPHANS = textwrap.dedent(
    """
    import os, sys
    from h3_core.parallel.workers import RankWorkers
    workers = RankWorkers(1)
    print(" ".join(str(p.pid) for p in workers.processes), flush=True)
    os._exit(0)  # gone without closing them
    """
)


def test_workers_whose_parent_dies_exit_by_themselves():
    out = subprocess.run(
        [sys.executable, "-c", ORPHANS], capture_output=True, text=True, cwd=ROOT, timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    pids = [int(p) for p in out.stdout.split()]
    assert pids, out.stderr[-2000:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()
