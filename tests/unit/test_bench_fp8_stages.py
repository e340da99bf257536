"""bench/fp8_stages.py's dry run on the CPU: every stage runs through the benchmark's own path."""


def test_fp8_stages_dry_run_on_the_cpu(tmp_path):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("fp8_stages", Path(__file__).resolve().parents[2] / "bench" / "fp8_stages.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--tiny", "--reps", "1", "--out", str(tmp_path / "fp8.json")])
    assert (tmp_path / "fp8.json").read_text().startswith("{")
    assert len(result["ms"]) == 22 and all(ms >= 0 for ms in result["ms"].values())
    assert set(result["codes_equal"].values()) == {1.0}  # the CPU runs the eager quantiser both ways
