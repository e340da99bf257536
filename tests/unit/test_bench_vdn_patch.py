"""Dry run of ``bench/vdn_patch.py`` (the pack's VDN-H3 DiT against the native H3 model with the VDN-H3 block
patches, the same weights): on the CPU with the tiny model, every variant evaluated and the two models' velocities
the same to fp32 rounding. As ``test_bench_scripts``: the timings are the benchmark's business, not this test's."""

from test_bench_scripts import HEADER, dry_run

VARIANTS = {"pack", "native", "pack-fused"}


def test_vdn_patch(tmp_path):
    result = dry_run(tmp_path, "vdn_patch.py", "--tiny")
    assert HEADER <= set(result) and set(result["variants"]) == VARIANTS
    assert result["weights_shared"] and result["fused_mode"] == "eager"
    assert set(result["agreement"]) == {"native vs pack", "native vs pack-fused", "pack-fused vs pack"}
    for agreement in result["agreement"].values():
        assert agreement["video"] < 1e-4 and agreement["audio"] < 1e-4
    assert all(len(v["times_s"]) == 1 and v["window_backend"] == "ref" for v in result["variants"].values())
    assert set(result["ratio_native_over_pack"]) == {"native / pack", "native / pack-fused"}
