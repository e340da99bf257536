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


def test_the_paired_scan_candidate_equals_the_scan():
    import torch

    from h3_core.models import linear_branch as lb

    spec = importlib.util.spec_from_file_location("branch_stages_scan", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    g = torch.Generator().manual_seed(0)
    T, J = (torch.randn(7, 3, 4, 4, generator=g, dtype=torch.float64) * 0.5 for _ in range(2))
    seed = torch.randn(3, 4, 4, generator=g, dtype=torch.float64)
    for got, want in zip(bench.scan_paired(T, J, seed), lb.scan(T, J, seed)):
        assert (got - want).abs().max() <= 1e-12 * want.abs().max()


def test_the_blocked_inverse_candidate_inverts_positive_definite_matrices():
    import torch

    spec = importlib.util.spec_from_file_location("branch_stages_inverse", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    g = torch.Generator().manual_seed(1)
    for n in (16, 40, 128):  # at the base size, odd halves, the release's head size
        G = torch.randn(3, 2, 4 * n, n, generator=g, dtype=torch.float64)
        M = torch.eye(n, dtype=torch.float64) + G.transpose(-1, -2) @ G * 0.1  # I + A, A = GᵀG as the branch's
        inv = bench.spd_inverse_blocked(M)
        assert (inv - torch.linalg.inv(M)).abs().max() <= 1e-10 * torch.linalg.inv(M).abs().max(), n
