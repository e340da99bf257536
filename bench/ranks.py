"""Several ranks for one benchmark: launched by ``torchrun`` (its ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` /
``MASTER_*`` variables) or by ``launch`` here (one process per rank through ``torch.multiprocessing``, the same
variables set), joined in one ``torch.distributed`` group (NCCL on GPUs, gloo on the CPU), and the seconds an
evaluation spends in the group's collectives (each call synchronised and timed in one instrumented run)."""

from __future__ import annotations

import os
import socket
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVES = ("all_to_all_single", "all_gather", "all_reduce")


def launched() -> bool:
    """Whether this process is one rank of a launch (torchrun's or ``launch``'s)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(count: int, main, argv) -> None:
    """Run ``main(argv)`` in ``count`` new processes, one rank each, on this machine."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_rank_main, args=(count, port, main, list(argv)), nprocs=count)


def _rank_main(rank: int, count: int, port: int, main, argv) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(count), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    main(argv)


def join(cuda: bool) -> torch.device:
    """Join the launch's group; this rank's device (``cuda:LOCAL_RANK`` on GPUs)."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    return device


def join_fake(rank: int, count: int) -> None:
    """Join torch's fake process group as ``rank`` of ``count`` (this process alone: every collective returns at
    once and moves nothing), for one rank's share of the work and its memory on one device."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=count)


@contextmanager
def timed_collectives(cuda: bool, seconds: list[float]):
    """Within the block, each collective of ``COLLECTIVES`` is synchronised before and after and its wall seconds
    appended to ``seconds``: what one evaluation spends exchanging, apart from the work around it."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def timed(fn):
        def call(*args, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
            return out

        return call

    for name, fn in originals.items():
        setattr(dist, name, timed(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
