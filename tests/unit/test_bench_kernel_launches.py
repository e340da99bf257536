"""bench/kernel_launches.py's dry run under Triton's CPU interpreter: every launch of every kernel runs through
the benchmark's own path and gives the library launch's numbers."""

import textwrap

from triton_interpreter import run_interpreted

CHECK = textwrap.dedent(
    """
    import kernel_launches

    result = kernel_launches.main(["--tiny", "--reps", "1"])
    kernels = {name.split(":")[0] for name in result["ms"]}
    assert kernels == {"q/k norm + RoPE", "conv features", "readout", "scans", "gather", "quantise rows (5,376)",
                       "norm + modulation + quantise (5,376)", "norm + modulation (5,376)",
                       "residual + norm + modulation + quantise (5,376, with a copy of y)",
                       "softmax gate + quantise (7,168)",
                       "SiLU·up + quantise"}, kernels
    assert all(ms >= 0 for ms in result["ms"].values())
    # a launch changes the tiling, not the arithmetic: bf16 rows agree to a rounding of the result
    worst = {name: d for name, d in result["max_diff"].items() if d > 0.02}
    assert not worst, worst
    # --only runs the parts named, and refuses a name it does not have
    only = kernel_launches.main(["--tiny", "--reps", "1", "--only", "readout", "states"])
    assert {name.split(":")[0] for name in only["ms"]} == {"readout", "scans", "gather"}
    import contextlib, io
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            kernel_launches.main(["--tiny", "--only", "readouts"])
        raise AssertionError("an unknown part ran")
    except SystemExit:
        assert "'readouts'" in said.getvalue() and "'readout', 'states'" in said.getvalue(), said.getvalue()
    print("OK", len(result["max_diff"]))
    """
)


def test_every_launch_runs_and_agrees_with_the_library_launch():
    out = run_interpreted(CHECK).split()
    assert out[-2] == "OK" and int(out[-1]) >= 20
