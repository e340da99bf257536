"""bench/dit_block.py's dry run: the dense and the hybrid block run through the benchmark's own path."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "dit_block.py"


def test_tiny_dry_run_times_both_blocks(tmp_path):
    spec = importlib.util.spec_from_file_location("dit_block", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["dit_block"] = bench
    spec.loader.exec_module(bench)
    out = tmp_path / "block.json"
    result = bench.main(["--tiny", "--reps", "1", "--profile", "--out", str(out)])
    assert out.read_text().strip().startswith("{")
    dense, hybrid = result["blocks"]["dense"], result["blocks"]["hybrid"]
    assert dense["finite"] and hybrid["finite"] and dense["ms"] > 0 and hybrid["ms"] > 0
    assert hybrid["weights_gib"] > dense["weights_gib"]  # the gate, to_out_linear and the branch
    assert hybrid["window_backend"] == "ref"  # auto on the CPU
    for name, block in (("dense", dense), ("hybrid", hybrid)):
        sections = block["profile"]["sections_ms"]
        assert sum(sections.values()) == pytest.approx(block["profile"]["total_ms"], abs=0.05)
        assert sections["linears"] > 0 and sections["attention kernel"] > 0
    assert "linear branch" in hybrid["profile"]["sections_ms"] and "linear branch" not in dense["profile"]["sections_ms"]
    parts = hybrid["profile"]["linear_branch_ms"]
    assert set(parts) == {"featurize", "frame_statistics", "solve", "scan", "gather", "readout and the rest"}
    assert sum(parts.values()) == pytest.approx(hybrid["profile"]["sections_ms"]["linear branch"], abs=0.05)


def test_tiny_dry_run_with_fused_branches(tmp_path):
    spec = importlib.util.spec_from_file_location("dit_block", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["dit_block"] = bench
    spec.loader.exec_module(bench)
    result = bench.main(["--tiny", "--reps", "1", "--profile", "--fused-branch", "eager"])
    hybrid = result["blocks"]["hybrid"]
    assert result["fused_branch"] == "eager" and hybrid["finite"]
    parts = hybrid["profile"]["linear_branch_ms"]
    assert {"featurize", "fused features and readout", "frame_statistics", "solve"} <= set(parts)
    assert sum(parts.values()) == pytest.approx(hybrid["profile"]["sections_ms"]["linear branch"], abs=0.05)
