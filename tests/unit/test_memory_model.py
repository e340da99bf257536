"""The block memory model (h3_core.memory_model) against the peaks measured on the H200, and its shape."""

import json
from pathlib import Path

import pytest
import torch

from h3_core.memory_model import BlockShape, block_peaks
from h3_core.models.dit import DiTConfig
from h3_core.models.low_memory import LowMemory
from h3_core.pipeline.packing import pack_sequence

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "block_memory.json"
GiB = 2**30


def release_shape(frames=102):
    packed = pack_sequence(torch.ones(300, dtype=torch.long), frames, 48, 84, 575)
    return BlockShape.of(DiTConfig(), packed)


def test_predictions_are_within_ten_percent_of_every_measured_peak():
    measured = json.loads(RESULTS.read_text())["rows"]
    assert len(measured) >= 16 and {r["frames"] for r in measured} >= {102, 52}
    for row in measured:
        shape = release_shape(row["frames"])
        assert shape.rows == row["rows"]
        options = LowMemory(row["ffn_chunk_rows"], row["head_groups"])
        predicted = block_peaks(shape, options, hybrid=row["kind"] == "hybrid")
        for phase in ("attention", "ffn", "block"):
            assert predicted[phase] / GiB == pytest.approx(row["measured_gib"][phase], rel=0.10), (row, phase)


def test_memory_is_linear_in_the_clip_and_falls_with_each_option():
    short, long = release_shape(52), release_shape(102)
    for hybrid in (False, True):
        plain_short = block_peaks(short, hybrid=hybrid)["block"]
        plain_long = block_peaks(long, hybrid=hybrid)["block"]
        assert plain_long / plain_short == pytest.approx(long.rows / short.rows, rel=0.1)
        peaks = [block_peaks(long, LowMemory(None, g), hybrid=hybrid)["attention"] for g in (1, 2, 4, 8)]
        assert peaks == sorted(peaks, reverse=True)
        ffn = [block_peaks(long, LowMemory(r, 1), hybrid=hybrid)["ffn"] for r in (None, 65536, 16384, 4096)]
        assert ffn == sorted(ffn, reverse=True)
    assert block_peaks(long, hybrid=True)["block"] > block_peaks(long, hybrid=False)["block"]


def test_the_measuring_script_runs_on_the_cpu():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("block_memory", RESULTS.parents[1] / "block_memory.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["block_memory"] = bench
    spec.loader.exec_module(bench)
    result = bench.main(["--tiny", "--frames", "12", "--variants", "1:0", "2:16"])
    assert len(result["rows"]) == 4
    assert all(r["predicted_gib"]["block"] > 0 for r in result["rows"])
