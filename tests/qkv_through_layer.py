"""q, k and v through ``qkv_proj``'s own forward, for comparisons: the pack's attention reads row slices of
``qkv_proj.weight`` (``low_memory.linear_rows``), which skips the layer's forward — where a host's layer runs its
quantised weight, where a forward hook sits. ``qkv_through_layer`` makes each attention of a model call the layer
once on its input and take q, k and v as strided views of its ``[T, 3 · H · d]`` output, as the native block does;
``qkv_from_weight_rows`` puts the pack's own form back."""

from __future__ import annotations

from types import MethodType

import torch.nn as nn

from h3_core.models.dit import Attention

__all__ = ["qkv_through_layer", "qkv_from_weight_rows"]


def _input(self, x):
    return x  # the layer quantises (or casts) its own input


def _project(self, x, heads=None, source=None):
    T, d = x.shape[0], self.head_dim
    heads = slice(0, self.heads) if heads is None else heads
    return self.qkv_proj(x).view(T, 3, self.heads, d)[:, :, heads].unbind(1)


def qkv_through_layer(model: nn.Module) -> nn.Module:
    """``model`` with every ``Attention`` in it projecting q, k and v by one call of ``qkv_proj``; returns it."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.projection_input = MethodType(_input, module)
            module.project = MethodType(_project, module)
    return model


def qkv_from_weight_rows(model: nn.Module) -> nn.Module:
    """``model`` with every ``Attention`` in it projecting as the pack does again; returns it."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.__dict__.pop("projection_input", None)
            module.__dict__.pop("project", None)
    return model
