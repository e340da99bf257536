"""bench/branch_stages.py's dry run: every stage and candidate runs through the benchmark's own path, and the
fused forms agree with the plain ones."""

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "branch_stages.py"


def test_tiny_dry_run_times_every_stage(tmp_path):
    spec = importlib.util.spec_from_file_location("branch_stages", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--tiny", "--reps", "1", "--out", str(tmp_path / "stages.json")])
    assert (tmp_path / "stages.json").read_text().startswith("{")
    assert all(ms >= 0 for ms in result["ms"].values())
    assert {"whole branch (plain)", "whole branch (eager)", "scans (prefix + suffix)"} <= set(result["ms"])
    assert result["max_diff"]["whole branch eager vs plain"] < 1e-5
    assert result["max_diff"]["k features eager vs plain"] < 1e-5
