"""The pack's models held by the host's own model management, ``comfy.model_patcher.ModelPatcher``: the VAEs by
a subclass that reads their weights at the host's first load, the DiT and the text encoder by subclasses whose
loading and unloading place them.

The loader wraps the DiT (in host memory) in an ``H3DiTPatcher``; LoRA nodes clone it and add patches, as the
host's own LoRA loaders do. Before a run the sampler tells the patcher what it will run (``prepare``: the packed
sequence and the user's memory choices), which gives the activations the run needs; it then asks the host to
load the model with ``load_models_gpu(..., memory_required=those activations)``, so the host frees other models
for the activations as well as the weights. The host decides how much of the weights may sit on the device and
calls ``partially_load``; ``load`` plans the run within that room plus the activations it reserved (head groups,
AdaLN projections in host memory, streamed blocks: ``h3_core.memory.policy``), applies the LoRA patches where the
weights will run (fp8 linears re-quantised from the patched weights through their ``convert_weight`` /
``set_weight``) and places the model. When the host needs memory back it calls ``partially_unload`` with the
bytes it wants: more blocks move to pinned host memory and stream, until at least that much is free.

The text encoder loads whole when the host gives it the room and otherwise keeps its decoder layers in host
memory, each visiting the device for its own forward; asked for memory back, it leaves its layers there.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field, replace

import comfy.model_management as mm
import comfy.model_patcher
import torch

from ..h3_core.errors import H3InputError
from ..h3_core.formats.kitchen import is_kitchen_tensor, requantize
from ..h3_core.formats.vae import read_weights
from ..h3_core.memory.offload import block_image_bytes, offload_blocks
from ..h3_core.memory.policy import RunChoices, decide_placement, fuse_for, place_for_run, working_bytes
from ..h3_core.memory.predict import ModelForm
from . import _host

GiB = 2**30
# The host's own record of a backed-up weight (ModelPatcher.patch_weight_to_device makes the same).
_Backup = collections.namedtuple("Dimension", ["weight", "inplace_update"])


@dataclass(frozen=True)
class DiTRun:
    """What the next run of the DiT will be: its packed sequence and the user's choices."""

    packed: object  # h3_core.pipeline.packing.PackedSequence
    memory: str  # "auto" / "off"
    steps: int
    compile: str = "auto"
    attention_precision: str = "bf16"


# After an out-of-memory, what share of the room the last plan counted on the next one may (the memory model's
# prediction was short of what the card held)
OUT_OF_MEMORY_SHARE = 0.8


@dataclass
class _Placement:
    """Where the DiT's weights are now; shared by a patcher and its clones (they hold the same model)."""

    offload: str  # the loader's choice: "auto" / "resident" / "stream blocks"
    run: DiTRun | None = None
    working: int = 0  # the activations asked of the host for the run
    fitted: object = None  # h3_core.memory.apply.FittedModel of the last load
    said: list[str] = field(default_factory=list)
    last_unload: tuple[int, int] | None = None  # (bytes asked, bytes freed) of the last partial unload
    room_share: float = 1.0  # of the room the host gives, what plans count on (less after an out-of-memory)


def _bytes_on(model: torch.nn.Module, device: torch.device) -> int:
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values() if t.device == device)


class H3DiTPatcher(comfy.model_patcher.ModelPatcher):
    """The host's ModelPatcher for the DiT, with loading and unloading that place it per run."""

    @classmethod
    def wrap(cls, model: torch.nn.Module, offload: str, device=None, load_device=None) -> "H3DiTPatcher":
        """The patcher around ``model``, whose weights are on ``device`` (default: the host's offload device), run
        on ``load_device`` (default: the host's device for diffusion models)."""
        model.device = torch.device(device) if device is not None else mm.unet_offload_device()
        run_on = mm.get_torch_device() if load_device is None else torch.device(load_device)
        patcher = cls(model, load_device=run_on, offload_device=mm.unet_offload_device())
        patcher.attachments["h3_placement"] = _Placement(offload)
        return patcher

    @property
    def placement(self) -> _Placement:
        return self.attachments["h3_placement"]

    # ---- the run ----------------------------------------------------------------------------------------

    def prepare(self, run: DiTRun) -> int:
        """Plan ``run`` against the device memory the host could give (free memory less ``--reserve-vram``, plus
        what loaded models hold) and return the activations it needs: the ``memory_required`` to load with."""
        placement = self.placement
        placement.run = run
        device = self.load_device
        fused = fuse_for(self.model, device, run.compile)  # the paths the run will take: the room asked is theirs
        if device.type != "cuda":
            placement.working = working_bytes(self.model, run.packed, run.attention_precision, fused)
            return placement.working
        # This model's weights already on the device count as room, whether or not the host has them on record
        # yet (a model the loader read straight to the GPU is not, before its first run).
        room = self._room_with_own_weights(_host.device_budget(device, keep=(self,)))
        free_bytes = int(room * placement.room_share)
        plan = decide_placement(
            ModelForm.of(self.model, fused, run.attention_precision, device),
            run.packed,
            placement=placement.offload,
            memory=run.memory,
            free_bytes=free_bytes,
            steps=run.steps,
            share=self._rank_share(run.packed),
        )
        placement.working = int(plan.predicted["activations"])
        return placement.working

    def fit(self, run: DiTRun):
        """Plan ``run`` (``prepare``), have the host load the model with the activations it needs, and return the
        ``RunOptions`` every evaluation of the run is given: the placement's, with ``fit_smaller`` to call when an
        evaluation runs out of device memory anyway."""
        mm.load_models_gpu([self], memory_required=self.prepare(run))
        return replace(self.placement.fitted.options, on_out_of_memory=self.fit_smaller)

    def _rank_share(self, packed):
        """This process's share of each evaluation when H3 Multi-GPU spreads them over several GPUs (rank 0's)."""
        from ..h3_core.memory.ranks import rank_shares
        from .ranks import RANKS_KEY

        choice = self.attachments.get(RANKS_KEY)
        if choice is None:
            return None
        return rank_shares(self.model.cfg, int(packed.positions.shape[0]), choice.gpus, choice.softmax_ranks)[0]

    def fit_smaller(self):
        """After an evaluation ran out of device memory: plan again for ``OUT_OF_MEMORY_SHARE`` of the room the last
        plan counted on and place the model so; returns the new plan's ``LowMemory`` (``run_options.Evaluations``
        then runs the evaluation again with it), or None, nothing changed, where that plan holds the weights and the
        activations as the last one did."""
        placement = self.placement
        if placement.run is None or placement.fitted is None or self.load_device.type != "cuda":
            return None
        before = placement.fitted.layout
        placement.room_share *= OUT_OF_MEMORY_SHARE
        torch.cuda.empty_cache()
        self.load(self.load_device, full_load=True)
        if placement.fitted.layout == before:
            return None
        _host.say("out of device memory: placed again for less — " + "; ".join(placement.said))
        return placement.fitted.plan.options

    def said(self) -> list[str]:
        """What the last load did, in the words the user is shown."""
        return list(self.placement.said)

    # ---- loading ----------------------------------------------------------------------------------------

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        device = torch.device(device_to) if device_to is not None else self.load_device
        placement = self.placement
        run = placement.run
        if run is None:
            raise RuntimeError("the DiT was loaded without a run: call prepare() before load_models_gpu")
        with self.use_ejected():
            for key in list(self.patches):
                if key not in self.backup:
                    self._patch(key, device)
            # The room for the run: with a full load what the device has free (less --reserve-vram) besides this
            # model's own weights; otherwise the weights the host allows plus the activations it reserved.
            if full_load or not lowvram_model_memory:
                room = self._room_with_own_weights(_host.free_memory(device))
            else:
                room = lowvram_model_memory + placement.working
            room = int(room * placement.room_share)
            # place_for_run counts this model's bytes already on the device as free: they are taken out here.
            fitted = place_for_run(
                self.model,
                run.packed,
                device,
                RunChoices(placement.offload, run.memory, run.compile, run.attention_precision),
                free_bytes=max(room - _bytes_on(self.model, device), 0),
                steps=run.steps,
                current=placement.fitted,
                share=self._rank_share(run.packed),
            )
            placement.fitted, placement.said = fitted, list(fitted.said)
            self.model.device = device
            self.model.model_loaded_weight_memory = self._device_weight_bytes()
            self.model.current_weight_patches_uuid = self.patches_uuid

    def _room_with_own_weights(self, available: int) -> int:
        """``available`` (the host's free memory less the reserve; below zero where this model's weights already
        reach into the reserve) plus the weights this model holds on the device: the room its plan may fill."""
        return max(available + self._device_weight_bytes(), 0)

    def _device_weight_bytes(self) -> int:
        """Bytes of this model's weights the device holds now (with streaming: the resident part and the slot
        pool; AdaLN projections kept in host memory excluded). Counted from what the placement did, so the
        same on a GPU and on a CPU-only host."""
        model = self.model
        if model.device != self.load_device and self.placement.fitted is None:
            return 0
        total = sum(
            t.numel() * t.element_size() for t in {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
        )
        on_host = 0
        if getattr(model, "adaln_on_host", False):
            on_host = sum(p.numel() * p.element_size() for b in model.blocks for p in b.adaln_proj.parameters())
        fitted = self.placement.fitted
        if fitted is not None and fitted.offload is not None:
            stats = fitted.offload.stats
            return stats.resident_bytes + stats.slot_bytes - on_host
        return total - on_host

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        # The host's own form moves the whole model to the host to take patches off; here only the patched
        # weights change, and the rest stays where it is.
        with self.use_ejected(skip_and_inject_on_exit_only=True):
            before = self.model.model_loaded_weight_memory
            current = self.model.current_weight_patches_uuid
            if current is not None and current != self.patches_uuid:
                self._release_streaming()
                self.unpatch_model(None, unpatch_weights=True)
            self.patch_model(load_weights=False)
            budget = before + extra_memory
            self.load(
                device_to,
                lowvram_model_memory=budget,
                force_patch_weights=force_patch_weights,
                full_load=budget >= self.model_size(),
            )
            return self.model.model_loaded_weight_memory - before

    def _patch(self, key: str, device: torch.device) -> None:
        """Apply ``key``'s patches through the host (``patch_weight_to_device``). A quantised layer's scales
        change with its codes, so they are backed up beside the weight and restored with it."""
        module_name, _, name = key.rpartition(".")
        module = self.model.get_submodule(module_name)
        weight = getattr(module, name)
        if is_kitchen_tensor(weight):
            self._patch_kitchen(key, module, name, weight, device)
            return
        scale = getattr(module, f"{name}_scale", None)
        if hasattr(module, f"set_{name}") and isinstance(scale, torch.Tensor):
            self.backup[f"{key}_scale"] = _Backup(scale.detach().to(self.offload_device, copy=True), True)
        # AdaLN projections kept in host memory are patched there: the run reads them once, to make its tables.
        on_host = ".adaln_proj." in key and getattr(self.model, "adaln_on_host", False)
        self.patch_weight_to_device(key, device_to=None if on_host else device)

    def _patch_kitchen(self, key: str, module, name: str, weight, device: torch.device) -> None:
        """A layer kept as a comfy-kitchen weight: the library dequantises it in fp32 on ``device``, the host's
        own patch arithmetic (``comfy.lora.calculate_weight``) adds the patches, and the library quantises the
        result afresh in the layer's own layout, as the host's ``set_weight`` does for its quantised layers.
        The original stays in the host's backup, which its unpatch puts back as it was."""
        import comfy.lora

        self.backup[key] = _Backup(weight.to(self.offload_device), False)
        on_device = weight.to(device)
        dense = on_device.dequantize().to(torch.float32)
        merged = comfy.lora.calculate_weight(self.patches[key], dense, key)
        setattr(module, name, torch.nn.Parameter(requantize(on_device, merged, on_device.dtype), requires_grad=False))

    # ---- unloading --------------------------------------------------------------------------------------

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        """Free at least ``memory_to_free`` bytes of the device by streaming more blocks from host memory (the
        blocks nearest the end first); returns the bytes freed."""
        device = self.load_device
        placement = self.placement
        with self.use_ejected():
            before = self._device_weight_bytes()
            blocks = self.model.blocks
            fitted = placement.fitted
            current = fitted.offload.stats.resident_blocks if fitted is not None and fitted.offload else len(blocks)
            resident = self._resident_after_freeing(current, memory_to_free)
            if resident < current and fitted is not None:
                fitted.remove(streamed_to=self.offload_device)
                try:
                    fitted.offload = offload_blocks(self.model, device=device, resident_blocks=resident, prefetch=1)
                    fitted.plan = replace(fitted.plan, resident_blocks=resident)
                except H3InputError as exc:  # nothing streams: the host unloads the model whole instead
                    _host.say(f"the DiT cannot free part of its weights ({exc})")
                    resident = current
            self.model.model_loaded_weight_memory = self._device_weight_bytes()
            freed = before - self.model.model_loaded_weight_memory
        placement.last_unload = (int(memory_to_free), int(freed))
        _host.say(
            f"the DiT freed {freed / GiB:.2f} GiB of the {memory_to_free / GiB:.2f} GiB the host asked for: "
            f"{resident} of {len(blocks)} blocks stay on the {device.type}, the others stream from host memory"
        )
        return freed

    def _resident_after_freeing(self, current: int, wanted: int) -> int:
        """The most blocks that can stay on the device with at least ``wanted`` bytes freed, counting the slots
        the streamed blocks pass through (two of the largest image, prefetching one block) — 0 if even streaming
        every block frees less: the host then unloads the model whole."""
        blocks = list(self.model.blocks)
        sizes = [
            sum(t.numel() * t.element_size() for t in {id(t): t for t in (*b.parameters(), *b.buffers())}.values())
            for b in blocks
        ]
        images = [block_image_bytes(b) for b in blocks]

        def slots(resident):
            streamed = images[resident:]
            return min(2, len(streamed)) * max(streamed, default=0)

        for resident in range(current - 1, -1, -1):
            if sum(sizes[resident:current]) + slots(current) - slots(resident) >= wanted:
                return resident
        return 0

    def detach(self, unpatch_all=True):
        if unpatch_all:  # a full unload; without it the host only drops a clone's entry, the model stays
            from .ranks import SOURCE_KEY, close_group_of

            close_group_of(self.attachments.get(SOURCE_KEY), "the host unloaded the DiT they hold a copy of")
            self._release_streaming(to_host=True)
            self.placement.fitted = None
            _host.say(f"the DiT was unloaded from the {self.load_device.type} (the host asked for the memory)")
        return super().detach(unpatch_all)

    def _release_streaming(self, to_host: bool = False) -> None:
        """Stop streaming blocks: the resident part stays where it is and the streamed blocks become plain host
        tensors again (or everything goes to the host)."""
        fitted = self.placement.fitted
        if fitted is not None:
            if to_host:
                fitted.remove(self.offload_device)
            else:
                fitted.remove(streamed_to=self.offload_device)
            self.placement.fitted = None


class _EncoderModule(torch.nn.Module):
    """The text encoder's model as a plain module the host can hold and annotate (a transformers model's
    ``device`` is read-only)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.qwen = model


@dataclass
class _EncoderState:
    encoder: object  # h3_core.pipeline.text_encoder.TextEncoder
    offload: str  # "auto" / "none" / "layers"


class TextEncoderPatcher(comfy.model_patcher.ModelPatcher):
    """The host's ModelPatcher for the text encoder: loaded whole when the host gives it the room, else with its
    decoder layers left in host memory, each visiting the device for its own forward."""

    @classmethod
    def wrap(cls, encoder, offload: str, device=None) -> "TextEncoderPatcher":
        """``device``: where it runs (the host's text-encoder device by default)."""
        patcher = cls(
            _EncoderModule(encoder.model),
            load_device=mm.text_encoder_device() if device is None else device,
            offload_device=mm.text_encoder_offload_device(),
        )
        patcher.attachments["h3_text_encoder"] = _EncoderState(encoder, offload)
        return patcher

    @property
    def encoder(self):
        return self.attachments["h3_text_encoder"].encoder

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        encoder, offload = self.encoder, self.attachments["h3_text_encoder"].offload
        device = torch.device(device_to) if device_to is not None else self.load_device
        roomy = full_load or not lowvram_model_memory or lowvram_model_memory >= encoder.resident_bytes
        stream = offload == "layers" or (offload == "auto" and not roomy)
        with self.use_ejected():
            encoder.place(device, stream=stream)
        self.model.device = device
        self.model.model_loaded_weight_memory = encoder.kept_bytes if stream else encoder.resident_bytes
        self.model.current_weight_patches_uuid = self.patches_uuid
        if stream:
            _host.say(
                f"the text encoder's {len(encoder.language_model.layers)} decoder layers stay in host memory "
                f"and visit the {device.type} one at a time ({encoder.resident_bytes / GiB:.1f} GiB held, "
                f"{lowvram_model_memory / GiB:.1f} GiB given)"
            )

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        """Leave the decoder layers in host memory (they stream from then on): frees their bytes."""
        encoder = self.encoder
        before = self.model.model_loaded_weight_memory
        if not encoder.streamed:
            with self.use_ejected():
                encoder.place(self.load_device, stream=True)
        self.model.model_loaded_weight_memory = encoder.kept_bytes
        return before - encoder.kept_bytes


def load_text_encoder(patcher: TextEncoderPatcher):
    """The text encoder, loaded by the host (which frees other models for it); its ``encode`` runs there."""
    mm.load_models_gpu([patcher])
    return patcher.encoder


class VAEPatcher(comfy.model_patcher.ModelPatcher):
    """The host's ModelPatcher for a VAE the loader left in its file (``load_model(..., device="meta")``): the
    host's first load of it reads the weights straight to where it loads them (a GPU through the staged reader,
    not a copy of host memory), so a VAE never run costs nothing and one run costs one read."""

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False, **kwargs):
        if read_weights(self.model, device_to if device_to is not None else self.load_device):
            self.size = 0  # the host measures it again (a quantised file's layers are smaller than their meta)
        return super().load(device_to, lowvram_model_memory, force_patch_weights, full_load, **kwargs)


def load_vae(patcher, working_bytes: int = 0):
    """A VAE (the host's ModelPatcher around it), loaded whole by the host with ``working_bytes`` of room for
    its activations; returns the module."""
    mm.load_models_gpu([patcher], memory_required=int(working_bytes), force_full_load=True)
    return patcher.model
