"""Putting a ``MemoryPlan`` into effect on a loaded model, and telling the user what it did.

``plan_for_memory`` (``memory_model``) decides; ``apply_plan`` applies, in the plan's order: the AdaLN projections
moved to host memory (the sampler then makes the run's tables once) and block streaming with as many blocks
resident as the plan keeps. The lower-memory paths are the plan's ``RunOptions`` (``FittedModel.options``), given
to every evaluation. ``FittedModel.remove`` undoes what can be undone between runs (streaming); moving the AdaLN
projections is exact and costs nothing worth undoing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.adaln_tables import keep_adaln_on_host
from ..models.options import RunOptions
from .offload import BlockOffload, offload_blocks
from .predict import MemoryPlan

__all__ = ["FittedModel", "apply_plan", "plan_lines"]

GiB = 2**30


@dataclass
class FittedModel:
    """What ``apply_plan`` did to ``model``: the plan, the offload handle (if blocks stream), the lines a user is
    shown and the mode the blocks run in (``policy.fuse_for``)."""

    model: torch.nn.Module
    plan: MemoryPlan
    offload: BlockOffload | None = None
    said: list[str] = field(default_factory=list)
    fused: str | None = None

    @property
    def options(self) -> RunOptions:
        """The ``RunOptions`` the model's evaluations take under this placement."""
        return RunOptions().fused(self.fused).with_low_memory(self.plan.options)

    def remove(self, device=None, *, streamed_to=None) -> None:
        """Stop streaming blocks: every block back on the device the model was offloaded to, or as
        ``BlockOffload.remove`` puts them (``device``, ``streamed_to``)."""
        if self.offload is not None:
            self.offload.remove(device, streamed_to=streamed_to)
            self.offload = None

    @property
    def layout(self) -> tuple:
        """What the plan put where: two placements with the same layout hold the weights in the same places."""
        return _layout(self.plan)


def _layout(plan: MemoryPlan) -> tuple:
    return plan.options, plan.adaln_on_host, plan.resident_blocks


def plan_lines(plan: MemoryPlan) -> list[str]:
    """What ``plan`` gives up and predicts, in the sentences a user is shown."""
    peak = plan.predicted["total"] / GiB
    if not plan.steps:
        lines = [f"the model fits as it is: predicted peak {peak:.1f} GiB of {plan.budget / GiB:.1f} GiB"]
    else:
        lines = [
            f"to fit {plan.budget / GiB:.1f} GiB (predicted peak {peak:.1f} GiB): "
            + "; ".join(plan.steps)
            + f" ({plan.extra_time})"
        ]
    if not plan.fits:
        lines.append(
            f"even so the predicted peak is {peak:.1f} GiB, above the {plan.budget / GiB:.1f} GiB "
            "available: free memory (unload other models) or use a larger card"
        )
    return lines


def apply_plan(
    model: torch.nn.Module, plan: MemoryPlan, device, *, prefetch: int = 1, fused: str | None = None
) -> FittedModel:
    """Apply ``plan`` to ``model`` (an ``H3DiT`` already on ``device``, or on the host when blocks will stream);
    ``fused``: the mode its blocks run in."""
    fitted = FittedModel(model, plan, said=plan_lines(plan), fused=fused)
    if plan.adaln_on_host:
        keep_adaln_on_host(model)
    if plan.resident_blocks is not None:
        fitted.offload = offload_blocks(model, device=device, resident_blocks=plan.resident_blocks, prefetch=prefetch)
    return fitted
