"""VDN-H3's linear-branch file (``linear_branch/model.safetensors``): its tensors and their names.

The branch file holds, per block, the parameters the hybrid attention adds, under
``transformer_blocks.{i}.attn.`` (``softmax_gate``, ``to_out_linear``, ``linear_attention.*``). Files from
before v2 used other names (``far``, ``local_gate``, ``w_o_far``); both are read (``load_h3_model`` with a
branch).
"""

from __future__ import annotations

import torch.nn as nn

from ..models.dit import DiTConfig
from ..models.hybrid import add_hybrid_parts
from .keymap import KeyMap, Rule

__all__ = ["branch_layouts", "BranchWeights"]

_BLOCK = r"transformer_blocks\.(?P<n>\d+)\.attn\."
_SRC = "transformer_blocks.{n}.attn."


class _Added(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        add_hybrid_parts(self, cfg)


class _BlockAdded(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.attn = _Added(cfg)


class BranchWeights(nn.Module):
    """The branch file's tensors, named as the file names them."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.transformer_blocks = nn.ModuleList(_BlockAdded(cfg) for _ in range(cfg.layers))


def branch_layouts() -> tuple[KeyMap, ...]:
    meta = (r"__\w+__",)  # __window__, __branch__ and the like: settings, not weights
    pre_v2 = (
        Rule(_BLOCK + r"linear_attention\.output_gate\.(?P<r>.+)", (_SRC + "far.gate.{r}",)),
        Rule(_BLOCK + r"linear_attention\.(?P<r>.+)", (_SRC + "far.{r}",)),
        Rule(_BLOCK + r"softmax_gate\.(?P<r>.+)", (_SRC + "local_gate.{r}",)),
        Rule(_BLOCK + r"to_out_linear\.(?P<r>.+)", (_SRC + "w_o_far.{r}",)),
    )
    return KeyMap("VDN-H3 v2", ignore=meta), KeyMap("VDN-H3 pre-v2", pre_v2, ignore=meta)
