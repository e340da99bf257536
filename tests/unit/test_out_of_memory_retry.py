"""An evaluation that runs out of device memory runs again once the model was placed for less memory
(``run_options.evaluate`` and ``RunOptions.on_out_of_memory``): the clip is the one the smaller placement makes
from the start, the step is not skipped, and where no placement gives up more the error goes through, saying so.
The shortage is injected where a card runs out: inside a block, while the model holds one head group."""

import logging
from dataclasses import replace

import pytest
import torch
from test_compile_fallback import PROMPT
from tiny_dit import model

from h3_core.errors import is_out_of_memory
from h3_core.models.low_memory import LowMemory
from h3_core.models.run_options import apply_low_memory, apply_run_options, run_options_of
from h3_core.pipeline.generate import generate

RUN = dict(frames=22, width=64, height=32, steps=3, seed=5)


def short_of_memory_with_one_head_group(m, error=None):
    """Block 1 runs out of memory whenever the model holds one head group (``error``: what it raises)."""

    def raise_out_of_memory(block, args):
        if run_options_of(m).head_groups == 1:
            raise error or torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    return m.blocks[1].register_forward_pre_hook(raise_out_of_memory)


def generated(m, **options):
    with torch.no_grad():
        return generate(m, PROMPT, **RUN, **options)


def test_the_evaluation_runs_again_placed_for_less_memory(caplog):
    want = generated(apply_low_memory_to(model(True), LowMemory(head_groups=2)))
    m = model(True)
    calls = []

    def fit_smaller():
        calls.append(run_options_of(m).head_groups)
        apply_low_memory(m, LowMemory(head_groups=2))
        return True

    apply_run_options(m, replace(run_options_of(m), on_out_of_memory=fit_smaller))
    short_of_memory_with_one_head_group(m)
    with caplog.at_level(logging.WARNING):
        got = generated(m)
    assert calls == [1]  # once: the first evaluation; the others ran placed for less memory
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert any("ran out of device memory (CUDA out of memory. Tried to allocate 2.00 GiB)" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def apply_low_memory_to(m, options):
    apply_low_memory(m, options)
    return m


def test_with_nothing_more_to_give_up_the_error_goes_through_saying_so():
    m = model(True)
    apply_run_options(m, replace(run_options_of(m), on_out_of_memory=lambda: False))
    short_of_memory_with_one_head_group(m)
    with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 2\.00 GiB \(and no plan that gives up more"):
        generated(m)


def test_without_a_way_to_fit_smaller_the_error_is_the_devices():
    m = model(True)
    short_of_memory_with_one_head_group(m)
    with pytest.raises(torch.OutOfMemoryError, match=r"^CUDA out of memory\. Tried to allocate 2\.00 GiB$"):
        generated(m)


def test_the_smaller_placement_outlasts_the_run_and_its_cancel_hook():
    """The cancel hook the run sets for its blocks is taken off after it; the placement the retry made stays, as
    the model's owner placed it (its next run starts from there)."""
    m = model(True)

    def fit_smaller():
        apply_low_memory(m, LowMemory(head_groups=2))
        return True

    apply_run_options(m, replace(run_options_of(m), on_out_of_memory=fit_smaller))
    short_of_memory_with_one_head_group(m)
    generated(m, check_cancel=lambda: None)
    after = run_options_of(m)
    assert after.head_groups == 2 and after.check_cancel is None and after.on_out_of_memory is fit_smaller


def test_an_out_of_memory_raised_as_a_cuda_error_is_retried_too(caplog):
    """torch 2.9 and later raise some CUDA errors as ``torch.AcceleratorError``: one saying out of memory places
    the model for less as torch's own kind does; any other CUDA error goes through untouched, nothing retried."""
    want = generated(apply_low_memory_to(model(True), LowMemory(head_groups=2)))
    for error, retried in (
        (torch.AcceleratorError("CUDA error: out of memory"), True),
        (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), False),
    ):
        m = model(True)
        calls = []

        def fit_smaller(m=m, calls=calls):
            calls.append(1)
            apply_low_memory(m, LowMemory(head_groups=2))
            return True

        apply_run_options(m, replace(run_options_of(m), on_out_of_memory=fit_smaller))
        short_of_memory_with_one_head_group(m, error)
        if retried:
            got = generated(m)
            assert calls == [1] and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        else:
            with pytest.raises(torch.AcceleratorError, match="illegal memory access"):
                generated(m)
            assert calls == []


def test_what_counts_as_out_of_memory():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(torch.AcceleratorError("CUDA error: out of memory"))
    assert not is_out_of_memory(torch.AcceleratorError("CUDA error: device-side assert triggered"))
    assert not is_out_of_memory(RuntimeError("out of memory"))  # not a device's error
    assert not is_out_of_memory(MemoryError())  # the host's
