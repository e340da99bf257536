"""Dry run of ``bench/vdn_patch.py`` (the pack's VDN-H3 DiT against the native H3 model with the VDN-H3 block
patches, the same weights): on the CPU with the tiny model, every variant evaluated and the two models' velocities
the same to fp32 rounding. As ``test_bench_scripts``: the timings are the benchmark's business, not this test's."""

from test_bench_scripts import HEADER, dry_run

VARIANTS = {"pack", "pack-branch-fused", "pack-fused", "native"}


def test_vdn_patch(tmp_path):
    result = dry_run(tmp_path, "vdn_patch.py", "--tiny")
    assert HEADER <= set(result) and set(result["variants"]) == VARIANTS
    assert result["weights_shared"] and result["fused_mode"] == "eager"
    assert set(result["agreement"]) == {
        "native vs pack",
        "native vs pack-branch-fused",
        "native vs pack-fused",
        "pack-branch-fused vs pack",
        "pack-fused vs pack",
    }
    for agreement in result["agreement"].values():
        assert agreement["video"] < 1e-4 and agreement["audio"] < 1e-4
    assert all(len(v["times_s"]) == 1 and v["window_backend"] == "ref" for v in result["variants"].values())
    assert set(result["ratio_native_over_pack"]) == {f"native / {name}" for name in VARIANTS - {"native"}}
    # block 0's attention alone: the pack's two forms, the patch's with comfy-kitchen's norm/rotation and the plain one
    assert result["native_norm_rope"] == "comfy-kitchen rms_rope_split_half"
    assert set(result["attention_parts"]) == {"pack", "pack-branch-fused", "native", "native-plain-rope"}
    assert all(len(p["times_s"]) == 1 and p["seconds"] > 0 for p in result["attention_parts"].values())
