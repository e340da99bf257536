"""The pack's models as ComfyUI's model management sees them, so the host can make room for them and take
them back.

Before a model runs (the DiT, a VAE, the text encoder), its node hands a ``Residency`` to
``comfy.model_management.load_models_gpu``: the host unloads other models until ours fits and lists ours
among its loaded models. Placing the DiT's weights
stays ours (the memory policy in ``h3_core.placement``), so loading is a no-op here, and a VAE is simply
moved to the device; when the host unloads or needs the memory back (``unload_all_models``, "free memory",
another model's load — e.g. the DiT before a long decode) it calls ``detach`` / ``partially_unload`` and the
weights leave the GPU until the model's next use.
"""

from __future__ import annotations

import torch

from . import _host


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Residency:
    parent = None

    def __init__(self, model, load_device, name: str, before_release=None):
        self._model, self.name, self.before_release = model, name, before_release
        self.load_device = torch.device(load_device)
        self.offload_device = torch.device("cpu")

    @property
    def model(self):
        return self._model

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
        if self.before_release is not None:
            self.before_release()
        if self.load_device != self.offload_device:
            self.model.to(self.offload_device)
        _host.say(f"the {self.name} was released from the {self.load_device.type} (the host asked for the memory)")
        return self.model


def hand_over(model, device, name: str, working_bytes: int = 0, before_release=None) -> None:
    """Ask the host to make room for ``model`` and ``working_bytes`` of activations, and to count it among
    its loaded models from now on."""
    import comfy.model_management as mm

    device = torch.device(device)
    residency = getattr(model, "_h3_residency", None)
    if residency is None or residency.load_device != device:
        residency = Residency(model, device, name, before_release)
        model._h3_residency = residency  # lives as long as the model; the host keeps only a weak reference
    try:
        mm.load_models_gpu([residency], memory_required=working_bytes, force_full_load=True)
    except Exception as exc:  # another host version's internals: run without its bookkeeping rather than fail
        _host.say(f"the host's model management did not take the {name} ({type(exc).__name__}: {exc}); it will "
                  "not unload it for other models")


def make_room(holder, device, working_bytes: int) -> None:
    """``hand_over`` for the loader's DiT: a release also undoes the last run's block streaming."""
    def forget_fit():
        if holder.fitted is not None:
            holder.fitted.remove()
            holder.fitted = None

    hand_over(holder.model, device, "DiT", working_bytes, forget_fit)


def text_ready(encoder):
    """The text encoder handed over to the host and back on its device (the host may have released it to
    make room for the DiT or a VAE)."""
    hand_over(encoder.model, encoder.device, "text encoder")
    return encoder.to_device()


def ready(model, name: str):
    """A VAE handed over to the host and on its device again (the host may have released it)."""
    device = _host.torch_device()
    hand_over(model, device, name)
    return model.to(device)
