"""The DiT as ComfyUI's model management sees it, so the host can make room for it and take it back.

Before a run the sampler hands ``Residency`` to ``comfy.model_management.load_models_gpu``: the host unloads
other models until ours fits and lists ours among its loaded models. Placing the weights stays ours (the
memory policy in ``h3_core.placement``), so loading is a no-op here; when the host unloads or needs the
memory back (``unload_all_models``, "free memory", another model's load) it calls ``detach`` /
``partially_unload`` and the weights leave the GPU until the next run.
"""

from __future__ import annotations

import torch

from . import _host


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Residency:
    parent = None

    def __init__(self, holder, load_device):
        self.holder = holder  # the loader's H3Model: the model and the run's FittedModel
        self.load_device = torch.device(load_device)
        self.offload_device = torch.device("cpu")

    @property
    def model(self):
        return self.holder.model

    def _tensors(self):
        return list(self.model.parameters()) + list(self.model.buffers())

    def model_size(self) -> int:
        return _bytes(self._tensors())

    def loaded_size(self) -> int:
        return _bytes(t for t in self._tensors() if t.device == self.load_device)

    def current_loaded_device(self):
        return self.load_device if self.loaded_size() else self.offload_device

    def model_dtype(self):
        return next(self.model.parameters()).dtype

    def model_patches_to(self, device) -> None:
        pass

    def model_patches_models(self) -> list:
        return []

    def lowvram_patch_counter(self) -> int:
        return 0

    def is_clone(self, other) -> bool:
        # The host drops the entry of a model it is asked to load again by this test (before listing it anew);
        # without it the model would be listed twice and unloaded twice.
        return other is self

    def partially_load(self, device, extra_memory=0, force_patch_weights=False) -> int:
        return 0  # the sampler places the weights itself, after the host made room

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False) -> int:
        freed = self.loaded_size()
        self.detach()
        return freed

    def detach(self, unpatch_all=True):
        if not unpatch_all:
            return self.model
        if self.holder.fitted is not None:
            self.holder.fitted.remove()
            self.holder.fitted = None
        if self.load_device != self.offload_device:
            self.model.to(self.offload_device)
        _host.say(f"the DiT was released from the {self.load_device.type} (the host asked for the memory)")
        return self.model


def make_room(holder, device, working_bytes: int) -> None:
    """Ask the host to make room for ``holder``'s DiT and ``working_bytes`` of activations, and to count the
    DiT among its loaded models from now on."""
    import comfy.model_management as mm

    if holder.residency is None or holder.residency.load_device != torch.device(device):
        holder.residency = Residency(holder, device)
    try:
        mm.load_models_gpu([holder.residency], memory_required=working_bytes, force_full_load=True)
    except Exception as exc:  # another host version's internals: run without its bookkeeping rather than fail
        _host.say(f"the host's model management did not take the DiT ({type(exc).__name__}: {exc}); it will not "
                  "unload it for other models")
