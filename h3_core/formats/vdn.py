"""Loading VDN-H3: the H3 DiT checkpoint plus the linear-branch file (``linear_branch/model.safetensors``).

The branch file holds, per block, the parameters the hybrid attention adds, under
``transformer_blocks.{i}.attn.`` (``softmax_gate``, ``to_out_linear``, ``linear_attention.*``). Files from
before v2 used other names (``far``, ``local_gate``, ``w_o_far``); both are read. The base weights load
through ``load_dit`` in any layout it accepts.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from .keymap import KeyMap, Rule, load_into
from ..models.dit import DiTConfig, H3DiT
from .dit import load_dit
from ..models.hybrid import add_hybrid_parts

__all__ = ["load_vdn", "branch_layouts", "BranchWeights"]

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


def load_vdn(base, branch, *, device="cpu", dtype: torch.dtype = torch.bfloat16, cfg: DiTConfig | None = None,
             qkv_interleaved: bool = False) -> H3DiT:
    """A VDN-H3 model: the DiT from ``base`` (file or folder, as ``load_dit``) with the hybrid attention's
    weights from ``branch``. The branch loads in ``dtype``; its scans accumulate in fp32 regardless."""
    cfg = replace(cfg, hybrid=False) if cfg is not None else None
    dense = load_dit(base, device=device, dtype=dtype, cfg=cfg, qkv_interleaved=qkv_interleaved)
    cfg = dense.cfg  # a pruned base sets its curve sizes
    with torch.device("meta"):
        added = BranchWeights(cfg)
        model = H3DiT(replace(cfg, hybrid=True))
    branch_layout = load_into(added, branch, branch_layouts(), what="VDN-H3 linear branch", device=device,
                              dtype=dtype)
    state = dense.state_dict()
    for key, value in added.state_dict().items():
        state["blocks." + key.removeprefix("transformer_blocks.")] = value
    model.load_state_dict(state, strict=True, assign=True)
    model.layout = f"{dense.layout} + {branch_layout}"
    return model.eval()
