"""Loading a DiT checkpoint holds it once: resident memory rises by at most 1.2 × the file's size, measured
on a synthetic 2 GB checkpoint after every weight has been read (bench/checkpoint_memory.py)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "checkpoint_memory.py"


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads resident memory from /proc")
def test_loading_two_gigabytes_costs_at_most_one_point_two_times_the_file(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("checkpoint_memory", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["checkpoint_memory"] = bench
    spec.loader.exec_module(bench)
    result = bench.main(["--gib", "2", "--file", str(tmp_path / "dit.safetensors")])
    assert result["file_bytes"] > 2 * 10**9 and result["checksum_finite"]
    assert result["peak_rise_x_file"]["VmRSS"] <= 1.2
    assert result["final_rise_x_file"]["VmRSS"] <= 1.2
