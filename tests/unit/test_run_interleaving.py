"""Runs with different options interleaved on one model in one process each give their own result, bit for bit
the result of the same run on a fresh model: the window, the window softmax's backend and precision, the compile
mode and the ``RunOptions`` of one run (given with each of its evaluations, ``H3DiT.forward(..., run=)``) leave
nothing behind for the next (``pipeline.generate``, ``run_options.Evaluations``)."""

import torch
from test_compile_fallback import PROMPT
from test_run_options import run_option_attributes
from tiny_dit import model, request

from h3_core.attention import WindowSpec
from h3_core.models.hybrid import HybridContext
from h3_core.models.options import PLAIN, RunOptions
from h3_core.pipeline.generate import generate
from h3_core.pipeline.request import ClipRequest, Runner
from h3_core.triton_forms import plain_path

CANVAS = dict(frames=22, width=64, height=32, steps=2)
FIRST = dict(window=WindowSpec(1, 2, "both"), backend="ref", attention_precision="bf16", compile="off", seed=5)
SECOND = dict(window=WindowSpec(0, 1, "none"), backend="decomposed", attention_precision="fp8", compile="auto", seed=7)
LOW_MEMORY = RunOptions(head_groups=2, ffn_chunk_rows=16)


def run(m, options: dict, run_options: RunOptions | None = None):
    """A generation with ``options``, every evaluation given ``run_options`` (as a placement gives its own)."""
    with torch.no_grad():
        return generate(m, PROMPT, ClipRequest(**CANVAS, **options), Runner(before_sampling=lambda packed: run_options))


def same(got, want) -> bool:
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_interleaved_runs_give_each_its_own_result():
    first_alone, second_alone = run(model(True), FIRST), run(model(True), SECOND, LOW_MEMORY)
    assert not same(first_alone, second_alone)
    m = model(True)
    seen = []  # the head groups each evaluation's blocks ran with
    m.blocks[0].register_forward_pre_hook(lambda block, args: seen.append(args[5].head_groups))
    for _ in range(2):
        assert same(run(m, FIRST), first_alone)
        assert set(seen) == {1}
        seen.clear()
        assert same(run(m, SECOND, LOW_MEMORY), second_alone)
        assert set(seen) == {2}
        seen.clear()
    assert run_option_attributes(m) == []  # nothing left on the model for the next run


# each differs from the others in what it gives up or fuses
OPTIONS = (
    PLAIN,
    RunOptions(head_groups=3, ffn_chunk_rows=7, branch_frames=3, final_chunk_rows=5),
    RunOptions(head_groups=2, branch_frames=2).fused("compiled"),
    RunOptions(branches_fused="compiled", ffn_chunk_rows=11),
)


def test_interleaved_evaluations_with_different_options_each_give_their_own_result():
    """Evaluations of one model with different ``RunOptions``, one after another in turn, each equal the same
    evaluation of a fresh model given only those options (the fused ones as written, on the plain path)."""
    packed, args = request()
    ctx = HybridContext(packed.layout, WindowSpec(1, 3, "both"), "ref", (0, 4))

    def evaluation(m, options):
        with torch.no_grad(), plain_path():  # "compiled" runs the fused forms as written (tests/fused_eager.py)
            return m(*args, hybrid=ctx, run=options)

    alone = [evaluation(model(True), options) for options in OPTIONS]
    assert not any(same(alone[i], alone[j]) for i in range(len(alone)) for j in range(i))
    m = model(True)
    for _ in range(2):
        for options, want in zip(OPTIONS, alone, strict=True):
            assert same(evaluation(m, options), want)
    for options, want in zip(reversed(OPTIONS), reversed(alone)):
        assert same(evaluation(m, options), want)
    assert run_option_attributes(m) == []
