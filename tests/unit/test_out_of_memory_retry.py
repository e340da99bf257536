"""An evaluation that runs out of device memory runs again once the model was placed for less memory
(``run_options.Evaluations`` and ``RunOptions.on_out_of_memory``, which returns the smaller placement's
``LowMemory``): the clip is the one the smaller placement makes from the start, the step is not skipped, the run's
later evaluations keep the smaller options, and where no placement gives up more the error goes through, saying so.
The shortage is injected where a card runs out: inside a block, while the evaluation runs in one head group."""

import logging

import pytest
import torch
from test_compile_fallback import PROMPT
from test_run_options import run_option_attributes
from tiny_dit import model, request

from h3_core.errors import is_out_of_memory
from h3_core.models.low_memory import LowMemory
from h3_core.models.options import RunOptions
from h3_core.models.run_options import Evaluations
from h3_core.pipeline.generate import generate
from h3_core.pipeline.request import ClipRequest, Runner

RUN = dict(frames=22, width=64, height=32, steps=3, seed=5)
SMALLER = LowMemory(head_groups=2)


def short_of_memory_with_one_head_group(m, error=None) -> list:
    """Block 1 runs out of memory whenever it is given one head group (``error``: what it raises); returns the
    ``RunOptions`` it is given, call by call (Block takes them as its 6th argument from ``H3DiT``)."""
    given = []

    def raise_out_of_memory(block, args):
        given.append(args[5])
        if args[5].head_groups == 1:
            raise error or torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    m.blocks[1].register_forward_pre_hook(raise_out_of_memory)
    return given


def generated(m, run: RunOptions | None = None, check_cancel=None):
    """A generation whose every evaluation is given ``run`` (as a placement's options are)."""
    with torch.no_grad():
        return generate(
            m, PROMPT, ClipRequest(**RUN), Runner(before_sampling=lambda packed: run, check_cancel=check_cancel)
        )


def test_the_evaluation_runs_again_placed_for_less_memory(caplog):
    want = generated(model(True), RunOptions().with_low_memory(SMALLER))
    m = model(True)
    calls = []

    def fit_smaller():
        calls.append(given[-1].head_groups)  # the head groups the evaluation ran out of memory with
        return SMALLER

    given = short_of_memory_with_one_head_group(m)
    with caplog.at_level(logging.WARNING):
        got = generated(m, RunOptions(on_out_of_memory=fit_smaller))
    assert calls == [1]  # once: the first evaluation; the others ran placed for less memory
    assert [r.head_groups for r in given] == [1, 2, 2, 2]  # the failed attempt, its rerun and the two later steps
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert any("ran out of device memory (CUDA out of memory. Tried to allocate 2.00 GiB)" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_later_evaluations_of_the_run_keep_the_smaller_options():
    """``Evaluations.run`` after the retry: the run's options with the smaller placement's choices, the hooks kept;
    every later evaluation is given them, and runs as a model given them from the start."""
    packed, args = request()
    with torch.no_grad():
        want = model(True)(*args, run=RunOptions().with_low_memory(SMALLER))
    m = model(True)
    calls = []

    def fit_smaller():
        calls.append(1)
        return SMALLER

    given = short_of_memory_with_one_head_group(m)
    evaluations = Evaluations(m, RunOptions(on_out_of_memory=fit_smaller), compile="off")
    with torch.no_grad():
        first = evaluations(*args)
        assert calls == [1] and evaluations.run == RunOptions(head_groups=2)
        assert evaluations.run.on_out_of_memory is fit_smaller
        later = [evaluations(*args) for _ in range(2)]
    assert calls == [1] and [r.head_groups for r in given] == [1, 2, 2, 2]
    for got in (first, *later):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_with_nothing_more_to_give_up_the_error_goes_through_saying_so():
    m = model(True)
    short_of_memory_with_one_head_group(m)
    with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 2\.00 GiB \(and no plan that gives up more"):
        generated(m, RunOptions(on_out_of_memory=lambda: None))


def test_without_a_way_to_fit_smaller_the_error_is_the_devices():
    m = model(True)
    short_of_memory_with_one_head_group(m)
    with pytest.raises(torch.OutOfMemoryError, match=r"^CUDA out of memory\. Tried to allocate 2\.00 GiB$"):
        generated(m)


def test_the_smaller_placement_keeps_the_runs_cancel_hook():
    """The retry's smaller options keep the run's other options: the cancel hook the run sets for its blocks is
    called before every block of the rerun and of the later evaluations, the out-of-memory hook stays; after the
    run the model holds neither (nor anything else of the run's options)."""
    m = model(True)
    cancels = []

    def fit_smaller():
        return SMALLER

    def check_cancel():
        cancels.append(1)

    given = short_of_memory_with_one_head_group(m)
    generated(m, RunOptions(on_out_of_memory=fit_smaller), check_cancel=check_cancel)
    assert [r.head_groups for r in given] == [1, 2, 2, 2]
    assert all(r.check_cancel is check_cancel and r.on_out_of_memory is fit_smaller for r in given)
    # before each block of the 4 evaluations (the failed one up to block 1)
    assert len(cancels) == 2 + 3 * len(m.blocks)
    assert run_option_attributes(m) == []


def test_an_out_of_memory_raised_as_a_cuda_error_is_retried_too(caplog):
    """torch 2.9 and later raise some CUDA errors as ``torch.AcceleratorError``: one saying out of memory places
    the model for less as torch's own kind does; any other CUDA error goes through untouched, nothing retried."""
    want = generated(model(True), RunOptions().with_low_memory(SMALLER))
    for error, retried in (
        (torch.AcceleratorError("CUDA error: out of memory"), True),
        (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), False),
    ):
        m = model(True)
        calls = []

        def fit_smaller(calls=calls):
            calls.append(1)
            return SMALLER

        short_of_memory_with_one_head_group(m, error)
        if retried:
            got = generated(m, RunOptions(on_out_of_memory=fit_smaller))
            assert calls == [1] and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        else:
            with pytest.raises(torch.AcceleratorError, match="illegal memory access"):
                generated(m, RunOptions(on_out_of_memory=fit_smaller))
            assert calls == []


def test_what_counts_as_out_of_memory():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(torch.AcceleratorError("CUDA error: out of memory"))
    assert not is_out_of_memory(torch.AcceleratorError("CUDA error: device-side assert triggered"))
    assert not is_out_of_memory(RuntimeError("out of memory"))  # not a device's error
    assert not is_out_of_memory(MemoryError())  # the host's
