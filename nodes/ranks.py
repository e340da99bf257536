"""The worker processes one ComfyUI process samples with across several GPUs (``h3_core.parallel.RankWorkers``):
started on a run that asks for them (``H3 Multi-GPU``), kept between runs while the same GPUs are asked for, and
closed (every worker gone, the process group left) when a run fails or is cancelled, when the host unloads the DiT
they hold a copy of, when another number of GPUs is asked for, and when the server exits; a worker whose server
died exits by itself."""

from __future__ import annotations

import atexit
import dataclasses
import threading
from dataclasses import dataclass, field

import torch

from ..h3_core.errors import H3InputError
from . import _host

GiB = 2**30
RANKS_KEY = "h3_ranks"  # a patcher's attachment: the RanksChoice of H3 Multi-GPU
SOURCE_KEY = "h3_source"  # a patcher's attachment: the h3_core.parallel.DiTSource the loader read


@dataclass(frozen=True)
class RanksChoice:
    gpus: int
    softmax_ranks: int = 0


@dataclass
class _Group:
    workers: object  # h3_core.parallel.RankWorkers
    devices: tuple[str, ...]
    source: object = None  # the DiTSource the workers hold a copy of
    sent: set = field(default_factory=set)  # the weights rank 0 copied to them since they loaded it


_lock = threading.Lock()
_group: _Group | None = None


def rank_devices(gpus: int, first: torch.device) -> tuple[str, ...]:
    """One device per rank, ``first`` (the DiT's) for this process: on CUDA the next GPUs after it, on the CPU
    the CPU for every rank (gloo)."""
    if first.type != "cuda":
        return ("cpu",) * gpus
    count = torch.cuda.device_count()
    if gpus > count:
        allowed = f"2 to {count}" if count >= 2 else "none: H3 Multi-GPU needs two or more; remove the node"
        raise H3InputError(f"gpus: got {gpus}; this machine has {count} CUDA device(s); allowed: {allowed}")
    index = first.index if first.index is not None else torch.cuda.current_device()
    return tuple(f"cuda:{(index + r) % count}" for r in range(gpus))


def group_for(gpus: int, first: torch.device, any_devices: bool = False) -> _Group:
    """The running group for ``gpus`` ranks from ``first``, started (and an other one closed) as needed;
    ``any_devices``: a running group of ``gpus`` ranks serves, whichever its devices."""
    global _group
    devices = rank_devices(gpus, first)
    with _lock:
        if _group is not None and any_devices and len(_group.devices) == gpus and not _group.workers.closed:
            return _group
        if _group is not None and (_group.devices != devices or _group.workers.closed):
            _close_locked("another number of GPUs was asked for")
        if _group is None:
            from ..h3_core.parallel import RankWorkers

            _host.say(f"starting {gpus - 1} worker process(es) for the ranks on {', '.join(devices[1:])}")
            _group = _Group(RankWorkers(gpus - 1, devices=list(devices)), devices)
        return _group


def close_group(reason: str) -> None:
    """Close the running group, if any (every worker gone)."""
    with _lock:
        _close_locked(reason)


def _close_locked(reason: str) -> None:
    global _group
    if _group is None:
        return
    group, _group = _group, None
    group.workers.close()
    _host.say(f"closed the {len(group.devices) - 1} rank worker process(es): {reason}")


atexit.register(lambda: close_group("the server is exiting"))


def close_group_of(source, reason: str) -> None:
    """Close the running group if its workers hold a copy of ``source``."""
    with _lock:
        if _group is not None and _group.source == source:
            _close_locked(reason)


def sample_on_ranks(model, choice: RanksChoice, prompt, request, runner, references=None, memory: str = "auto"):
    """The sampler's ``generate`` (or Ref2VA's, with ``references``) across ``choice.gpus`` ranks: this process is
    rank 0 with the host's model and runs ``request`` as ``runner`` says (its progress, previews, cancel check, the
    host's load before the first evaluation, a host sampler); each worker runs the same request on its own copy of
    the DiT. Whatever stops the run (an error anywhere, a cancel) closes the workers."""
    from ..h3_core.parallel import HeldRaise, RankGroup, leading_solver, send_weights, shared_cancel, weight_names
    from ..h3_core.pipeline.clip_on_ranks import ClipOnRanks, generate_clip, on_cpu

    source = model.attachments.get(SOURCE_KEY)
    if source is None:
        raise H3InputError(
            "model: was not read by H3 DiT Loader, so the other ranks cannot load it; H3 Multi-GPU needs one"
        )
    device = torch.device(model.load_device)
    group = group_for(choice.gpus, device)
    if group.source != source:
        group.source, group.sent = source, set()
    held = HeldRaise()  # the host's progress hook raises its interrupt where rank 0 alone is
    fit, solver = runner.before_sampling, runner.solver

    def fit_and_send(packed):
        options = fit(packed)
        names = weight_names(model.model, set(model.patches) | group.sent)
        send_weights(model.model, names, device)
        group.sent = set(names)
        # no retry for less memory on one rank alone: the others would wait for it in their exchanges
        return None if options is None else dataclasses.replace(options, on_out_of_memory=None)

    here = dataclasses.replace(
        runner,
        progress=held.wrap(runner.progress),
        preview=held.wrap(runner.preview),
        check_cancel=shared_cancel(held.check(runner.check_cancel), device=device),
        before_sampling=fit_and_send,
        solver=None if solver is None else leading_solver(solver, device),
        ranks=RankGroup(softmax_ranks=choice.softmax_ranks),
    )
    job = ClipOnRanks(
        source,
        prompt=on_cpu(prompt),
        request=on_cpu(request),
        references=None if references is None else on_cpu(tuple(references)),
        placement=model.placement.offload,
        memory=memory,
        softmax_ranks=choice.softmax_ranks,
        follow=solver is not None,
    )
    return _run_everywhere(
        group, job, lambda: generate_clip(model.model, prompt, request, here, references), held, "sampling"
    )


def decode_on_ranks(patcher, choice: RanksChoice, latents, options: dict, decode):
    """``decode(options)`` (this process's decode of ``latents`` with ``decode_video``'s options) with each window's
    tile batches shared among ``choice.gpus`` ranks (the running group's, if it has as many): each worker decodes
    its share with its own copy of the video VAE, this process blends and writes every frame as one GPU would.
    Cancel and failures as ``sample_on_ranks``."""
    import torch.distributed as dist

    from ..h3_core.parallel import HeldRaise, shared_cancel
    from ..h3_core.pipeline.clip_on_ranks import DecodeOnRanks

    source = patcher.attachments.get(SOURCE_KEY)
    if source is None:
        raise H3InputError(
            "video_vae: was not read by H3 Video VAE Loader, so the other ranks cannot load it; H3 Multi-GPU needs one"
        )
    device = torch.device(patcher.load_device)
    group = group_for(choice.gpus, device, any_devices=True)
    held = HeldRaise()
    hooks = options["hooks"]
    here = dict(
        options,
        hooks=dataclasses.replace(
            hooks,
            progress=held.wrap(hooks.progress),
            check_cancel=shared_cancel(held.check(hooks.check_cancel), device=device),
        ),
        group=dist.group.WORLD,
    )
    shared = {name: options[name] for name in ("overrides", "compile", "tiling")}
    job = DecodeOnRanks(source, latents.cpu(), shared)
    return _run_everywhere(group, job, lambda: decode(here), held, "decoding")


def _run_everywhere(group: _Group, job, here, held, what: str):
    """``job`` on the workers and ``here()`` in this process; then what a wrapped host callback kept (``held``) is
    raised and the workers' figures logged. Whatever stops it closes the workers."""
    try:
        result = group.workers.run(job, here=here)
        held.raise_kept()
        _say_reports(what, group.workers.reports)
    except BaseException as exc:
        close_group(f"the {what} stopped ({type(exc).__name__})")
        raise
    return result


def _say_reports(what: str, reports: dict) -> None:
    """One log line: each worker's seconds and, on GPUs, its peak device memory during the job."""
    parts = []
    for rank, report in sorted(reports.items()):
        if report is None:
            continue
        peak = "" if report.peak_bytes is None else f", peak {report.peak_bytes / GiB:.2f} GiB"
        parts.append(f"rank {rank} {report.seconds:.2f} s{peak}")
    _host.say(f"{what} across the ranks: " + "; ".join(parts))
