"""How a DiT runs is one ``RunOptions``, applied in one place (``h3_core.models.run_options``) and read back from the
modules: no code outside the models' own package sets these settings on a model's modules, and what is applied is
what the modules then hold."""

import ast
from dataclasses import replace
from pathlib import Path

import pytest
from tiny_dit import model

from h3_core.errors import H3InputError
from h3_core.models.run_options import RunOptions, apply_run_options, fuse_blocks, run_options_of

ROOT = Path(__file__).resolve().parents[2]
# The modules' attributes that ``apply_run_options`` owns (and ``adaln_tables.keep_adaln_on_host``, also in
# the models' package).
SETTINGS = {"fused", "head_groups", "chunk_rows", "statistics_frames", "check_cancel", "adaln_on_host"}
OWNER = ROOT / "h3_core" / "models"


def settings_set(path: Path) -> list[str]:
    """Each ``something.<setting> = ...`` in ``path`` (assignments to ``self``'s own attributes aside)."""
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
                    and part.attr in SETTINGS
                    and not (isinstance(part.value, ast.Name) and part.value.id == "self")
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{part.attr}")
    return found


def test_only_the_models_package_sets_how_a_model_runs():
    files = [
        p
        for folder in ("h3_core", "nodes", "bench", "tests")
        for p in (ROOT / folder).rglob("*.py")
        if not p.is_relative_to(OWNER)
    ]
    assert [hit for path in files for hit in settings_set(path)] == []


def test_the_scan_finds_a_setting_set_from_outside(tmp_path):
    path = ROOT / "tests" / "unit" / "_scan_probe.py"
    try:
        path.write_text("def f(model):\n    model.blocks[0].attn.head_groups = 2\n    self_like.fused = None\n")
        assert settings_set(path) == ["tests/unit/_scan_probe.py:2 .head_groups", "tests/unit/_scan_probe.py:3 .fused"]
    finally:
        path.unlink()


def test_applied_options_are_what_the_modules_hold():
    m = model(True)
    assert run_options_of(m) == RunOptions()
    wanted = RunOptions(
        blocks_fused="compiled",
        branches_fused="compiled",
        head_groups=2,
        ffn_chunk_rows=7,
        branch_frames=2,
        final_chunk_rows=5,
        check_cancel=print,
    )
    assert apply_run_options(m, wanted) is wanted
    held = run_options_of(m)
    assert held == wanted and held.check_cancel is print
    assert all(b.attn.head_groups == 2 and b.mlp.chunk_rows == 7 and b.fused == "compiled" for b in m.blocks)
    fuse_blocks(m, None)  # one setting changed, the others kept
    assert run_options_of(m) == replace(wanted, blocks_fused=None, branches_fused=None)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(blocks_fused="fast"), "blocks_fused: got 'fast'"),
        (dict(head_groups=0), "head_groups must be between 1 and the model's 3 heads, got 0"),
        (dict(ffn_chunk_rows=0), "ffn_chunk_rows must be a positive number of rows or None, got 0"),
        (dict(branch_frames=1.5), "branch_frames must be a positive number of frames or None, got 1.5"),
        (dict(check_cancel="stop"), "check_cancel must be callable or None, got 'stop'"),
    ],
)
def test_bad_options_are_refused_before_anything_changes(change, message):
    m = model(True)
    with pytest.raises(H3InputError, match=message):
        apply_run_options(m, replace(RunOptions(), **change))
    assert run_options_of(m) == RunOptions()
