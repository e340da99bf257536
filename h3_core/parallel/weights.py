"""Named weights of rank 0's model copied into the same names of every other rank's copy (``torch.distributed``
broadcasts): what rank 0 changed after loading (the host's LoRA patches) reaches ranks that loaded the same files.
A weight held as a tensor subclass (comfy-kitchen's quantised tensors) travels as the plain tensors it is made of
(``__tensor_flatten__``), each copied into the same part of the receiving rank's weight."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import H3InputError
from .exchange import first_rank

__all__ = ["weight_names", "send_weights", "receive_weights"]


def weight_names(model: torch.nn.Module, keys) -> list[str]:
    """``keys`` (parameter or buffer names) that name a tensor of ``model``, with each one's ``<name>_scale``
    sibling where its module has one (an fp8 layer's scales change with its codes), sorted."""
    names = set()
    for key in keys:
        module_name, _, name = key.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(getattr(module, name, None), torch.Tensor):
            names.add(key)
            if isinstance(getattr(module, f"{name}_scale", None), torch.Tensor):
                names.add(f"{key}_scale")
    return sorted(names)


def _tensor(model, key: str) -> torch.Tensor:
    module_name, _, name = key.rpartition(".")
    return getattr(model.get_submodule(module_name), name)


def _parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors ``tensor`` is made of: itself, or its subclass's inner tensors in their order."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        return [tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor]
    names, _ = tensor.__tensor_flatten__()
    return [part for name in names for part in _parts(getattr(tensor, name))]


def send_weights(model: torch.nn.Module, names, device, group=None) -> int:
    """Rank 0: broadcast ``names`` (the list first, then each weight's parts, staged on ``device``, the group's
    device) to the other ranks of ``group``; returns the bytes sent."""
    names = list(names)
    dist.broadcast_object_list([names], first_rank(group), group=group, device=_object_device(device))
    sent = 0
    for key in names:
        for part in _parts(_tensor(model, key)):
            staged = part.detach().to(device).contiguous()
            dist.broadcast(staged, first_rank(group), group=group)
            sent += staged.numel() * staged.element_size()
    return sent


def receive_weights(model: torch.nn.Module, device, group=None) -> list[str]:
    """Every rank but 0: the weights ``send_weights`` broadcast, each part copied into the same part of this
    model's weight of that name, where that weight lives; returns the names."""
    box = [None]
    dist.broadcast_object_list(box, first_rank(group), group=group, device=_object_device(device))
    names = box[0]
    for key in names:
        try:
            parts = _parts(_tensor(model, key))
        except AttributeError as exc:
            raise H3InputError(f"rank {dist.get_rank(group)}: its model has no weight {key} to receive") from exc
        for part in parts:
            staged = torch.empty(part.shape, dtype=part.dtype, device=device)
            dist.broadcast(staged, first_rank(group), group=group)
            part.copy_(staged)
    return names


def _object_device(device):
    device = torch.device(device)
    return device if device.type == "cuda" else None
