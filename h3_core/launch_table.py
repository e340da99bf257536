"""Which hand-written Triton kernels run on which GPU architecture, and how each is launched.

A kernel wrapper's written launch (its keyword defaults: tile sizes, warps) is the one measured fastest on sm90.
``ARCHITECTURES`` holds, per compute capability measured, the kernels that lost to their plain form there — not
handed out (``triton_forms.triton_form`` gives None, so the caller runs the plain form) — and the launches that
differ from the written ones. ``bench/kernel_launches.py`` measures a card: every kernel under several launches
beside its plain form, ending with the row this table takes for that card's capability.

An architecture without a row runs every kernel with the written launches: they were not measured there
(``architecture(...).measured_on`` is empty), and the memory model's constants were measured with them. Triton's
CPU interpreter (the tests) takes every kernel with its written launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

__all__ = ["KERNELS", "Architecture", "ARCHITECTURES", "architecture", "launch"]

# Every hand-written kernel the library hands out, as ``module: wrapper names`` (modules relative to h3_core)
KERNELS = MappingProxyType(
    {
        "models.block_triton": (
            "qk_norm_rope_triton",
            "block_norm_triton",
            "swiglu_triton",
            "gated_residual_triton",
            "gate_heads_triton",
        ),
        "models.fp8_triton": ("quantize_rows_triton", "gate_heads_quantize_triton", "swiglu_quantize_triton"),
        "models.branch_triton": (
            "spatial_conv_triton",
            "conv_features_triton",
            "readout_triton",
            "scan_triton",
            "gather_triton",
            "small_inverse_triton",
            "shifted_gram_triton",
        ),
        "models.decoder_triton": ("attention_inputs", "finish"),
        "attention.convert_triton": ("scale_convert_triton",),
    }
)
_NAMES = frozenset(name for names in KERNELS.values() for name in names)


@dataclass(frozen=True)
class Architecture:
    """One compute capability's choices: ``measured_on`` the cards whose runs made them (empty: not measured),
    ``dropped`` the kernels that lost to their plain form there, ``launches`` per kernel the keyword arguments
    that replace its written launch."""

    measured_on: tuple[str, ...] = ()
    dropped: frozenset[str] = frozenset()
    launches: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    def __post_init__(self):
        unknown = (set(self.dropped) | set(self.launches)) - _NAMES
        if unknown:
            raise ValueError(f"launch table: no kernel named {sorted(unknown)}; kernels: {sorted(_NAMES)}")


ARCHITECTURES = MappingProxyType(
    {
        # bench/results/kernel_launches.md: every kernel beat its plain form on the H200, at the launches written
        (9, 0): Architecture(measured_on=("NVIDIA H200",)),
    }
)
UNMEASURED = Architecture()


def architecture(capability: tuple[int, int]) -> Architecture:
    """The choices for a card of ``capability`` (``UNMEASURED`` where none were measured)."""
    return ARCHITECTURES.get(tuple(capability), UNMEASURED)


def launch(kernel: str, capability: tuple[int, int] | None) -> Mapping[str, int] | None:
    """The keyword arguments that launch ``kernel`` on a card of ``capability`` (empty: its written launch), or
    None where it is not run there. ``capability`` None: Triton's CPU interpreter, every kernel as written."""
    if kernel not in _NAMES:
        raise ValueError(f"launch table: no kernel named {kernel!r}; kernels: {sorted(_NAMES)}")
    if capability is None:
        return {}
    arch = architecture(capability)
    if kernel in arch.dropped:
        return None
    return arch.launches.get(kernel, {})
