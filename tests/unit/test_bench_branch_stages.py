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
    assert result["max_diff"]["to_out_linear accumulated vs added"] < 1e-4  # fp32 on the CPU: sums in another order


def test_the_solves_timed_beside_the_library_solve_the_same_system():
    import torch

    from h3_core.models import linear_branch as lb

    spec = importlib.util.spec_from_file_location("branch_stages_solve", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    g = torch.Generator().manual_seed(1)
    G = torch.randn(3, 2, 160, 40, generator=g, dtype=torch.float64)
    A, B = G.transpose(-1, -2) @ G * 0.1, torch.randn(3, 2, 40, 40, generator=g, dtype=torch.float64)
    alpha = torch.rand(3, 2, 40, generator=g, dtype=torch.float64)
    want = lb.solve_reference(alpha, A, B)
    for got in (bench.solve_cholesky(alpha, A, B), bench.solve_cholesky_inverse(alpha, A, B),
                bench.solve_blocked(alpha, A, B, 8), lb.solve(alpha, A, B)):
        for a, b in zip(got, want):
            assert (a - b).abs().max() <= 1e-10 * b.abs().max()
