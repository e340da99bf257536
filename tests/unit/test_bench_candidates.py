"""bench/candidate_kernels.py against the library's forms, under Triton's CPU interpreter."""

import textwrap

from triton_interpreter import run_interpreted

CHECK = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "bench")
    import torch
    from candidate_kernels import spatial_conv_triton
    from h3_core.models.branch_fused import spatial_conv

    g = torch.Generator().manual_seed(0)
    k = torch.randn(4, 35, 3, 40, generator=g)[:, :, 1]  # k of a fused projection [F, S, 3, C]; a 5 x 7 grid
    weight = torch.randn(40, 1, 5, 5, generator=g)
    want = spatial_conv(k.contiguous(), weight, (5, 7))
    for block_c in (16, 64):  # channel tiles that do and do not divide C
        got = spatial_conv_triton(k, weight, (5, 7), block_c, 4)
        assert got.shape == (4, 35, 40) and got.is_contiguous()
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), block_c
    print("OK")
    """
)


def test_candidate_spatial_conv_under_interpreter_matches_the_library_form():
    assert run_interpreted(CHECK).split()[-1] == "OK"


SWIGLU_CHECK = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "bench")
    import torch
    from candidate_kernels import swiglu_quantize_triton
    from h3_core.fp8_linear import _SMALLEST_SCALE, quantize_rows_reference
    from h3_core.models.block_fused import swiglu_

    # fp32 rows: the interpreter emulates bf16 rounding by truncation, so the bf16 case runs on the GPU only
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(19, 2 * 300, generator=g) * torch.logspace(-2, 2, 19)[:, None]
    gate_up[4] = 0
    quotients, scale = swiglu_quantize_triton(gate_up, _SMALLEST_SCALE, torch.float32)
    codes, ref_scale = quantize_rows_reference(swiglu_(gate_up.clone()))
    assert quotients.shape == (19, 300) and scale.shape == (19, 1)
    # x·sigmoid(x) here, x / (1 + exp(-x)) in the written function: a few fp32 roundings apart
    assert ((scale - ref_scale).abs() <= ref_scale * 1e-6).all()
    assert ((quotients - codes.float()).abs() <= 448 / 16).all()  # within one e4m3 step of the reference codes
    assert scale[4].item() == _SMALLEST_SCALE and not quotients[4].any()
    print("OK")
    """
)


def test_candidate_swiglu_quantiser_under_interpreter_matches_the_two_step_path():
    assert run_interpreted(SWIGLU_CHECK).split()[-1] == "OK"


def test_fp8_stages_dry_run_on_the_cpu(tmp_path):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("fp8_stages", Path(__file__).resolve().parents[2] / "bench" / "fp8_stages.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--tiny", "--reps", "1", "--out", str(tmp_path / "fp8.json")])
    assert (tmp_path / "fp8.json").read_text().startswith("{")
    assert len(result["ms"]) == 8 and all(ms >= 0 for ms in result["ms"].values())
    assert set(result["codes_equal"].values()) == {1.0}  # the CPU runs the eager quantiser both ways
