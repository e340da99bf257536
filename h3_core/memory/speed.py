"""How fast a card computes a DiT block and copies a block from host memory: what ``predict.plan_for_memory``
weighs one way of saving memory against another with.

A block's time is its matrix products' floating-point operations at the card's dense tensor rate (from its compute
capability, its multiprocessors and its clock: ``TENSOR_OPS_PER_SM_CLOCK``) times ``ACHIEVED``, the share of that
rate an evaluation reaches (fitted once, ``ACHIEVED``). The linears run at the fp8 rate
where the model's linears are fp8 and the card has fp8 tensor cores (compute capability 8.9 and later), the
window softmax at the bf16 rate. The host-to-device rate is measured on the card (``measure_host_copy``: a pinned
buffer copied a few times, then given back) or assumed (``ASSUMED_HOST_COPY``).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from ..formats.staged_read import give_back_pinned
from ..models.fp8_linear import linear_form

__all__ = [
    "CardSpeed",
    "TENSOR_OPS_PER_SM_CLOCK",
    "ACHIEVED",
    "ASSUMED_HOST_COPY",
    "has_fp8_matmul",
    "card_speed",
    "measure_host_copy",
    "block_operations",
]

# Dense bf16 tensor operations (2 per multiply-add, fp32 accumulation) per multiprocessor per clock, by compute
# capability, from the vendor's published peak rates over their multiprocessors and boost clocks. GeForce cards of
# compute capability 8.6, 8.9 and 12.0 accumulate in fp32 at half their professional siblings' rate. fp8 doubles it
# where the card has fp8 tensor cores.
TENSOR_OPS_PER_SM_CLOCK = {
    (8, 0): 2048,  # A100: 312 TFLOP/s at 108 SMs × 1.41 GHz
    (8, 6): 1024,  # RTX A6000 (GeForce RTX 30: 512)
    (8, 7): 1024,
    (8, 9): 1024,  # RTX 6000 Ada, L40S (GeForce RTX 40: 512)
    (9, 0): 4096,  # H100 SXM: 989 TFLOP/s at 132 SMs × 1.83 GHz
    (10, 0): 8192,  # B200
    (10, 3): 8192,
    (12, 0): 1024,  # RTX PRO 6000 Blackwell (GeForce RTX 50: 512)
}
GEFORCE_HALVED = {(8, 6), (8, 9), (12, 0)}
# Of the dense rate, what a whole evaluation reaches (its elementwise work, the window softmax's mask and the branch
# included): fitted to the release-size evaluation with fp8 linears and fused blocks of bench/results/dit_step.md
# (H200, whose tensor rate is the H100's, at the clock it reports); its error on that table's bf16 evaluation:
# bench/results/dit_step_caps.md.
ACHIEVED = 0.44
# Pinned host memory to a card over PCIe 4 x16, where nothing was measured.
ASSUMED_HOST_COPY = 20e9


def has_fp8_matmul(capability: tuple[int, int]) -> bool:
    """Whether a card of ``capability`` multiplies e4m3 matrices on its tensor cores (``torch._scaled_mm``)."""
    return linear_form(capability) == "fp8"


@dataclass(frozen=True)
class CardSpeed:
    """A card's dense bf16 tensor rate (operations per second), whether it has fp8 tensor cores, and its
    host-to-device copy rate (bytes per second, ``copy_measured`` if measured)."""

    name: str
    capability: tuple[int, int]
    bf16_ops_per_s: float
    host_copy_bytes_per_s: float
    copy_measured: bool = False

    @classmethod
    def of(
        cls,
        name: str,
        capability: tuple[int, int],
        multiprocessors: int,
        clock_hz: float,
        host_copy_bytes_per_s: float | None = None,
        copy_measured: bool = False,
    ) -> "CardSpeed":
        """From the facts a card reports (``torch.cuda.get_device_properties``); ``host_copy_bytes_per_s`` measured
        on the card (``copy_measured``) or taken from elsewhere (a published rate), ``ASSUMED_HOST_COPY`` if None."""
        capability = tuple(capability)
        per_clock = TENSOR_OPS_PER_SM_CLOCK.get(capability)
        if per_clock is None:  # a newer card: the closest older capability's rate
            older = [c for c in TENSOR_OPS_PER_SM_CLOCK if c <= capability]
            per_clock = TENSOR_OPS_PER_SM_CLOCK[max(older)] if older else 512
        if capability in GEFORCE_HALVED and "geforce" in name.lower():
            per_clock //= 2
        copy = ASSUMED_HOST_COPY if host_copy_bytes_per_s is None else host_copy_bytes_per_s
        return cls(name, capability, per_clock * multiprocessors * clock_hz, copy, copy_measured)

    @property
    def fp8(self) -> bool:
        return has_fp8_matmul(self.capability)

    def seconds(self, linear_ops: float, attention_ops: float, linears: str = "dtype") -> float:
        """Predicted seconds of ``linear_ops`` operations in the linears (fp8 where ``linears="fp8"`` and the card
        has them) and ``attention_ops`` in the window softmax."""
        linear_rate = self.bf16_ops_per_s * (2 if linears == "fp8" and self.fp8 else 1)
        return (linear_ops / linear_rate + attention_ops / self.bf16_ops_per_s) / ACHIEVED

    def copy_seconds(self, nbytes: float) -> float:
        return nbytes / self.host_copy_bytes_per_s

    def describe(self) -> str:
        copy = "measured" if self.copy_measured else "assumed"
        return (
            f"{self.name} (sm{self.capability[0]}{self.capability[1]}, {self.bf16_ops_per_s / 1e12:.0f} TFLOP/s "
            f"bf16, host copies {self.host_copy_bytes_per_s / 1e9:.0f} GB/s {copy})"
        )


# The speed planned with where no card is at hand (tests, the CPU): one H100 SXM at its boost clock.
H100 = CardSpeed.of("NVIDIA H100 80GB HBM3", (9, 0), 132, 1.98e9, 50e9)


def measure_host_copy(device, nbytes: int = 256 * 2**20, repeats: int = 3) -> float:
    """Host-to-device bytes per second from pinned memory on ``device``: the best of ``repeats`` copies of
    ``nbytes`` (the buffers are given back, the pinned one to the system)."""
    device = torch.device(device)
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    try:
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            target.copy_(source, non_blocking=True)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
    finally:
        del source, target
        give_back_pinned()  # the pinned buffer back to the system, not kept in PyTorch's cache
    return nbytes / best


@functools.lru_cache(maxsize=8)
def _card_speed(index: int) -> CardSpeed:
    props = torch.cuda.get_device_properties(index)
    copy = measure_host_copy(torch.device("cuda", index))
    clock = props.clock_rate * 1e3  # kHz
    return CardSpeed.of(props.name, (props.major, props.minor), props.multi_processor_count, clock, copy, True)


def card_speed(device) -> CardSpeed:
    """``device``'s speed (a CUDA card: its copy rate measured once per process), or ``H100`` for any other."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return H100
    return _card_speed(device.index if device.index is not None else torch.cuda.current_device())


def block_operations(shape) -> tuple[float, float]:
    """One block's operations on ``shape`` (``predict.BlockShape``): its linears' (q, k, v and the output
    projection, the FFN) and its attention's, each video row attending ``shape.attended_rows`` rows and every other
    row all of them."""
    T, h, inner, ffn = shape.rows, shape.hidden, shape.inner, shape.ffn
    linear = 2 * T * (h * 3 * inner + inner * h + h * 2 * ffn + ffn * h)
    video = shape.video_rows or T
    attention = 4 * inner * (video * (shape.attended_rows or T) + (T - video) * T)
    return float(linear), float(attention)
