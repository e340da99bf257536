"""The LoRA node: the DiT patched with a LoRA, as the host's own LoRA loaders patch a MODEL.

It takes the model and returns a clone with the LoRA's updates added as the host's weight patches (its own
``LoRAAdapter``); they are applied when the sampler has the host load the model to its device, and taken off
again when the patches change. So changing a strength or the chain re-runs this node and re-patches the
weights, and never re-reads the checkpoint. ``H3 LoRA (native MODEL)`` does the same on the host's own H3 MODEL,
whose diffusion model's weights the host names under ``diffusion_model.``."""

from __future__ import annotations

import math

from comfy_api.v0_0_2 import io

from ..h3_core.errors import H3InputError
from ..h3_core.formats.lora import lora_patches, read_lora
from . import _host
from .checks import check_model_file, verdict
from .io_types import H3Model
from .native_vdn import NEEDS, native_diffusion_model

LORAS_KEY = "h3_loras"  # the chain of (file, strength) a patched model carries, for the log


def _check_strength(strength) -> None:
    if not isinstance(strength, (int, float)) or not math.isfinite(strength):
        raise H3InputError(
            f"strength: must be a finite number (1 as trained, 0 adds nothing, negative subtracts), got {strength!r}"
        )


def host_patches(patches) -> dict:
    """``h3_core.formats.lora.LoraPatch``es as the host's patches: key (or key with a row offset) → ``LoRAAdapter``
    whose alpha over the rank gives the patch's scale, or the host's ``("diff", (tensor,))`` for a full
    difference."""
    from comfy.weight_adapter.lora import LoRAAdapter

    out = {}
    for patch in patches:
        key = patch.key if patch.rows is None else (patch.key, (0, patch.rows[0], patch.rows[1]))
        if patch.diff is not None:
            out[key] = ("diff", (patch.diff,))
            continue
        rank = patch.down.shape[0]
        out[key] = LoRAAdapter(set(), (patch.up, patch.down, patch.scale * rank, None, None, None))
    return out


class H3LoraLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3LoraLoader",
            display_name="H3 LoRA",
            category=_host.CATEGORY,
            description="Patches the DiT with a LoRA (ComfyUI .safetensors from loras/, native or diffusers module "
            "names) at a strength; chain several. The weights change when the sampler loads the model, so "
            "a new strength never reloads the checkpoint.",
            inputs=[
                H3Model.Input("model"),
                io.Combo.Input("lora_name", options=_host.model_files("loras")),
                io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.05),
            ],
            outputs=[H3Model.Output(display_name="model")],
        )

    @classmethod
    def validate_inputs(cls, lora_name, strength):
        return verdict(
            lambda: _check_strength(strength), lambda: check_model_file("loras", lora_name, "lora_name", "lora")
        )

    @classmethod
    def fingerprint_inputs(cls, lora_name, strength, model=None):
        return _host.file_version("loras", lora_name), strength

    @classmethod
    def execute(cls, model, lora_name, strength):
        return io.NodeOutput(patched_with_lora(model, model.model, "", lora_name, strength))


def _under(prefix: str, key):
    return prefix + key if isinstance(key, str) else (prefix + key[0], *key[1:])


def patched_with_lora(model, target, prefix: str, lora_name: str, strength: float):
    """A clone of the host ``model`` with the LoRA ``lora_name`` as weight patches at ``strength``: its updates
    checked against ``target`` (the network whose weights they change), the keys under ``prefix`` in ``model``."""
    path = _host.model_path("loras", lora_name, "lora_name")
    patches = lora_patches(target, read_lora(path, 1.0), source=f"lora_name ({path.name})")
    patched = model.clone()
    weights = {_under(prefix, key): patch for key, patch in host_patches(patches).items()}
    added = patched.add_patches(weights, strength_patch=float(strength))
    if len(added) != len(patches):
        raise H3InputError(f"lora_name ({path.name}): the host took {len(added)} of its {len(patches)} patches")
    chain = tuple(model.attachments.get(LORAS_KEY, ())) + ((path.name, float(strength)),)
    patched.attachments[LORAS_KEY] = chain
    _host.say(
        f"LoRA {path.name} × {strength:g} patches {len(patches)} weights (applied when the DiT is loaded); "
        f"chain: {', '.join(f'{name} × {s:g}' for name, s in chain)}"
    )
    return patched


class H3LoraLoaderNative(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3LoraLoaderNative",
            display_name="H3 LoRA (native MODEL)",
            category=_host.CATEGORY,
            description="Patches ComfyUI's own MiniMax H3 MODEL with a LoRA its own loaders do not read: VDN-H3's "
            "adapters (PEFT names, under .attn.orig.) or diffusers' module names; ComfyUI's own names work too. "
            "The weights change when the sampler loads the model, so a new strength never reloads anything. Place "
            f"it after H3 VDN-H3 Patch, so that a new strength does not load the branch file again. Needs {NEEDS}.",
            inputs=[
                io.Model.Input("model", tooltip="the MODEL of the host's own H3 loader, patched or not"),
                io.Combo.Input("lora_name", options=_host.model_files("loras")),
                io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.05),
            ],
            outputs=[io.Model.Output(display_name="model")],
        )

    @classmethod
    def validate_inputs(cls, lora_name, strength):
        return H3LoraLoader.validate_inputs(lora_name, strength)

    @classmethod
    def fingerprint_inputs(cls, lora_name, strength, model=None):
        return H3LoraLoader.fingerprint_inputs(lora_name, strength)

    @classmethod
    def execute(cls, model, lora_name, strength):
        diffusion = native_diffusion_model(model)
        return io.NodeOutput(patched_with_lora(model, diffusion, "diffusion_model.", lora_name, strength))
