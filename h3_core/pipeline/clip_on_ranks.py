"""The jobs a host hands to its rank workers (``parallel.RankWorkers``) for one clip: each rank loads its own copy of
the DiT from the files rank 0's came from (``DiTSource``), keeps it between jobs, and samples the clip with rank 0
(``ClipOnRanks``): the same request on every rank, each evaluation's blocks on the rank's rows. What rank 0 changed
in its weights after loading them (the host's LoRA patches) is copied to the other ranks before the first
evaluation (``parallel.weights``); a sampler that only rank 0 runs (the host's) leads the others
(``parallel.follow``)."""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..memory.policy import RunChoices, place_for_run
from ..memory.ranks import rank_shares
from ..parallel.follow import following_solver
from ..parallel.ulysses import RankGroup
from ..parallel.weights import receive_weights
from ..parallel.workers import shared_cancel
from .generate import generate, generate_ref2va
from .prompt import PromptEmbedding
from .request import ClipRequest, Runner

__all__ = [
    "DiTSource",
    "ClipOnRanks",
    "VideoVAESource",
    "DecodeOnRanks",
    "RankReport",
    "on_cpu",
    "generate_clip",
]


def generate_clip(model, prompt, request: ClipRequest, runner: Runner = Runner(), references=None):
    """``generate_ref2va`` with ``references``, else ``generate``."""
    if references is not None:
        return generate_ref2va(model, prompt, list(references), request, runner)
    return generate(model, prompt, request, runner)


@dataclass(frozen=True)
class DiTSource:
    """The DiT files and loader options a rank loads its copy from (``load_h3_model``'s arguments)."""

    base: str
    branch: str | None = None
    dtype: torch.dtype = torch.bfloat16
    linears: str = "dtype"

    def load(self, device: torch.device):
        from ..formats.checkpoints import load_h3_model

        return load_h3_model(
            self.base, branch=self.branch, device=device, dtype=self.dtype, linears=self.linears, run_device=device
        )


@dataclass(frozen=True)
class RankReport:
    """What a worker's job reports back: its seconds and, on a GPU, the peak bytes torch allocated on its device
    during the job (None on the CPU)."""

    seconds: float
    peak_bytes: int | None


def _reporting(device: torch.device, work) -> RankReport:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    work()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return RankReport(time.perf_counter() - started, peak)


@dataclass(frozen=True)
class ClipOnRanks:
    """One clip sampled on a rank beside rank 0 (a ``RankWorkers`` job): rank 0's ``prompt`` and ``request``
    (with ``references`` for Ref2VA); the rank runs it with a ``Runner`` of its own (its device, the shared cancel,
    its placement, the ranks); ``follow``: rank 0 integrates with a solver of its own."""

    source: DiTSource
    prompt: PromptEmbedding
    request: ClipRequest
    references: tuple | None = None
    placement: str = "auto"  # the loader's offload choice
    memory: str = "auto"
    softmax_ranks: int = 0
    follow: bool = False

    def __call__(self, rank: int, device: torch.device, state: dict) -> RankReport:
        first = torch.device("cpu") if self.placement == "stream blocks" else device
        model = rank_model(self.source, first, state)
        request = self.request

        def fit(packed):
            ranks = dist.get_world_size()
            shares = rank_shares(model.cfg, int(packed.positions.shape[0]), ranks, self.softmax_ranks)
            state["fitted"] = place_for_run(
                model,
                packed,
                device,
                RunChoices(self.placement, self.memory, request.compile, request.attention_precision),
                steps=request.steps,
                current=state.get("fitted"),
                share=shares[rank],
            )
            receive_weights(model, device)
            return state["fitted"].options

        runner = Runner(
            device=device,
            check_cancel=shared_cancel(None, device=device),
            before_sampling=fit,
            solver=following_solver(device) if self.follow else None,
            ranks=RankGroup(softmax_ranks=self.softmax_ranks),
        )
        return _reporting(device, lambda: generate_clip(model, self.prompt, request, runner, self.references))


@dataclass(frozen=True)
class VideoVAESource:
    """The video VAE file a rank loads its copy from (fp16 on a GPU, fp32 elsewhere, as the loader reads it)."""

    path: str

    def load(self, device: torch.device):
        from ..formats.video_vae import load_video_vae

        dtype = torch.float16 if device.type == "cuda" else torch.float32
        return load_video_vae(self.path, device=device, dtype=dtype)


@dataclass(frozen=True)
class DecodeOnRanks:
    """One clip's video decoded on a rank beside rank 0 (a ``RankWorkers`` job): ``latents`` and
    ``decode_video``'s ``options`` as rank 0 passes them, less its ``hooks``; each window's tile batches are shared
    among the ranks (``media.tiling.decode_tiled``'s ``group``)."""

    source: VideoVAESource
    latents: torch.Tensor
    options: dict = field(default_factory=dict)

    def __call__(self, rank: int, device: torch.device, state: dict) -> RankReport:
        from ..media.tiling import DecodeHooks, decode_video

        vae = _kept(state, "video_vae", self.source, device)
        hooks = DecodeHooks(check_cancel=shared_cancel(None, device=device))
        options = dict(self.options, hooks=hooks, group=dist.group.WORLD)
        return _reporting(device, lambda: decode_video(vae, self.latents.to(device), **options))


def rank_model(source: DiTSource, device: torch.device, state: dict):
    """This rank's copy of the DiT from ``source`` (read to ``device``), loaded on its first job and kept while the
    source stays."""
    if state.get("model_source") != source:
        fitted = state.pop("fitted", None)
        if fitted is not None:
            fitted.remove("cpu")
    return _kept(state, "model", source, device)


def _kept(state: dict, name: str, source, device: torch.device):
    """``state[name]``, loaded from ``source`` on ``device`` unless it was loaded from that source before (the
    copy of another source dropped first)."""
    if state.get(f"{name}_source") != source:
        state.pop(name, None)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        state[name], state[f"{name}_source"] = source.load(device), source
    return state[name]


def on_cpu(value):
    """``value`` with every tensor in it (in tuples, lists, dicts and dataclasses) on the CPU, for a job's queue."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(on_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: on_cpu(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: on_cpu(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    return value
