"""The low-VRAM policy (h3_core.memory.policy): what it decides for a request against the free memory."""

import pytest
import torch

from h3_core.errors import H3InputError
from h3_core.memory.policy import BUDGET_SHARE, RunChoices, decide_placement, place_for_run
from h3_core.memory.predict import BlockShape, ModelForm, evaluation_peak, plan_for_memory
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.models.low_memory import LowMemory
from h3_core.pipeline.packing import pack_sequence

CFG = DiTConfig(
    hidden=64,
    layers=4,
    heads=8,
    head_dim=16,
    ffn=96,
    text_dim=32,
    freq_dim=16,
    time_hidden=24,
    time_embed=20,
    rope_freqs=2,
    hybrid=True,
)


@pytest.fixture(scope="module")
def model():
    with torch.device("meta"):
        return H3DiT(CFG).to(torch.bfloat16)


@pytest.fixture(scope="module")
def form(model):
    return ModelForm.of(model)


@pytest.fixture(scope="module")
def packed():
    return pack_sequence(torch.ones(20, dtype=torch.long), 17, 8, 12, 60)


def peak(packed, **options):
    shape = BlockShape.of(CFG, packed, torch.bfloat16)
    return evaluation_peak(ModelForm(CFG, hybrid=True), shape, steps=10, **options)["total"]


def test_plenty_of_memory_changes_nothing(form, packed):
    plan = decide_placement(form, packed, placement="auto", memory="auto", free_bytes=2**40, steps=10)
    assert plan.steps == () and plan.options == LowMemory() and plan.resident_blocks is None and plan.fits


def test_less_memory_gives_things_up_in_order_until_the_prediction_fits(form, packed):
    plain = peak(packed)
    free = int(0.97 * plain / BUDGET_SHARE)
    plan = decide_placement(form, packed, placement="auto", memory="auto", free_bytes=free, steps=10)
    assert plan.fits and plan.steps and plan.steps[0].startswith("2 head groups")
    assert plan.predicted["total"] < plain and plan.resident_blocks is None
    everything = plan_for_memory(form, BlockShape.of(CFG, packed, torch.bfloat16), 1, steps=10)
    room = int(everything.predicted["total"] / BUDGET_SHARE) + 1  # the most given up fits, just
    tight = decide_placement(form, packed, placement="auto", memory="auto", free_bytes=room, steps=10)
    assert tight.fits and tight.resident_blocks is not None and "streamed" in tight.steps[-1]


def test_the_users_placement_wins(form, packed):
    plain = peak(packed)
    resident = decide_placement(
        form, packed, placement="resident", memory="auto", free_bytes=int(0.2 * plain), steps=10
    )
    assert resident.resident_blocks is None and not any("streamed" in s for s in resident.steps)
    assert not resident.fits  # said to the user by apply_plan
    streamed = decide_placement(form, packed, placement="stream blocks", memory="off", free_bytes=2**40, steps=10)
    assert streamed.resident_blocks == 0 and streamed.options == LowMemory()
    assert streamed.predicted["total"] < peak(packed)
    off = decide_placement(form, packed, placement="auto", memory="off", free_bytes=1, steps=10)
    assert off.options == LowMemory() and off.resident_blocks is None and not off.fits


def test_on_the_cpu_the_model_just_runs_there(packed):
    small = H3DiT(
        DiTConfig(
            hidden=32,
            layers=1,
            heads=2,
            head_dim=16,
            ffn=48,
            text_dim=32,
            freq_dim=8,
            time_hidden=8,
            time_embed=8,
            rope_freqs=2,
        )
    )
    fitted = place_for_run(small, packed, "cpu")
    assert fitted.said == ["running on the CPU; no memory plan needed"] and fitted.offload is None


@pytest.mark.parametrize(
    "placement, memory, message",
    [
        ("everywhere", "auto", r"placement must be one of \['auto', 'resident', 'stream blocks'\], got 'everywhere'"),
        ("auto", "tight", r"memory mode must be one of \['auto', 'off'\], got 'tight'"),
    ],
)
def test_bad_choices_are_named(form, packed, placement, memory, message):
    with pytest.raises(H3InputError, match=message):
        decide_placement(form, packed, placement=placement, memory=memory, free_bytes=2**30, steps=10)
    with pytest.raises(H3InputError, match=message):
        RunChoices(placement, memory)


def test_the_host_is_asked_for_the_runs_activations_of_the_path_it_will_take(packed):
    from h3_core.memory.policy import fuse_for, working_bytes

    with torch.device("meta"):
        fresh = H3DiT(CFG).to(torch.bfloat16)
    shape = BlockShape.of(CFG, packed, torch.bfloat16)
    assert fuse_for(fresh, "cpu") is None  # no CUDA here: the plain path
    plain = evaluation_peak(ModelForm(CFG, hybrid=True), shape)["activations"]
    assert working_bytes(fresh, packed, fused=fuse_for(fresh, "cpu")) == int(plain)
    fused = evaluation_peak(ModelForm(CFG, hybrid=True, fused=True), shape)["activations"]
    assert working_bytes(fresh, packed, fused="compiled") == int(fused) < plain


def test_a_request_no_plan_fits_is_refused_with_what_it_needs(form, packed):
    from h3_core.errors import H3DoesNotFit

    plain = peak(packed)
    with pytest.raises(H3DoesNotFit, match=r"needs about [\d.]+ GiB of device memory even with everything given up"):
        decide_placement(form, packed, placement="auto", memory="auto", free_bytes=int(0.01 * plain), steps=10)
    # within the whole free memory but not its 90 % budget: planned, and said not to fit (apply_plan's lines)
    lowest = decide_placement(form, packed, placement="auto", memory="auto", free_bytes=2**40, steps=10)
    assert lowest.fits
