"""Runs with different options interleaved on one model in one process each give their own result, bit for bit
the result of the same run on a fresh model: the window, the window softmax's backend and precision, the compile
mode and the low-memory options of one run leave nothing behind for the next (``pipeline.generate``,
``run_options.options_changed``)."""

import contextlib

import torch
from test_compile_fallback import PROMPT
from tiny_dit import model

from h3_core.attention import WindowSpec
from h3_core.models.run_options import options_changed, run_options_of
from h3_core.pipeline.generate import generate

CANVAS = dict(frames=22, width=64, height=32, steps=2)
FIRST = dict(window=WindowSpec(1, 2, "both"), backend="ref", attention_precision="bf16", compile="off", seed=5)
SECOND = dict(window=WindowSpec(0, 1, "none"), backend="decomposed", attention_precision="fp8", compile="auto", seed=7)


def run(m, options: dict, low_memory: bool = False):
    held = options_changed(m, head_groups=2, ffn_chunk_rows=16) if low_memory else contextlib.nullcontext()
    with held, torch.no_grad():
        return generate(m, PROMPT, **CANVAS, **options)


def same(got, want) -> bool:
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_interleaved_runs_give_each_its_own_result():
    first_alone, second_alone = run(model(True), FIRST), run(model(True), SECOND, low_memory=True)
    assert not same(first_alone, second_alone)
    m = model(True)
    untouched = run_options_of(m)
    seen = []  # the head groups each evaluation ran with
    m.blocks[0].register_forward_pre_hook(lambda block, args: seen.append(block.attn.head_groups))
    for _ in range(2):
        assert same(run(m, FIRST), first_alone)
        assert set(seen) == {1}
        seen.clear()
        assert same(run(m, SECOND, low_memory=True), second_alone)
        assert set(seen) == {2}
        seen.clear()
    assert run_options_of(m) == untouched  # nothing left on the model for the next run
