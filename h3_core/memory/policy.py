"""Where a loaded DiT runs for one request: the low-VRAM policy.

``decide_placement`` turns the user's choices (``placement``: auto / resident / stream blocks; ``memory``:
auto / off) and the device's free memory into a ``MemoryPlan`` for the request's packed sequence: with
``memory="auto"`` the memory model predicts the run's peak for each way of giving things up (head groups and
a chunked FFN, the AdaLN projections in host memory, streamed blocks) and the quickest that fits, by the time
predicted on the card (``predict.plan_for_memory``, ``speed``), is taken; ``"off"`` runs the plain path.
``place_for_run`` applies the plan for the user's ``RunChoices`` and returns what it did, in words and as the
``RunOptions`` every evaluation is given. On CUDA with Triton the blocks run fused (``models.block_fused``,
compiled), faster and in less memory than the plain blocks (``bench/results/dit_block.md``), and the plan is made
for that — unless the user's ``compile`` is ``"off"`` (``COMPILE_MODES``) or the model's compiled path failed
earlier in this process (``run_options.Evaluations``), which run the plain path. On a device without CUDA nothing
is planned: the model simply runs there, on the plain path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..attention.window import check_precision
from ..errors import H3DoesNotFit, H3InputError
from ..models.branch_fused import compiled_branch_available
from ..models.low_memory import LowMemory
from ..models.run_options import compile_failed
from ..triton_forms import COMPILE_MODES, check_compile
from .apply import FittedModel, apply_plan, plan_lines
from .predict import BlockShape, MemoryPlan, ModelForm, evaluation_peak, plan_for_memory
from .ranks import RankShare, rank_peaks
from .speed import H100, CardSpeed, card_speed

__all__ = [
    "PLACEMENTS",
    "MEMORY_MODES",
    "COMPILE_MODES",
    "BUDGET_SHARE",
    "RunChoices",
    "decide_placement",
    "place_for_run",
    "fuse_for",
    "working_bytes",
    "activation_bytes",
]

PLACEMENTS = ("auto", "resident", "stream blocks")
MEMORY_MODES = ("auto", "off")
# Of the free device memory, what a plan may fill: the rest absorbs the allocator's fragmentation and
# what other libraries hold.
BUDGET_SHARE = 0.9
GiB = 2**30


def _check_policy(placement: str, memory: str) -> None:
    if placement not in PLACEMENTS:
        raise H3InputError(f"placement must be one of {list(PLACEMENTS)}, got {placement!r}")
    if memory not in MEMORY_MODES:
        raise H3InputError(f"memory mode must be one of {list(MEMORY_MODES)}, got {memory!r}")


@dataclass(frozen=True)
class RunChoices:
    """The user's choices for placing a model for a run: ``placement`` (``PLACEMENTS``), ``memory``
    (``MEMORY_MODES``), ``compile`` (``COMPILE_MODES``) and the window softmax's ``attention_precision``. Made, they
    have been checked: one outside what is allowed raises ``H3InputError`` naming it."""

    placement: str = "auto"
    memory: str = "auto"
    compile: str = "auto"
    attention_precision: str = "bf16"

    def __post_init__(self):
        _check_policy(self.placement, self.memory)
        check_compile(self.compile)
        check_precision(self.attention_precision)


def _bytes_on(model, device: torch.device) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if t.device == device)


def fuse_for(model, device, compile: str = "auto") -> str | None:
    """The mode ``model``'s blocks and branches run in (``RunOptions.fused``): ``"compiled"`` where CUDA and Triton
    are present and ``compile`` is ``"auto"``, unless its compiled path failed before; else None, the plain path."""
    check_compile(compile)
    compiled = compile == "auto" and not compile_failed(model) and compiled_branch_available(torch.device(device))
    return "compiled" if compiled else None


def _blocks_said(model, compile: str, fused: str | None) -> str:
    if fused:
        return "fused blocks (compiled)"
    if compile == "off":
        return "plain blocks (compile off)"
    if compile_failed(model):
        return "plain blocks (compiling failed earlier)"
    return "plain blocks (no Triton)"


def working_bytes(model, packed, attention_precision: str = "bf16", fused: str | None = None) -> int:
    """The activations of one evaluation on ``packed`` with nothing given up (the plain path, or the ``fused``
    one): what the host is asked to make room for beside the weights, so that it frees other models before the
    plan has to trade time for memory."""
    return activation_bytes(ModelForm.of(model, fused, attention_precision), packed)


def activation_bytes(form: ModelForm, packed) -> int:
    """The activations of one evaluation of the model ``form`` describes on ``packed`` with nothing given up
    (``predict.evaluation_peak``)."""
    shape = BlockShape.of(form.cfg, packed, form.dtype)
    return int(evaluation_peak(form, shape)["activations"])


def decide_placement(
    form: ModelForm,
    packed,
    *,
    placement: str,
    memory: str,
    free_bytes: int,
    steps: int,
    share: RankShare | None = None,
    speed: CardSpeed = H100,
) -> MemoryPlan:
    """The plan for running the model ``form`` describes (``ModelForm.of`` a loaded ``H3DiT``: its blocks fused or
    not, its window softmax's precision) on ``packed`` within ``free_bytes`` of device memory on a card of ``speed``
    (``plan_for_memory`` chooses by predicted time); with ``share``, one rank's share of each evaluation across
    several GPUs (``ranks.rank_peaks``): the whole model resident and nothing given up when the rank's peak fits,
    else the plan for the whole sequence (which fits the rank's share with room to spare: the per-rank model covers
    one head group, resident, only)."""
    _check_policy(placement, memory)
    cfg = form.cfg
    shape = BlockShape.of(cfg, packed, form.dtype)
    budget = free_bytes * BUDGET_SHARE
    if share is not None and placement != "stream blocks":
        predicted = rank_peaks(
            cfg,
            shape,
            share,
            fused=form.fused,
            dtype=form.dtype,
            linears=form.linears,
            attention_precision=form.attention_precision,
        )
        if memory == "off" or predicted["total"] <= budget:
            said = (
                f"rank {share.rank}'s share: {share.rows} rows, the window softmax of {share.softmax_heads} heads "
                f"and the linear branch of {share.branch_heads}",
            )
            return MemoryPlan(LowMemory(), False, None, predicted, budget, said, "nothing given up")
    if memory == "auto":
        plan = plan_for_memory(form, shape, budget, steps=steps, speed=speed, streaming=placement != "resident")
        if placement == "auto" and plan.predicted["total"] > free_bytes:
            raise H3DoesNotFit(
                f"this request ({shape.rows} rows a model evaluation) needs about {plan.predicted['total'] / GiB:.1f} "
                f"GiB of device memory even with everything given up ({'; '.join(plan.steps)}), and "
                f"{free_bytes / GiB:.1f} GiB is free for it: choose a shorter clip or a smaller canvas, unload other "
                "models, or use a card with more memory"
            )
    else:
        plan = MemoryPlan(LowMemory(), False, None, evaluation_peak(form, shape, steps=steps), budget, (), "none")
    if placement == "resident" and plan.resident_blocks is not None:
        predicted = evaluation_peak(form, shape, plan.options, adaln_on_host=plan.adaln_on_host, steps=steps)
        plan = replace(
            plan, resident_blocks=None, predicted=predicted, steps=tuple(s for s in plan.steps if "streamed" not in s)
        )
    elif placement == "stream blocks" and plan.resident_blocks is None:
        predicted = evaluation_peak(
            form, shape, plan.options, adaln_on_host=plan.adaln_on_host, resident_blocks=0, steps=steps
        )
        plan = replace(
            plan,
            resident_blocks=0,
            predicted=predicted,
            steps=plan.steps + (f"all {cfg.layers} blocks streamed from host memory (asked for)",),
        )
    return plan


def place_for_run(
    model,
    packed,
    device,
    choices: RunChoices = RunChoices(),
    *,
    free_bytes: int | None = None,
    steps: int = 50,
    current: FittedModel | None = None,
    share: RankShare | None = None,
) -> FittedModel:
    """Put ``model`` on ``device`` for ``packed`` as ``decide_placement`` says for the user's ``choices`` (CUDA), or
    simply there (any other device); the result's ``options`` are the ``RunOptions`` its evaluations take: the plan's
    choices, the blocks fused or plain as ``fuse_for`` says for ``choices.compile``. ``current``: the placement
    of the model's last run, which this one replaces; when the new plan holds the weights where it did (the
    same blocks streamed, the same AdaLN residency), nothing moves. Otherwise call ``remove()`` on the result
    before placing the model for another request. ``share``: one rank's share of each evaluation
    (``decide_placement``)."""
    device = torch.device(device)
    fused = fuse_for(model, device, choices.compile)
    if device.type != "cuda":
        if current is not None:
            current.remove(streamed_to="cpu")
        model.to(device)
        plan = MemoryPlan(LowMemory(), False, None, {"total": 0.0}, float("inf"), (), "none")
        said = [f"running on the {device.type.upper()}; no memory plan needed"]
        return FittedModel(model, plan, said=said, fused=fused)
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(device)[0]
    free_bytes += _bytes_on(model, device)  # a model left on the device by the last run is counted in the plan
    plan = decide_placement(
        ModelForm.of(model, fused, choices.attention_precision, device),
        packed,
        placement=choices.placement,
        memory=choices.memory,
        free_bytes=free_bytes,
        steps=steps,
        share=share,
        speed=card_speed(device),
    )
    if current is not None and current.layout == (plan.options, plan.adaln_on_host, plan.resident_blocks):
        fitted = FittedModel(model, plan, current.offload, plan_lines(plan), fused=fused)
    else:
        if current is not None:
            current.remove(streamed_to="cpu")  # streamed blocks stay in host memory: the new plan places them
        if plan.resident_blocks is None:
            model.to(device)
        fitted = apply_plan(model, plan, device, fused=fused)
    fitted.said.insert(
        0,
        f"memory policy {choices.memory}, placement {choices.placement}, {free_bytes / GiB:.1f} GiB free, "
        + _blocks_said(model, choices.compile, fused),
    )
    return fitted
