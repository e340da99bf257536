"""The libraries' first calls made ahead (h3_core.pipeline.first_library_calls): each routine the models run is
called once and timed, and one that fails is reported as such rather than raised (the run that needs it meets the
failure)."""

import pytest
import torch

from h3_core.pipeline import first_library_calls


def test_each_call_is_made_once_and_timed():
    made = first_library_calls.make_first_calls("cpu")
    # the fp8 product needs a GPU with fp8 matrix units; the CPU makes the others
    assert set(made) == {
        "bf16 product",
        "fp16 product",
        "fp32 conv1d",
        "fp32 conv_transpose1d",
        "bf16 depthwise conv2d",
    }
    assert all(seconds is not None and seconds >= 0 for seconds in made.values())


def test_a_call_that_fails_is_reported_not_raised(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(first_library_calls.F, "conv1d", broken)
    made = first_library_calls.make_first_calls(torch.device("cpu"))
    assert made["fp32 conv1d"] is None and made["bf16 product"] is not None


def test_the_calls_split_into_the_loaders_and_the_runs():
    # on the CPU nothing is page-locked: the loaders' stage is empty and the runs' stage is every call
    assert first_library_calls.make_first_calls("cpu", "loaders") == {}
    assert set(first_library_calls.make_first_calls("cpu", "runs")) == set(first_library_calls.make_first_calls("cpu"))
    calls = first_library_calls._calls(torch.device("cpu"))
    assert not set(first_library_calls.LOADER_CALLS) & set(calls)


def test_an_unknown_stage_is_refused():
    with pytest.raises(ValueError, match="stage must be None or one of"):
        first_library_calls.make_first_calls("cpu", "decode")
