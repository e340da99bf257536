"""The memory plan chosen by predicted time (h3_core.memory.predict.plan_for_memory, h3_core.memory.speed): every
way of giving memory up is weighed on the card it runs on, and the quickest that fits is taken — checked against
an enumeration of every head-group level, AdaLN residency and number of resident blocks. Cards are given by the
facts they report (name, compute capability, multiprocessors, clock), for sm80, sm86, sm89, sm90, sm100 and
sm120."""

import itertools
import math

import pytest
import torch

from h3_core.memory.predict import (
    HEAD_GROUP_LEVELS,
    BlockShape,
    ModelForm,
    evaluation_peak,
    head_group_cost,
    plan_for_memory,
    predicted_seconds,
    weight_bytes,
)
from h3_core.memory.speed import H100, CardSpeed, block_operations, has_fp8_matmul
from h3_core.models.dit import DiTConfig
from h3_core.models.low_memory import LowMemory
from h3_core.pipeline.packing import pack_sequence

GiB = 2**30
CFG = DiTConfig(hybrid=True)
FP8 = ModelForm(CFG, hybrid=True, linears="fp8", fused=True)  # fused blocks, fp8 linears
STEPS = 8
# One card of each compute capability, as torch.cuda.get_device_properties reports it (boost clocks), with the
# host copy rate of its usual bus.
CARDS = {
    "sm80": CardSpeed.of("NVIDIA A100-SXM4-80GB", (8, 0), 108, 1.41e9, 25e9),
    "sm86": CardSpeed.of("NVIDIA GeForce RTX 3090", (8, 6), 82, 1.695e9, 22e9),
    "sm89": CardSpeed.of("NVIDIA GeForce RTX 4090", (8, 9), 128, 2.52e9, 22e9),
    "sm90": H100,
    "sm100": CardSpeed.of("NVIDIA B200", (10, 0), 148, 1.965e9, 50e9),
    "sm120": CardSpeed.of("NVIDIA GeForce RTX 5090", (12, 0), 170, 2.407e9, 50e9),
}


@pytest.fixture(scope="module")
def release():
    packed = pack_sequence(torch.ones(300, dtype=torch.long), 102, 48, 84, 575)
    return BlockShape.of(CFG, packed)


def test_the_rates_follow_the_published_peaks():
    # dense bf16 with fp32 accumulation: A100 312, RTX 3090 71, RTX 4090 165, RTX 5090 210 TFLOP/s at these clocks
    published = {"sm80": 312e12, "sm86": 71e12, "sm89": 165e12, "sm120": 209.5e12}
    for name, rate in published.items():
        assert CARDS[name].bf16_ops_per_s == pytest.approx(rate, rel=0.02), name
    assert [has_fp8_matmul(c.capability) for c in CARDS.values()] == [False, False, True, True, True, True]
    # a card newer than the table takes the closest older capability's rate
    newer = CardSpeed.of("NVIDIA RTX PRO 7000", (12, 1), 100, 2e9)
    assert newer.bf16_ops_per_s == 1024 * 100 * 2e9 and not newer.copy_measured
    # a published copy rate is no measurement, and the plan's words say so
    assert not CARDS["sm89"].copy_measured and CARDS["sm89"].describe().endswith("host copies 22 GB/s assumed)")
    measured = CardSpeed.of("NVIDIA H100 80GB HBM3", (9, 0), 132, 1.98e9, 55e9, copy_measured=True)
    assert measured.describe().endswith("host copies 55 GB/s measured)")


def test_fp8_linears_run_at_the_bf16_rate_without_fp8_tensor_cores(release):
    ops = block_operations(release)
    for name, card in CARDS.items():
        fp8, bf16 = card.seconds(*ops, linears="fp8"), card.seconds(*ops, linears="dtype")
        assert (fp8 < bf16) == card.fp8, name


def test_the_ops_of_a_release_block(release):
    linear, attention = block_operations(release)
    rows, h, inner, ffn = 104_266, 5376, 7168, 14336
    assert linear == 2 * rows * (3 * h * inner + inner * h + 3 * h * ffn)
    # a video row sees 17 frames of 1008 rows (its chunk, one each side, the anchors) and the 1450 other rows
    assert release.attended_rows == 17 * 1008 + 1450
    assert attention == 4 * inner * (102 * 1008 * release.attended_rows + 1450 * rows)


def brute_force(shape, budget, card):
    """The quickest fitting choice by trying every one."""
    best = None
    for (_, options), adaln, resident in itertools.product(
        HEAD_GROUP_LEVELS, (False, True), [None, *range(CFG.layers)]
    ):
        peak = evaluation_peak(FP8, shape, options, adaln_on_host=adaln, resident_blocks=resident, steps=STEPS)
        if peak["total"] > budget:
            continue
        seconds = predicted_seconds(FP8, shape, card, options, adaln, resident, steps=STEPS)
        if best is None or seconds < best[0] - 1e-12:
            best = (seconds, options, adaln, resident)
    return best


@pytest.mark.parametrize("card", list(CARDS))
@pytest.mark.parametrize("gib", [32, 24, 16, 12])
def test_the_plan_is_the_quickest_that_fits(release, card, gib):
    budget = gib * GiB * 0.9
    plan = plan_for_memory(FP8, release, budget, steps=STEPS, speed=CARDS[card])
    want = brute_force(release, budget, CARDS[card])
    assert plan.fits and want is not None
    got = predicted_seconds(
        FP8, release, CARDS[card], plan.options, plan.adaln_on_host, plan.resident_blocks, steps=STEPS
    )
    assert got == pytest.approx(want[0], rel=1e-12)
    assert f"predicted {got:.2f} s per evaluation" in plan.extra_time and CARDS[card].name in plan.extra_time


def test_streaming_blocks_is_taken_before_more_head_groups_where_the_compute_hides_the_copies(release):
    uncapped = predicted_seconds(FP8, release, H100, LowMemory(), False, None, steps=STEPS)
    for gib in (24, 16):
        plan = plan_for_memory(FP8, release, gib * GiB * 0.9, steps=STEPS, speed=H100)
        assert plan.options.head_groups <= 2 and plan.resident_blocks is not None, plan.steps
        assert plan.steps[-1].endswith("blocks streamed from host memory")
        seconds = predicted_seconds(
            FP8, release, H100, plan.options, plan.adaln_on_host, plan.resident_blocks, steps=STEPS
        )
        assert seconds <= 1.05 * uncapped


def test_a_slow_bus_makes_streaming_cost_what_the_compute_does_not_hide(release):
    slow = CardSpeed.of(H100.name, H100.capability, 132, 1.98e9, 1e9)
    options, streamed = LowMemory(ffn_chunk_rows=32768, head_groups=2), 10
    fast_s = predicted_seconds(FP8, release, H100, options, False, CFG.layers - streamed, steps=STEPS)
    slow_s = predicted_seconds(FP8, release, slow, options, False, CFG.layers - streamed, steps=STEPS)
    block = H100.seconds(*block_operations(release), linears="fp8")
    copy = slow.copy_seconds(weight_bytes(CFG, linears="fp8").per_block)
    assert copy > block  # a block's copy at 1 GB/s outlasts its compute
    assert slow_s - fast_s >= streamed * (copy - block)
    # so on the slow bus the plan streams fewer blocks, and gives up more of something else
    fast = plan_for_memory(FP8, release, 24 * GiB * 0.9, steps=STEPS, speed=H100)
    slow_plan = plan_for_memory(FP8, release, 24 * GiB * 0.9, steps=STEPS, speed=slow)
    assert slow_plan.fits and slow_plan.resident_blocks > fast.resident_blocks
    assert (slow_plan.options.head_groups, slow_plan.adaln_on_host) > (fast.options.head_groups, fast.adaln_on_host)


def test_head_groups_between_two_measured_levels_cost_between_them():
    assert head_group_cost(2, True) == 0.02 and head_group_cost(4, True) == 0.11 and head_group_cost(8, True) == 0.91
    assert head_group_cost(4, True) < head_group_cost(6, True) < head_group_cost(8, True)
    assert head_group_cost(6, True) == pytest.approx(0.11 + (math.log2(6) - 2) * (0.91 - 0.11))
    assert head_group_cost(4, False) == 0.08


def test_resident_placement_never_streams(release):
    plan = plan_for_memory(FP8, release, 40 * GiB, steps=STEPS, streaming=False)
    assert plan.resident_blocks is None and not any("streamed" in s for s in plan.steps)
