"""The block memory model (h3_core.memory.predict) against the peaks measured on the H200, and its shape."""

import json
from pathlib import Path

import pytest
import torch

from h3_core.memory.predict import BlockShape, block_peaks
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
        options = LowMemory(row["ffn_chunk_rows"], row["head_groups"], row.get("branch_frames"))
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


TINY = DiTConfig(hidden=64, layers=3, heads=2, head_dim=32, ffn=96, text_dim=40, freq_dim=16, time_hidden=32,
                 time_embed=16, rope_freqs=4)


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("linears", ["dtype", "fp8"])
def test_weight_bytes_are_what_a_built_model_holds(hybrid, linears):
    from h3_core.models.fp8_linear import quantize_linears
    from h3_core.memory.predict import weight_bytes
    from h3_core.models.dit import H3DiT
    from h3_core.models.precision import keeps_fp32

    cfg = DiTConfig(**{**TINY.__dict__, "hybrid": hybrid})
    model = H3DiT(cfg)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if not keeps_fp32(name):
            tensor.data = tensor.data.to(torch.bfloat16)
    if linears == "fp8":
        quantize_linears(model)
    held = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    assert weight_bytes(cfg, torch.bfloat16, linears=linears).total == held


def test_evaluation_peak_adds_weights_by_residency():
    from h3_core.memory.predict import evaluation_peak, weight_bytes

    cfg = DiTConfig(hybrid=True)
    shape = release_shape()
    full = evaluation_peak(cfg, shape, hybrid=True)
    streamed = evaluation_peak(cfg, shape, hybrid=True, resident_blocks=0, prefetch=1)
    weights = weight_bytes(cfg)
    assert full["weights"] == weights.total
    assert streamed["weights"] == weights.other + 2 * weights.per_block
    assert streamed["activations"] == full["activations"]
    assert full["total"] == full["weights"] + full["activations"]


def test_dit_step_bench_runs_every_variant_on_the_cpu(tmp_path):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("dit_step", RESULTS.parents[1] / "dit_step.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["dit_step"] = bench
    spec.loader.exec_module(bench)
    out = tmp_path / "step.json"
    result = bench.main(["--tiny", "--reps", "1", "--profile", "--low-memory", "2:16", "--out", str(out)])
    assert json.loads(out.read_text())["variants"].keys() == set(bench.VARIANTS)
    for name, stats in result["variants"].items():
        assert stats["finite"] and stats["seconds"] > 0, name
        assert sum(stats["profile_s"].values()) > 0
    assert result["variants"]["fp8-flex"]["predicted_gib"]["weights"] < result["variants"]["bf16-flex"]["predicted_gib"]["weights"]
    # asked fp8 first, the bf16 variant still runs on the unquantised model
    swapped = bench.main(["--tiny", "--reps", "1", "--variants", "fp8-decomposed", "bf16-decomposed"])
    assert list(swapped["variants"]) == ["bf16-decomposed", "fp8-decomposed"]


def test_adaln_on_host_trades_the_projections_for_the_run_tables():
    from h3_core.memory.predict import evaluation_peak, weight_bytes

    cfg = DiTConfig(hybrid=True)
    shape = release_shape()
    weights = weight_bytes(cfg)
    full = evaluation_peak(cfg, shape, hybrid=True)
    hosted = evaluation_peak(cfg, shape, hybrid=True, adaln_on_host=True, steps=50, timesteps_per_step=2)
    tables = 50 * 2 * 6 * 3 * cfg.hidden * 2 * cfg.layers
    assert weights.adaln == 260_112_384 * 2 + 6 * 3 * cfg.hidden * 2  # [96768, 2688] weight and its bias, bf16
    assert hosted["weights"] == full["weights"] - weights.adaln * cfg.layers + tables
    assert full["weights"] - hosted["weights"] > 20 * 2**30  # the released projections are 24 GiB of bf16


def test_the_plan_takes_the_cheapest_steps_that_fit():
    from h3_core.memory.predict import evaluation_peak, plan_for_memory

    cfg, shape = DiTConfig(hybrid=True), release_shape()
    roomy = plan_for_memory(cfg, shape, 139 * GiB, hybrid=True)
    assert roomy.fits and roomy.steps == () and roomy.resident_blocks is None and roomy.extra_time == "none"
    plain = evaluation_peak(cfg, shape, hybrid=True)["total"]
    tight = plan_for_memory(cfg, shape, plain - 1 * GiB, hybrid=True)
    assert tight.fits and tight.steps == ("2 head groups, FFN in 32768-row chunks",)
    assert tight.options.head_groups == 2 and not tight.adaln_on_host
    eighty = plan_for_memory(cfg, shape, 78 * GiB, hybrid=True)  # an 80 GB card less a margin
    assert eighty.fits and eighty.adaln_on_host and eighty.resident_blocks is None
    small = plan_for_memory(cfg, shape, 24 * GiB, hybrid=True)
    assert small.fits and small.resident_blocks is not None and small.resident_blocks < cfg.layers
    assert small.steps[-1].endswith("blocks streamed from host memory") and small.predicted["total"] <= 24 * GiB
    hopeless = plan_for_memory(cfg, shape, 4 * GiB, hybrid=True)
    assert not hopeless.fits and hopeless.resident_blocks == 0


def test_dit_step_plans_for_a_memory_cap(tmp_path):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("dit_step_cap", RESULTS.parents[1] / "dit_step.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["dit_step_cap"] = bench
    spec.loader.exec_module(bench)
    result = bench.main(["--tiny", "--reps", "1", "--variants", "bf16-decomposed", "--cap-gib", "0.0012"])
    plan = result["plan"]
    assert plan["steps"] and plan["resident_blocks"] is not None  # a tiny cap: streaming was needed
    assert result["variants"]["bf16-decomposed"]["finite"]
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--cap-gib", "1"])  # two or more variants with a cap


def test_branch_frames_lower_the_predicted_branch_peak():
    shape = release_shape()
    plain = block_peaks(shape, LowMemory(), hybrid=True)["attention"]
    chunked = block_peaks(shape, LowMemory(branch_frames=10), hybrid=True)["attention"]
    C = shape.branch_rows * shape.inner * 2
    assert plain - chunked == pytest.approx(6.0 * (1 - 10 / 100) * C)
    assert block_peaks(shape, LowMemory(branch_frames=100), hybrid=True)["attention"] == plain


def test_fused_blocks_are_predicted_within_ten_percent_of_their_measured_peaks():
    results = RESULTS.parent
    # the dense block as first fused; the hybrid block since its branch frees its frame states as read
    runs = {"dense": json.loads((results / "dit_block_fused_blocks.json").read_text()),
            "hybrid": json.loads((results / "dit_block_kernels_bf16_states_freed.json").read_text())}
    shape = release_shape()
    for kind, fused in runs.items():
        assert shape.rows == fused["rows"] and fused["fused_blocks"] == "compiled"
        predicted = block_peaks(shape, hybrid=kind == "hybrid", fused=True)["block"] / GiB
        measured = fused["blocks"][kind]["extra_peak_gib"]
        assert predicted == pytest.approx(measured, rel=0.10), kind
        assert predicted < block_peaks(shape, hybrid=kind == "hybrid")["block"] / GiB
    # the whole evaluation (weights + the largest block) against the peaks of the full-size model
    from h3_core.memory.predict import evaluation_peak

    # the latest H200 runs: PyTorch only, with FA4, flex; the first file's bf16 entry ran on the model already
    # quantised (the bench then ran variants in the order asked), so only its fp8 entry is taken
    runs = [("dit_step_kernels_bf16.json", None), ("dit_step_kernels_fp8.json", "fp8-decomposed"),
            ("dit_step_kernels_fa4.json", None), ("dit_step_kernels_flex.json", None),
            ("dit_step_scan_kernel.json", None), ("dit_step_state_kernels.json", None),
            ("dit_step_states_freed.json", None)]
    checked = 0
    for name, only in runs:
        step = json.loads((results / name).read_text())
        assert step["fused_blocks"] == "compiled" and step["rows"] == shape.rows and step["cap_gib"] is None
        for variant, stats in step["variants"].items():
            if only not in (None, variant):
                continue
            linears = "fp8" if variant.startswith("fp8") else "dtype"
            predicted = evaluation_peak(DiTConfig(hybrid=True), shape, hybrid=True, linears=linears, fused=True)
            assert predicted["total"] / GiB == pytest.approx(stats["peak_gib"], rel=0.10), (name, variant)
            checked += 1
    assert checked == 12
    # and the capped runs against the prediction of the plan they ran
    for name in ("dit_step_kernels_cap80.json", "dit_step_kernels_cap24.json"):
        step = json.loads((results / name).read_text())
        (stats,) = step["variants"].values()
        assert stats["peak_gib"] <= step["cap_gib"]
        assert stats["predicted_gib"]["total"] == pytest.approx(stats["peak_gib"], rel=0.10), name
