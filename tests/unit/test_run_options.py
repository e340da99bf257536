"""How a DiT runs is one ``RunOptions`` (``h3_core.models.options``), given with each call and passed down to every
module (``H3DiT.forward(..., run=)``), checked in one place (``run_options.check_run_options``): no module holds any
of it — no code sets these settings on a model's modules, a model holds none of them after an evaluation, and what
is given is what every module runs with."""

import ast
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fused_eager import fused_written
from runs_given import by_module, runs_given
from tiny_dit import model, request

from h3_core.attention import WindowSpec
from h3_core.errors import H3InputError
from h3_core.models.dit import Attention, Block, FinalLayer, SwiGLU
from h3_core.models.hybrid import HybridContext
from h3_core.models.linear_branch import LinearBranch
from h3_core.models.low_memory import LowMemory
from h3_core.models.run_options import Evaluations, RunOptions, check_run_options

ROOT = Path(__file__).resolve().parents[2]
# The run options the modules held before they were given with each call: no module holds any of them now.
RUN_OPTION_ATTRIBUTES = ("fused", "head_groups", "chunk_rows", "statistics_frames", "check_cancel", "on_out_of_memory")
# What code may not set on a model's modules: those, and ``adaln_on_host``, which the models' package alone sets
# (``adaln_tables.keep_adaln_on_host``).
SETTINGS = {*RUN_OPTION_ATTRIBUTES, "adaln_on_host"}
OWNER = ROOT / "h3_core" / "models"
OWNED = {"adaln_on_host"}


def run_option_attributes(m) -> list[str]:
    """Each ``module.<run option>`` that a module of ``m`` holds."""
    return [
        f"{name or type(m).__name__}.{attribute}"
        for name, module in m.named_modules()
        for attribute in RUN_OPTION_ATTRIBUTES
        if hasattr(module, attribute)
    ]


def settings_set(path: Path, settings=SETTINGS, root: Path = ROOT) -> list[str]:
    """Each ``something.<setting> = ...`` in ``path`` (named relative to ``root``) for a setting in ``settings``
    (assignments to ``self``'s own attributes aside)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        for target in targets:
            for part in ast.walk(target):
                if (
                    isinstance(part, ast.Attribute)
                    and part.attr in settings
                    and not (isinstance(part.value, ast.Name) and part.value.id == "self")
                ):
                    found.append(f"{path.relative_to(root)}:{node.lineno} .{part.attr}")
    return found


def test_no_code_sets_how_a_model_runs_on_its_modules():
    files = [p for folder in ("h3_core", "nodes", "bench", "tests") for p in (ROOT / folder).rglob("*.py")]
    # the models' package may set its own (``adaln_on_host``), no run option; everything else none of them
    allowed = {path: OWNED if path.is_relative_to(OWNER) else set() for path in files}
    hits = [hit for path in files for hit in settings_set(path, SETTINGS - allowed[path])]
    assert hits == []


def test_the_scan_finds_a_setting_set_from_outside(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("def f(model):\n    model.blocks[0].attn.head_groups = 2\n    self_like.fused = None\n")
    assert settings_set(path, root=tmp_path) == ["probe.py:2 .head_groups", "probe.py:3 .fused"]


def hybrid_case():
    m = model(True)
    packed, args = request()
    return m, args, HybridContext(packed.layout, WindowSpec(1, 3, "both"), "ref", (0, 4))


def test_given_options_are_what_every_module_runs_with():
    m, args, ctx = hybrid_case()
    assert run_option_attributes(m) == []
    cancels = []
    wanted = RunOptions(
        blocks_fused="compiled",
        branches_fused="compiled",
        head_groups=2,
        ffn_chunk_rows=7,
        branch_frames=2,
        final_chunk_rows=5,
        check_cancel=lambda: cancels.append(1),
    )
    assert check_run_options(wanted, m) is wanted
    given = [mod for mod in m.modules() if isinstance(mod, (Block, Attention, SwiGLU, LinearBranch))]
    finals = [mod for mod in m.modules() if isinstance(mod, FinalLayer)]
    with (
        torch.no_grad(),
        runs_given(given) as seen,
        runs_given(finals, "chunk_rows") as final_rows,
        fused_written(wanted) as fused,
    ):
        assert fused == wanted  # already fused: the same options
        m(*args, hybrid=ctx, run=wanted)
    assert set(by_module(seen)) == set(given)  # every one of them ran
    assert all(r is wanted for _, r in seen)
    assert [rows for _, rows in final_rows] == [5]  # the output heads over five rows at a time
    assert len(cancels) == len(m.blocks)  # before every block
    assert run_option_attributes(m) == []
    # one setting changed, the others kept
    assert wanted.fused(None) == replace(wanted, blocks_fused=None, branches_fused=None)
    assert wanted.fused(None).check_cancel is wanted.check_cancel
    smaller = wanted.with_low_memory(LowMemory(ffn_chunk_rows=3, head_groups=3))
    assert smaller == replace(wanted, ffn_chunk_rows=3, head_groups=3, branch_frames=None)
    assert smaller.low_memory == LowMemory(ffn_chunk_rows=3, head_groups=3)
    assert smaller.check_cancel is wanted.check_cancel


def test_a_model_holds_no_run_options_after_an_evaluation():
    """Evaluations with every option set (fused, in head groups and row chunks, a cancel check and an out-of-memory
    hook) leave no run option on any module: the next run starts from nothing but what it is given."""
    m, args, ctx = hybrid_case()
    assert run_option_attributes(m) == []
    run = RunOptions(
        head_groups=3,
        ffn_chunk_rows=7,
        branch_frames=2,
        final_chunk_rows=5,
        check_cancel=lambda: None,
        on_out_of_memory=lambda: None,
    )
    with torch.no_grad():
        with fused_written(run) as fused:
            Evaluations(m, fused, compile="auto")(*args, hybrid=ctx)
        Evaluations(m, run, compile="off")(*args, hybrid=ctx)
        m(*args, hybrid=ctx, run=run)
    assert run_option_attributes(m) == []


def test_the_attribute_check_finds_a_run_option_held():
    m = model(False)
    setattr(m.blocks[1].attn, "head_groups", 2)  # as code of old did (set so, the scan above passes it by)
    assert run_option_attributes(m) == ["blocks.1.attn.head_groups"]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(blocks_fused="fast"), r"blocks_fused: got 'fast'; allowed: \(None, 'compiled'\)"),
        (dict(branches_fused="on"), r"branches_fused: got 'on'; allowed: \(None, 'compiled'\)"),
        (dict(head_groups=0), "head_groups must be between 1 and the model's 3 heads, got 0"),
        (dict(ffn_chunk_rows=0), "ffn_chunk_rows must be a positive number of rows or None, got 0"),
        (dict(branch_frames=1.5), "branch_frames must be a positive number of frames or None, got 1.5"),
        (dict(check_cancel="stop"), "check_cancel must be callable or None, got 'stop'"),
    ],
)
def test_bad_options_are_refused_before_anything_runs(change, message):
    m = model(True)
    calls = []
    m.register_forward_pre_hook(lambda module, args: calls.append(1))
    bad = replace(RunOptions(), **change)
    with pytest.raises(H3InputError, match=message):
        check_run_options(bad, m)
    with pytest.raises(H3InputError, match=message):
        Evaluations(m, bad)  # the run's evaluations are refused before the first
    assert calls == [] and run_option_attributes(m) == []


def test_a_callable_model_runs_on_the_plain_path_when_compile_is_off():
    """A model that is only a callable of the inputs (no compiled form of its own) is given no options, and with
    ``compile="off"`` nothing it calls may compile either."""
    from h3_core.triton_forms import compiling

    def model(*inputs, **kw):
        return compiling(), inputs, kw

    assert Evaluations(model, compile="off")(1, 2) == (False, (1, 2), {})
    assert Evaluations(model, compile="auto")(1, hybrid=None) == (True, (1,), {"hybrid": None})
