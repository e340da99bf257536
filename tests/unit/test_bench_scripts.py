"""Dry runs of the benchmarks in ``bench/`` that run on the CPU: each script runs as a subprocess with the small
arguments it offers for that, must exit 0 and write its JSON with the top-level keys its results are read by. What
the numbers say is the benchmarks' business (``bench/results``), not these tests': they only keep the scripts
runnable. The scripts that need CUDA (``vae_decode.py``, ``decode_streaming.py``, ``attention_configs.py``) and
those whose smallest run is too long for a unit test (``lora_repatch.py`` writes a checkpoint of the release width,
``text_encoder_memory.py`` a synthetic encoder with Qwen's whole vocabulary, loaded twice) have no dry run here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADER = {"command", "device", "torch", "date"}


def dry_run(tmp_path, script: str, *args: str, env: dict | None = None, timeout: int = 300) -> dict:
    """Run ``bench/<script> *args --out <tmp>/<script>.json`` from the repository root; its JSON."""
    out = tmp_path / f"{Path(script).stem}.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, **(env or {})),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def host_tokenizer() -> Path:
    """The host's Qwen BPE folder, or a skip when the test host is not installed."""
    from comfy_host import comfyui_root

    try:
        return comfyui_root() / "comfy" / "text_encoders" / "qwen25_tokenizer"
    except RuntimeError as exc:
        pytest.skip(str(exc))


def test_window_attention(tmp_path):
    result = dry_run(tmp_path, "window_attention.py", "--smoke", "--heads", "1", "--reps", "1", "--variants", "ours")
    assert HEADER <= set(result) and {"runs", "markdown"} <= set(result)


def test_dit_block(tmp_path):
    result = dry_run(tmp_path, "dit_block.py", "--tiny", "--reps", "1", "--profile")
    assert HEADER <= set(result) and {"rows", "blocks"} <= set(result)


def test_dit_step(tmp_path):
    result = dry_run(tmp_path, "dit_step.py", "--tiny", "--reps", "1", "--variants", "fp8-decomposed")
    assert HEADER <= set(result) and {"rows", "variants"} <= set(result)


def test_dit_step_with_the_fp8_window_softmax(tmp_path):
    args = ("--tiny", "--reps", "1", "--variants", "bf16-decomposed", "--attention-precision", "bf16", "fp8")
    variants = dry_run(tmp_path, "dit_step.py", *args)["variants"]
    assert set(variants) == {"bf16-decomposed", "bf16-decomposed/attention-fp8"}
    fp8 = variants["bf16-decomposed/attention-fp8"]
    assert (fp8["attention_precision"], fp8["window_kernel"]) == ("fp8", "emulated")


def test_fp8_attention(tmp_path):
    result = dry_run(tmp_path, "fp8_attention.py", "--tiny", "--reps", "1", "--steps", "1")
    assert HEADER <= set(result) and result["fp8_kernel"] == "emulated"
    calls, model = result["calls"], result["model"]
    for kind in ("random", "outliers"):
        assert 0 < calls[kind]["bf16_rel_err_vs_fp32"] < calls[kind]["fp8_rel_err_vs_fp32"]
    assert 0 < model["velocity"]["video"]["rel_err"] < 0.1 and model["velocity"]["video"]["cosine"] > 0.99
    assert model["trajectory"]["steps"] == 1 and set(model["trajectory"]["seconds"]) == {"bf16", "fp8"}


def test_decode_stage(tmp_path):
    result = dry_run(tmp_path, "decode_stage.py", "--tiny", "--plan", "bench", "node", "heat0")
    assert HEADER <= set(result) and [step["kind"] for step in result["steps"]] == ["bench", "node", "heat0"]
    bench, node = result["steps"][:2]
    assert bench["tiles"] == node["tiles"] > 0 and node["mp4_tail_s"] >= 0 and bench["mp4_tail_s"] is None


def test_dit_step_across_ranks(tmp_path):
    """``--gpus 2`` with the branch split: two gloo ranks launched by the script, each rank's seconds and the
    seconds spent in the collectives written by rank 0."""
    args = ("--tiny", "--reps", "1", "--variants", "bf16-decomposed", "--gpus", "2", "--softmax-ranks", "1")
    result = dry_run(tmp_path, "dit_step.py", *args)
    assert HEADER <= set(result) and result["gpus"] == 2 and result["softmax_ranks"] == 1
    per_rank = result["variants"]["bf16-decomposed"]["ranks"]
    assert len(per_rank) == 2 and all(r["finite"] and r["collectives"] > 0 for r in per_rank)
    assert [r["window_backend"] for r in per_rank] == ["decomposed", None]  # the second rank runs the branch


def test_block_memory(tmp_path):
    result = dry_run(tmp_path, "block_memory.py", "--tiny", "--frames", "12", "--variants", "1:0", "2:16")
    assert HEADER <= set(result) and "rows" in result


def test_block_gemms(tmp_path):
    result = dry_run(tmp_path, "block_gemms.py", "--tiny", "--reps", "1")
    assert HEADER <= set(result) and {"qkv", "output"} <= set(result)
    assert all(row["max_abs_diff"] < 1e-4 for part in ("qkv", "output") for row in result[part].values())


def test_branch_stages(tmp_path):
    result = dry_run(tmp_path, "branch_stages.py", "--tiny", "--reps", "1")
    assert HEADER <= set(result) and {"ms", "max_diff"} <= set(result)


def test_fp8_stages(tmp_path):
    result = dry_run(tmp_path, "fp8_stages.py", "--tiny", "--reps", "1")
    assert HEADER <= set(result) and {"ms", "codes_equal"} <= set(result)


def test_kernel_launches_under_the_triton_interpreter(tmp_path):
    pytest.importorskip("triton")
    result = dry_run(
        tmp_path,
        "kernel_launches.py",
        "--tiny",
        "--reps",
        "1",
        "--only",
        "readout",
        "solve",
        env={"TRITON_INTERPRET": "1"},
    )
    assert HEADER <= set(result) and {"ms", "max_diff", "row", "table_row"} <= set(result)
    assert set(result["row"]) == {"readout_triton", "shifted_gram_triton", "small_inverse_triton"}
    assert all(d == 0 or d < 0.05 for d in result["max_diff"].values())
    # the row the launch table takes: every kernel that lost to its plain form dropped, launches it accepts
    from h3_core.launch_table import Architecture

    table_row = result["table_row"]
    Architecture(measured_on=("dry run",), dropped=frozenset(table_row["dropped"]), launches=table_row["launches"])
    assert set(table_row["dropped"]) == {k for k, e in result["row"].items() if not e["kept"]}


def test_checkpoint_memory(tmp_path):
    if not Path("/proc/self/status").exists():
        pytest.skip("reads resident memory from /proc")
    result = dry_run(tmp_path, "checkpoint_memory.py", "--gib", "0.05", "--file", str(tmp_path / "dit.safetensors"))
    assert HEADER <= set(result) and {"file_bytes", "peak_rise_x_file", "final_rise_x_file"} <= set(result)


def test_text_encode(tmp_path):
    tokenizer = host_tokenizer()
    result = dry_run(tmp_path, "text_encode.py", "--tiny", "--reps", "1", "--host", str(tokenizer.parents[2]))
    assert HEADER <= set(result) and {"resident", "streamed"} <= set(result)


@pytest.fixture(scope="module")
def tiny_end_to_end(tmp_path_factory):
    """``end_to_end.py --tiny``'s files written and its report made (no server: the phases that serve need one)."""
    folder = tmp_path_factory.mktemp("end_to_end")
    return folder, dry_run(
        folder, "end_to_end.py", "--tiny", "--base", str(folder / "base"), "--phase", "write", "report"
    )


def test_end_to_end(tiny_end_to_end):
    _, result = tiny_end_to_end
    assert {"environments", "files"} <= set(result)


def test_end_to_end_restart_without_fl2va(tiny_end_to_end):
    """A restarted server's first T2VA run alone, through a real server on the CPU."""
    folder, _ = tiny_end_to_end
    result = dry_run(
        folder, "end_to_end.py", "--tiny", "--base", str(folder / "base"), "--phase", "restart-t2va", "report"
    )
    (env,) = [name for name in result["environments"] if not name.endswith("gpus")]
    runs = result["environments"][env]["runs"]
    assert "restart" in runs and "fl2va" not in runs and runs["restart"]["total_s"] > 0


def test_end_to_end_restart_then_warm_repeated(tiny_end_to_end):
    """Two restarted servers, each a first T2VA run then a warm one, the second added in a later call: the extra
    and the warm total reported are their medians, the runs kept are those of the server with the lower warm
    total, and each run knows when its mp4 was on disk."""
    folder, _ = tiny_end_to_end
    command = ("end_to_end.py", "--tiny", "--base", str(folder / "base"), "--phase", "restart-warm", "report")
    dry_run(folder, *command)
    result = dry_run(folder, *command, "--add-servers")
    (env,) = [name for name in result["environments"] if not name.endswith("gpus")]
    figures = result["environments"][env]
    extras, warm_totals = figures["first_run_extra_samples_s"], figures["warm_total_samples_s"]
    assert len(extras) == 2 and figures["first_run_extra_s"] == pytest.approx(sum(extras) / 2)
    assert len(warm_totals) == 2 and figures["total_s"] == pytest.approx(sum(warm_totals) / 2)
    runs = figures["runs"]
    assert runs["warm"]["total_s"] == pytest.approx(min(warm_totals))
    kept = warm_totals.index(min(warm_totals))
    assert runs["restart"]["total_s"] - runs["warm"]["total_s"] == pytest.approx(extras[kept])
    for run in (runs["restart"], runs["warm"]):
        # the file's clock and the bench's: the same machine's, to the file system's resolution
        assert 0 < run["mp4_written_s"] <= run["total_s"] + 0.01
    assert figures["mp4_written_s"] == runs["warm"]["mp4_written_s"]


def test_end_to_end_across_ranks(tiny_end_to_end):
    """The workflows with H3 Multi-GPU on 2 ranks through a real server (the CPU, gloo) and the evaluation across
    2 ranks, into an environment of their own with each run's worker seconds."""
    folder, _ = tiny_end_to_end
    base = folder / "base"
    result = dry_run(
        folder, "end_to_end.py", "--tiny", "--gpus", "2", "--base", str(base), "--phase", "eval", "cold", "report"
    )
    (env,) = [name for name in result["environments"] if name.endswith("_2gpus")]
    ranked = result["environments"][env]
    assert set(ranked["runs"]) == {"cold", "warm"}
    for run in ranked["runs"].values():
        assert run["total_s"] > 0 and set(run["ranks"]["sampling"]) == {"1"} and set(run["ranks"]["decoding"]) == {"1"}
        assert 0 < run["decode_first_tiles_s"] <= run["decode_s"]
        vae_load, first_tiles = run["decode_vae_load_s"], run["decode_first_tiles_s"]
        assert 0 <= vae_load and vae_load + first_tiles <= run["decode_s"]
    assert ranked["eval"]["stats"]["ranks"][1]["seconds"] > 0 and ranked["eval_collectives_s"] > 0


def test_dit_load(tmp_path, tiny_end_to_end):
    models = tiny_end_to_end[0] / "base" / "models" / "diffusion_models"
    result = dry_run(
        tmp_path,
        "dit_load.py",
        "--dit",
        str(models / "h3_tiny_random_dit.safetensors"),
        "--branch",
        str(models / "h3_tiny_random_linear_branch.safetensors"),
        "--device",
        "cpu",
        "--reps",
        "1",
    )
    assert HEADER <= set(result) and "runs" in result
    (run,) = result["runs"]
    assert set(run["page_cache_read_threads_s"]) == {"1", "4", "8", "16"}
    assert all(s > 0 for s in run["page_cache_read_threads_s"].values())


def test_first_launch(tmp_path):
    """Under Triton's CPU interpreter: two new processes sharing one cache, each launch timed."""
    result = dry_run(tmp_path, "first_launch.py", "--processes", "2", "--device", "cpu", env={"TRITON_INTERPRET": "1"})
    assert HEADER <= set(result) and len(result["runs"]) == 2
    assert all(run["first_launch_s"] > 0 and run["second_kernel_s"] > 0 for run in result["runs"])


def test_mp4_presets(tmp_path):
    pytest.importorskip("av")
    image = pytest.importorskip("PIL.Image")
    import numpy as np

    photos = tmp_path / "photos"
    photos.mkdir()
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        image.fromarray(rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)).save(photos / f"{name}.png")
    result = dry_run(
        tmp_path,
        "mp4_presets.py",
        "--photos",
        str(photos),
        "--frames",
        "22",
        "--width",
        "256",
        "--height",
        "144",
        "--threads",
        "0",
        "--presets",
        "medium",
        "--thread-types",
        "frame",
        "--extra-crfs",
        "--tail-loads",
        "idle",
    )
    assert HEADER <= set(result) and {"rows", "reference"} <= set(result)


def test_first_calls(tmp_path):
    """Small shapes on the CPU: each new process times the attention, matrix products and convolutions, first at one
    shape, then again, then at new shapes; the second set after the start thread's calls on a thread of their own,
    the third after that thread also made every timed call at the same shapes."""
    result = dry_run(
        tmp_path,
        "first_calls.py",
        *("--processes", "2", "--device", "cpu", "--tiny", "--with-warm-thread", "--with-same-shapes-thread"),
    )
    threaded = result["runs_warm_thread"] + result["runs_same_shapes_thread"]
    assert HEADER <= set(result) and len(result["runs"]) == 2 and len(threaded) == 4
    assert all(run["warm_thread_s"] > 0 for run in threaded)
    for run in result["runs"] + threaded:
        assert set(run["attention"]) == {"dit_fp16", "dit_bf16", "decoder_fp16"}
        assert all(
            len(a["calls"]) == 4 and all(c["seconds"] > 0 for c in a["calls"]) for a in run["attention"].values()
        )
        assert set(run["products"]) == {"bf16", "fp16"} and all(len(p) == 4 for p in run["products"].values())
        assert run["pinned_slabs"]["slabs"] > 2 and run["pinned_slabs"]["first_s"] > 0
        convolutions = run["convolutions"]
        assert len(convolutions["conv1d_fp32"]) == len(convolutions["conv_transpose1d_fp32"]) == 5
        assert len(convolutions["depthwise_conv2d_bf16"]) == 3
        assert all(c["seconds"] > 0 for calls in convolutions.values() for c in calls)


def test_thread_timeline_reads_a_speedscope_file(tmp_path):
    """Runs of samples at one place, per thread, from the file format py-spy writes (gzipped as h200_host.sh keeps
    it): the pack's innermost frame and the innermost frame of all, timed at the recording's rate."""
    import gzip

    frames = [
        {"name": "worker", "file": "/usr/lib/python3.12/threading.py", "line": 1},
        {"name": "check_file", "file": "/x/custom_nodes/h3_hybrid/h3_core/formats/file_kinds.py", "line": 141},
        {"name": "uniform_", "file": "/torch/_decomp/decompositions.py", "line": 3031},
        {"name": "select", "file": "/usr/lib/python3.12/selectors.py", "line": 468},
    ]
    samples = [[0, 3]] * 5 + [[0, 1, 2]] * 46 + [[0, 3]] * 3
    profiles = [
        {"type": "sampled", "name": 'Thread 1 "MainThread"', "samples": samples, "weights": [0.01] * len(samples)},
        {"type": "sampled", "name": 'Thread 2 "other"', "samples": [[0, 3]], "weights": [0.01]},
    ]
    path = tmp_path / "server_1.speedscope.json.gz"
    with gzip.open(path, "wt") as file:
        json.dump({"shared": {"frames": frames}, "profiles": profiles}, file)

    def timeline(*args: str) -> list[str]:
        command = [sys.executable, str(ROOT / "bench" / "thread_timeline.py"), str(path), *args]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.splitlines()

    assert timeline("--thread", "Main", "--min-ms", "40") == [
        '# Thread 1 "MainThread": 0.54 s of samples',
        "    0.00      50 ms  - | select (selectors.py:468)",
        "    0.05     460 ms  check_file (file_kinds.py:141) | uniform_ (decompositions.py:3031)",
    ]
    assert timeline("--thread", "Main", "--from", "0.5", "--min-ms", "0") == [
        '# Thread 1 "MainThread": 0.54 s of samples',
        "    0.51      30 ms  - | select (selectors.py:468)",
    ]
    totals = timeline("--thread", "Main", "--totals")
    assert totals[1:] == [
        "    0.46 s  check_file (file_kinds.py:141) | uniform_ (decompositions.py:3031)",
        "    0.08 s  - | select (selectors.py:468)",
    ]


def test_gc_watch_logs_each_full_collection(tmp_path):
    """``bench/gc_watch`` first on a process's path: each full collection becomes a line with its seconds, and the
    first ones the objects tracked by type and package."""
    log = tmp_path / "gc.jsonl"
    script = "import gc\nkept = [[i] for i in range(50000)]\ngc.collect()\ngc.collect(1)\ngc.collect()\n"
    subprocess.run(
        [sys.executable, "-c", script],
        check=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "bench" / "gc_watch"), H3_GC_LOG=str(log), H3_GC_DETAIL_S="0"),
    )
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) >= 2 and all(line["seconds"] > 0 for line in lines)  # the generation-1 one is left out
    detailed = [line for line in lines if "tracked" in line]
    assert detailed and detailed[0]["tracked"] > 50000
    assert dict(detailed[0]["by_type"])["list"] >= 50000 and dict(detailed[0]["by_package"])["builtins"] >= 50000


def test_vae_decode_into_mp4_times_the_nodes_path(tmp_path):
    """``vae_decode.py --into-mp4``'s run: a tiny decoder's clip streamed into an mp4 as H3 Decode & Save does,
    every frame in the file, the decode's seconds to its last tile within the whole."""
    av = pytest.importorskip("av")
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import vae_decode

    from h3_core.models.video_vae import VideoVAEConfig

    tiny = VideoVAEConfig(decoder_layers=1, decoder_heads=2, block_out_channels=(8,) * 6, norm_groups=4)
    vae = vae_decode.random_video_vae(torch.device("cpu"), torch.float32, tiny)
    path = tmp_path / "clip.mp4"
    row = vae_decode.decode_into_mp4(vae, torch.randn(24, 7, 2, 3), path, 2, torch.zeros(2, 3200), niceness=0)
    assert row["threads"] == 2 and row["niceness"] == 0
    assert 0 < row["decode_s"] <= row["seconds"] and row["frames_behind"] >= 0
    with av.open(str(path)) as clip:
        stream = clip.streams.video[0]
        assert (stream.height, stream.width) == (2 * vae.cfg.spatial_ratio, 3 * vae.cfg.spatial_ratio)
        assert sum(1 for _ in clip.decode(stream)) == row["frames"]


def test_host_frames(tmp_path):
    """``host_frames.py`` on a small clip: both allocations written and freed, per dtype."""
    result = dry_run(tmp_path, "host_frames.py", "--frames", "3", "--height", "64", "--width", "96", "--reps", "1")
    assert HEADER <= set(result)
    assert {(row["dtype"], row["variant"]) for row in result["rows"]} == {
        (dtype, variant) for dtype in ("float32", "uint8") for variant in ("torch.empty", "huge pages")
    }
    assert all(row["write_s"] > 0 and row["free_s"] >= 0 for row in result["rows"])


def test_desktop_envelope(tiny_end_to_end):
    """``desktop.py``: the whole machine and host memory limited (a cgroup or a ballast process, whichever this
    machine allows) each through a new real server on the CPU, every record's figures read back (the server's
    resident peak and reads from /proc), and the desktop cards' estimate from the uncapped run."""
    folder, _ = tiny_end_to_end
    base = folder / "base"
    with open("/proc/meminfo") as info:
        total_gib = int(info.readline().split()[1]) / 2**20
    limit = f"{max(int(total_gib) - 2, 8)}"  # room for the server, still a limit
    result = dry_run(
        folder, "desktop.py", "--tiny", "--base", str(base), "--configs", "none:0", f"none:{limit}", "--estimate",
        "--warm-up", timeout=900,
    )  # fmt: skip
    runs = result["runs"]
    # nothing compiles on the CPU: the cache stays empty, the warm-up ran first and was kept apart
    assert result["warm_up"]["completed"] and result["warm_up"]["compile_cache_empty"]
    assert all(run["compile_cache_empty"] for run in runs.values())
    assert set(runs) == {"card_host", f"card_{limit}gib_host"}
    for run in runs.values():
        assert run["completed"], run.get("error")
        assert run["total_s"] > 0 and run["sampling_s"] > 0 and run["decode_s"] > 0
        assert any("[H3 Hybrid] loaded" in line for line in run["pack_lines"]), run["pack_lines"]
        assert run["server_rss_peak_gib"] > 0.1 and run["read_gib"] > 0 and run["storage_read_gib"] >= 0
    assert runs["card_host"]["host"]["method"] == "none"
    limited = runs[f"card_{limit}gib_host"]["host"]
    assert limited["limit_gib"] == float(limit)
    assert limited["method"].startswith(("cgroup v2", "ballast process")), limited["method"]
    assert limited["available_gib"] <= float(limit) + 0.5
    (rtx4090, rtx5090) = result["estimates"]
    assert "RTX 4090" in rtx4090["card"] and "RTX 5090" in rtx5090["card"]
    for item in result["estimates"]:
        assert item["estimated_total_s"] > 0 and "estimate" in item["basis"]
    assert (folder / "desktop.md").read_text().count("estimate") >= 2
