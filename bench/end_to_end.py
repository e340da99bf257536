"""Prompt to mp4 through a real ComfyUI server, stage by stage: the bundled T2VA workflow (and FL2VA once) at the
release size, queued over HTTP as the frontend queues it, the prompt from a saved prompt embedding.

Release-size RANDOM checkpoints (timings do not depend on the values) in the layouts users have, labelled random
in their metadata: ComfyUI's pruned fp8-scaled DiT single file (``bench/lora_repatch.py``'s writer), VDN-H3's
linear branch file, the fp16 video VAE and the fp32 audio VAE, and a 300-token prompt embedding. The bundled
workflow's text encoder and text encode nodes are replaced by the prompt embedding loader; everything else is the
workflow as shipped, with the release canvas (1344×768, 345 frames), 8 steps and the fp8 DiT.

Stages come from the server's own events, timed as they arrive: ``executing`` (a node starts; the next one
ends it), the sampler's progress text (sent once the host has loaded the DiT for the run), its ``progress``
events (one per step), ``execution_success``. Per run: the loaders (file into host memory), the sampler's
preparation (the host's ``load_models_gpu`` and the run's placement; FL2VA's keyframe encoding too), the first
step (compilation included) and the steady steps, the video decode, the audio decode, the save (the mp4's tail
after the last decoded frame) and the total from queueing to the mp4.

Phases, each a separate call (each fits a 10-minute command; the results gather in ``--state``):

* ``write``: the files, under ``--base``'s model folders;
* ``eval``: one steady DiT evaluation of the variant the nodes run (``bench/dit_step.py``) and the decodes with
  the nodes' settings in their own bench (``bench/vae_decode.py``), on this machine;
* ``text``: a 300-token prompt through the pack's text encoder at the released size, random weights built on the
  GPU, resident and streamed (``bench/text_encode.py``);
* ``cold``: a new server with the files' pages dropped from the page cache and an empty compile cache: T2VA
  (the cold run), then T2VA again with another seed (warm: models loaded, kernels compiled);
* ``restart``: a new server process, page cache and compile cache filled: T2VA (the first run of a restarted
  server), then FL2VA once; ``restart-t2va``: the same without FL2VA (an earlier FL2VA run stands);
  ``restart-warm``: T2VA as the restarted server's first run, then again warm in the same process (both
  figures of ``first_run_extra_s`` from one server on one machine; the cold run stands); with ``--repeat N``, N
  such servers one after the other (``--add-servers``: added to the earlier ones, for more servers than one call
  holds): ``first_run_extra_s`` and ``total_s`` are the medians of their extras and their warm totals (for even N
  the mean of the middle two; all of them in ``first_run_extra_samples_s`` and ``warm_total_samples_s``) and the
  runs kept are those of the server with the median warm total (the lower middle one's for even N);
* ``small``: a new server whose host budget is ``--budget-gib`` (``--reserve-vram`` set to the rest of the free
  memory; the memory policy on, as the workflow ships): T2VA once, its total and torch's peak;
* ``report``: ``--out`` (JSON) and the same path with ``.md``: per kernel environment (``--env``), the summary
  figures and every run's stages.

``--gpus N`` (``--softmax-ranks n``) runs the workflows with H3 Multi-GPU between the loaders and the sampler and
the decoder (N ranks, one worker process per extra GPU started by the node itself) and the ``eval`` phase's
evaluation across N ranks (``bench/dit_step.py --gpus N``: each rank's seconds, peak and all-to-all seconds); its
results are an environment of their own (``<env>_<N>gpus``), with each run's per-rank seconds and peak device
memory from the node's log lines.

``--tiny`` dry-runs every phase on the CPU with the tiny random checkpoints and a small canvas.

    python3 bench/end_to_end.py --base /root/h3_e2e --env pytorch --phase write eval cold restart report \\
        --out bench/results/end_to_end.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
import lora_repatch
import record

from h3_core.media.mp4 import ENCODER_NICENESS

NOTE = "H3 Hybrid benchmark RANDOM weights: not a trained model"
GiB = 2**30
RELEASE = dict(width=1344, height=768, length=345, steps=8, text=300)
TINY = dict(width=64, height=32, length=22, steps=2, text=6)
FILES = {
    "dit": "minimax_h3_fl2va_pruned_fp8_scaled_random.safetensors",
    "branch": "vdn_h3_linear_branch_random.safetensors",
    "video_vae": "minimax_h3_video_vae_fp16_random.safetensors",
    "audio_vae": "minimax_h3_audio_vae_fp32_random.safetensors",
    "prompt": "h3_prompt_300_tokens_random.safetensors",
}
FOLDERS = {
    "dit": "diffusion_models",
    "branch": "diffusion_models",
    "video_vae": "vae",
    "audio_vae": "vae",
    "prompt": "h3_prompts",
}
RUNS = ("cold", "warm", "restart", "fl2va", "small")
# The phases that serve the workflows: each one server process, its runs as (name, workflow, seed).
SERVED = {
    "cold": [("cold", "h3_t2va.json", 1), ("warm", "h3_t2va.json", 2)],
    "restart": [("restart", "h3_t2va.json", 3), ("fl2va", "h3_fl2va.json", 4)],
    "restart-t2va": [("restart", "h3_t2va.json", 3)],
    "restart-warm": [("restart", "h3_t2va.json", 3), ("warm", "h3_t2va.json", 2)],
    "small": [("small", "h3_t2va.json", 5)],
}
STAGES = (
    "validation_s",
    "loaders_s",
    "sampler_prepare_s",
    "first_step_s",
    "steady_step_s",
    "sampling_s",
    "sampler_tail_s",
    "decode_s",
    "decode_vae_load_s",
    "decode_first_tiles_s",
    "decode_steady_tiles_s",
    "audio_s",
    "mp4_tail_s",
    "mp4_written_s",
    "total_s",
)


def paths(base: Path, tiny: bool) -> dict[str, Path]:
    if tiny:
        from tiny_checkpoints import TINY_FILES

        names = {
            "dit": TINY_FILES["dit"],
            "branch": TINY_FILES["linear_branch"],
            "video_vae": TINY_FILES["video_vae"],
            "audio_vae": TINY_FILES["audio_vae"],
            "prompt": "h3_tiny_prompt_random.safetensors",
        }
    else:
        names = FILES
    return {kind: base / "models" / FOLDERS[kind] / name for kind, name in names.items()}


# ---- the files ------------------------------------------------------------------------------------------


def _save(state: dict, path: Path, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in state.items()},
        str(partial),
        metadata={"note": NOTE, **(metadata or {})},
    )
    os.replace(partial, path)


def write_files(base: Path, tiny: bool) -> dict:
    """Every file the workflow reads, at the release size (or the tiny ones); returns their sizes in bytes."""
    from h3_core.pipeline.prompt import PromptEmbedding, save_prompt_embedding

    files = paths(base, tiny)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if tiny:
        from tiny_checkpoints import TINY_TEXT_WIDTH, write_tiny_checkpoints

        write_tiny_checkpoints(base / "models")
        width = TINY_TEXT_WIDTH
    else:
        from tiny_checkpoints import _BRANCH_PARTS
        from vae_decode import random_audio_vae, random_video_vae

        from h3_core.models.dit import DiTConfig, H3DiT
        from h3_core.models.precision import keeps_fp32
        from h3_core.models.video_vae import VideoVAEConfig
        from h3_core.pipeline.prompt import TEXT_WIDTH

        files["dit"].parent.mkdir(parents=True, exist_ok=True)
        lora_repatch.write_checkpoint(files["dit"], lora_repatch.release_config())
        with torch.device("meta"):
            shapes = {
                k: v.shape
                for k, v in H3DiT(DiTConfig(hybrid=True)).state_dict().items()
                if any(part in k for part in _BRANCH_PARTS)
            }
        g = torch.Generator(device=device).manual_seed(2)
        branch = {}
        for key, shape in shapes.items():
            value = torch.randn(shape, generator=g, device=device) * 0.02
            branch["transformer_blocks." + key.removeprefix("blocks.")] = value.to(
                torch.float32 if keeps_fp32(key) else torch.bfloat16
            )
        _save(branch, files["branch"])
        video = dict(random_video_vae(device).state_dict())
        cfg = VideoVAEConfig()
        video["latents_mean"] = torch.tensor(cfg.latents_mean)
        video["latents_std"] = torch.tensor(cfg.latents_std)
        _save(video, files["video_vae"])
        _save(dict(random_audio_vae(device).state_dict()), files["audio_vae"])
        width = TEXT_WIDTH
    text = (TINY if tiny else RELEASE)["text"]
    g = torch.Generator().manual_seed(3)
    embeds = (torch.randn(text, width, generator=g) * 0.5).to(torch.bfloat16 if not tiny else torch.float32)
    files["prompt"].parent.mkdir(parents=True, exist_ok=True)
    embedding = PromptEmbedding(
        embeds, torch.ones(text, dtype=torch.long), prompt="random prompt embedding (benchmark)", features=width
    )
    save_prompt_embedding(files["prompt"], embedding)
    return {kind: path.stat().st_size for kind, path in files.items()}


# ---- the workflow ---------------------------------------------------------------------------------------


def workflow(name: str, object_info: dict, files: dict[str, Path], size: dict, seed: int, ranks=(1, 0)) -> dict:
    """The bundled workflow ``name`` in API form with the benchmark's files, size and steps, its text encoding
    replaced by the saved prompt embedding; with ``ranks`` (gpus, softmax ranks) of more than one GPU, H3
    Multi-GPU between the loaders and the sampler and the decoder."""
    from ui_to_api import to_api

    prompt = to_api(json.loads((ROOT / "workflows" / name).read_text()), object_info)
    by_class = {node["class_type"]: node_id for node_id, node in prompt.items()}
    for drop in ("H3TextEncoderLoader", "H3TextEncode"):
        prompt.pop(by_class[drop])
    prompt["900"] = {"class_type": "H3PromptEmbeddingLoader", "inputs": {"embedding": files["prompt"].name}}
    inputs = {cls: prompt[node_id]["inputs"] for cls, node_id in by_class.items() if node_id in prompt}
    inputs["H3DiTLoader"].update(dit_name=files["dit"].name, linear_branch=files["branch"].name, weight_dtype="fp8")
    inputs["H3VideoVAELoader"]["vae_name"] = files["video_vae"].name
    inputs["H3AudioVAELoader"]["vae_name"] = files["audio_vae"].name
    inputs["H3Canvas"].update(width=size["width"], height=size["height"], length=size["length"])
    inputs["H3Sampler"].update(steps=size["steps"], seed=seed, conditioning=["900", 0])
    saving = "H3DecodeAndSave" if "H3DecodeAndSave" in inputs else "H3SaveVideo"
    inputs[saving]["filename_prefix"] = f"H3/e2e_{Path(name).stem}"
    gpus, softmax_ranks = ranks
    if gpus > 1:
        sampler = inputs["H3Sampler"]
        prompt["910"] = {
            "class_type": "H3MultiGPU",
            "inputs": {
                "model": sampler["model"],
                "gpus": gpus,
                "softmax_ranks": softmax_ranks,
                "video_vae": [by_class["H3VideoVAELoader"], 0],
            },
        }
        sampler["model"] = ["910", 0]
        for node in prompt.values():
            if node["class_type"] in ("H3DecodeAndSave", "H3VideoDecode"):
                node["inputs"]["video_vae"] = ["910", 1]
    return prompt


def rank_lines(log: str) -> dict:
    """The node's lines on the workers of a run (``sampling`` / ``decoding across the ranks: rank 1 12.30 s, peak
    40.10 GiB; ...``) as {what: {rank: {"seconds", "peak_gib"}}}, the last of each."""
    found = {}
    for line in log.splitlines():
        for what in ("sampling", "decoding"):
            marker = f"{what} across the ranks: "
            if marker not in line:
                continue
            ranks = {}
            for part in line.split(marker, 1)[1].split("; "):
                words = part.replace(",", "").split()
                if len(words) < 3 or words[0] != "rank":
                    continue
                entry = {"seconds": float(words[2])}
                if "peak" in words:
                    entry["peak_gib"] = float(words[words.index("peak") + 1])
                ranks[int(words[1])] = entry
            found[what] = ranks
    return found


def keyframe_images(folder: Path, size: dict) -> None:
    """The FL2VA workflow's two keyframes (generated patterns) at the canvas size."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0 : size["height"], 0 : size["width"]]
    first = np.stack(
        [x * 255 // max(size["width"] - 1, 1), y * 255 // max(size["height"] - 1, 1), np.full_like(x, 96)], -1
    ).astype(np.uint8)
    last = np.stack([np.full_like(x, 200), (x + y) % 256, y * 255 // max(size["height"] - 1, 1)], -1).astype(np.uint8)
    Image.fromarray(first).save(folder / "h3_first_frame.png")
    Image.fromarray(last).save(folder / "h3_last_frame.png")


# ---- one run ---------------------------------------------------------------------------------------------


def timed_events(server, prompt: dict, timeout: float) -> tuple[list[tuple[float, str, object]], float]:
    """The run's events, each with its seconds from the queueing, and the queueing's wall-clock time; the
    websocket is opened before the clock starts, as the frontend holds its socket open before a prompt is
    queued."""
    ws = server.socket()
    start, queued_at = time.perf_counter(), time.time()
    events = []
    for kind, data in server.events(prompt, timeout=timeout, ws=ws):
        events.append((time.perf_counter() - start, kind, data))
    return events, queued_at


def mp4_written_s(events, writer: str, output: Path, queued_at: float) -> float | None:
    """Seconds from the queueing until the writer node's mp4 was complete on disk (its modification time: the
    file's last byte, written before it took its final name). The host tells of it later: after the node
    returns, its worker runs ``gc.collect()`` holding the interpreter lock, which can hold back the messages the
    node's return queued (``executed``, ``execution_success``)."""
    shown = next(
        (data["output"]["images"][0] for _, kind, data in events if kind == "executed" and data.get("node") == writer),
        None,
    )
    if shown is None:
        return None
    path = output / shown.get("subfolder", "") / shown["filename"]
    return path.stat().st_mtime_ns / 1e9 - queued_at if path.exists() else None


def stages(events, prompt: dict, steps: int) -> dict:
    """The stage times of one run from its events (module docstring)."""
    end_kind = events[-1][1]
    if end_kind != "execution_success":
        raise RuntimeError(f"the run ended with {end_kind}: {json.dumps(events[-1][2])[:2000]}")
    total = events[-1][0]
    spans, current = {}, None
    for t, kind, data in events:
        if kind in ("executing", "execution_success"):
            node = data.get("node") if isinstance(data, dict) else None
            if current is not None:
                spans[current[0]] = (current[1], t)
            current = (node, t) if node is not None else None
    by_class = {}
    for node_id, (t0, t1) in spans.items():
        by_class.setdefault(prompt[node_id]["class_type"], []).append((t0, t1))
    sampler = next(node_id for node_id, node in prompt.items() if node["class_type"] == "H3Sampler")
    told = [t for t, kind, data in events if kind == "text" and data[0] == sampler]
    progress = {data["value"]: t for t, kind, data in events if kind == "progress" and data.get("node") == sampler}
    ((s0, s1),) = by_class["H3Sampler"]
    loaded = told[0] if told else s0
    first, last = progress.get(1), progress.get(steps)

    def span(cls):
        return sum(t1 - t0 for t0, t1 in by_class.get(cls, []))

    loaders = ("H3DiTLoader", "H3VideoVAELoader", "H3AudioVAELoader", "H3PromptEmbeddingLoader")
    timed_apart = (*loaders, "H3Sampler", "H3DecodeAndSave", "H3VideoDecode", "H3AudioDecode", "H3SaveVideo")
    out = dict(
        # from queueing to the first node's start: the host's validation of the prompt (every node's checks)
        validation_s=min(t0 for t0, _ in spans.values()) if spans else None,
        other_nodes_s=sum(span(c) for c in by_class if c not in timed_apart),
        loaders_s=sum(span(c) for c in loaders),
        dit_loader_s=span("H3DiTLoader"),
        sampler_prepare_s=loaded - s0,
        first_step_s=None if first is None else first - loaded,
        steady_step_s=None if first is None or last is None or steps < 2 else (last - first) / (steps - 1),
        sampling_s=None if last is None else last - loaded,
        sampler_tail_s=None if last is None else s1 - last,
        cached=[
            prompt[n]["class_type"]
            for t, kind, data in events
            if kind == "execution_cached"
            for n in data.get("nodes", [])
            if n in prompt
        ],
    )
    combined = next((node_id for node_id, node in prompt.items() if node["class_type"] == "H3DecodeAndSave"), None)
    if combined is None:  # the separate decode, audio decode and save nodes
        out.update(decode_s=span("H3VideoDecode"), audio_s=span("H3AudioDecode"), mp4_tail_s=span("H3SaveVideo"))
    else:
        # Decode & Save: the soundtrack (its progress text), the video decode (to the last tile's progress), the
        # mp4's tail (the rest)
        ((d0, d1),) = by_class["H3DecodeAndSave"]
        told_decode = [t for t, kind, data in events if kind == "text" and data[0] == combined]
        sound = told_decode[0]
        # the host's load of the video VAE (told when done; older nodes do not tell it)
        vae_ready = told_decode[1] if len(told_decode) > 1 else sound
        tiles = [t for t, kind, data in events if kind == "progress" and data.get("node") == combined]
        out.update(audio_s=sound - d0, decode_s=tiles[-1] - sound, mp4_tail_s=d1 - tiles[-1])
        # the video VAE's load, the first batch of tiles against a later one's
        out.update(
            decode_vae_load_s=vae_ready - sound,
            decode_first_tiles_s=tiles[0] - vae_ready,
            decode_steady_tiles_s=(tiles[-1] - tiles[0]) / (len(tiles) - 1) if len(tiles) > 1 else None,
        )
    out["total_s"] = total
    return out


# ---- the phases -----------------------------------------------------------------------------------------


def load_state(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def save_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state, indent=1))


def process_io(pid: int) -> dict[str, int] | None:
    """``/proc/<pid>/io``'s counters (Linux): ``rchar`` (bytes read, page cache included) and ``read_bytes``
    (bytes the process made the kernel fetch from storage), or None where the file is missing."""
    try:
        text = Path(f"/proc/{pid}/io").read_text()
    except OSError:
        return None
    fields = dict(line.split(": ") for line in text.splitlines() if ": " in line)
    return {key: int(fields[key]) for key in ("rchar", "read_bytes") if key in fields}


def peak_resident_gib(pid: int) -> float | None:
    """The most host memory the process has held resident so far (``VmHWM``, Linux), in GiB."""
    from resident_memory import resident

    try:
        return resident(pid)["VmHWM"] / GiB
    except OSError:
        return None


def serve(
    base: Path,
    compile_cache: Path,
    runs: list[tuple[str, str, int]],
    size: dict,
    timeout: float,
    extra_args: tuple[str, ...] = (),
    ranks=(1, 0),
) -> dict:
    """A new server on ``base`` with its compile caches under ``compile_cache`` (and ``extra_args`` on its command
    line); each run (label, workflow, seed) queued in turn, with the probe of torch's peak device memory after
    it; returns the stages (and the peak) by label."""
    from comfy_host import ComfyServer

    for env, sub in (
        ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
        ("TRITON_CACHE_DIR", "triton"),
        ("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "flash_attn_cute"),
    ):
        os.environ[env] = str(compile_cache / sub)
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")  # FA4 keeps its kernels on disk when asked
    probes = base / "custom_nodes" / "h3_host_probe"
    if not probes.exists():
        probes.parent.mkdir(parents=True, exist_ok=True)
        probes.symlink_to(ROOT / "tests" / "host" / "probe_nodes", target_is_directory=True)
    server = ComfyServer(base, extra_args)
    started = time.perf_counter()
    server.start(stall=600)
    results = {"server_start_s": time.perf_counter() - started}
    try:
        info = server.object_info()
        files = paths(base, size is TINY)
        keyframe_images(server.input, size)
        for label, name, seed in runs:
            prompt = workflow(name, info, files, size, seed, ranks)
            log_start = server.log_path.stat().st_size
            writer = next(k for k, v in prompt.items() if v["class_type"] in ("H3DecodeAndSave", "H3SaveVideo"))
            prompt["990"] = {"class_type": "H3ProbePeakMemory", "inputs": {"tag": label, "after_images": [writer, 0]}}
            io_before = process_io(server.process.pid)
            events, queued_at = timed_events(server, prompt, timeout)
            io_after = process_io(server.process.pid)
            results[label] = stages(events, prompt, size["steps"])
            if io_before and io_after:
                results[label]["read_gib"] = (io_after["rchar"] - io_before["rchar"]) / GiB
                results[label]["storage_read_gib"] = (io_after["read_bytes"] - io_before["read_bytes"]) / GiB
            results[label]["server_rss_peak_gib"] = peak_resident_gib(server.process.pid)  # since it started
            results[label]["mp4_written_s"] = mp4_written_s(events, writer, server.output, queued_at)
            results[label]["queued_at"] = queued_at  # wall-clock, to line the run up with other records of it
            peak = next(
                (
                    data["output"]["peak"][0]
                    for _, kind, data in events
                    if kind == "executed" and data.get("node") == "990"
                ),
                None,
            )
            results[label]["peak"] = peak
            if ranks[0] > 1:
                with open(server.log_path, encoding="utf-8", errors="replace") as log:
                    log.seek(log_start)
                    results[label]["ranks"] = rank_lines(log.read())
            print(label, json.dumps(results[label]), flush=True)
    finally:
        server.stop()
    results["server_log_tail"] = server.log_tail(40)
    log = server.log_path.read_text(encoding="utf-8", errors="replace") if server.log_path.exists() else ""
    results["pack_lines"] = [line for line in log.splitlines() if "[H3 Hybrid]" in line]  # where it read, its plans
    return results


def bench_in_process(script: str, *arguments: str) -> tuple[str, dict]:
    """``bench/<script>`` run in its own process with ``arguments``; its command and the JSON it wrote."""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"h3_e2e_{Path(script).stem}.json"
    command = [sys.executable, str(ROOT / "bench" / script), *arguments, "--out", str(out)]
    subprocess.run(command, check=True)
    return " ".join(command[1:]), json.loads(out.read_text())


def steady_evaluation(tiny: bool, ranks=(1, 0)) -> dict:
    """One steady evaluation of the variant the nodes run (fp8 linears, VDN-H3's decomposed window softmax,
    fused compiled blocks), by ``bench/dit_step.py``; across ``ranks`` (gpus, softmax ranks) of more than one."""
    gpus, softmax_ranks = ranks
    command, report = bench_in_process(
        "dit_step.py",
        "--variants",
        "fp8-decomposed",
        "--fused-blocks",
        "compiled",
        "--reps",
        "3",
        *(["--tiny"] if tiny else []),
        *(["--gpus", str(gpus), "--softmax-ranks", str(softmax_ranks)] if gpus > 1 else []),
    )
    return dict(command=command, stats=report["variants"]["fp8-decomposed"])  # across ranks: each rank's in it


def decode_bench(tiny: bool) -> dict | None:
    """The video decode (the node's settings: auto attention, compiled blocks, output in pageable memory) and the
    audio decode in their own bench (``bench/vae_decode.py``), with the decode also streamed into an mp4 as H3
    Decode & Save runs it (libx264's threads chosen by it, as the node's, and 8; each with the encoder's threads
    at the nodes' niceness and at the process's own), in turn with the plain one; None on the CPU (that bench
    needs CUDA)."""
    if tiny or not torch.cuda.is_available():
        return None
    command, report = bench_in_process(
        "vae_decode.py",
        "--backends",
        "auto",
        "--output-memory",
        "pageable",
        "--into-mp4",
        "0",
        "8",
        "--encoder-niceness",
        str(ENCODER_NICENESS),
        "0",
    )
    return dict(
        command=command,
        decode_s=report["video"][0].get("seconds"),
        audio_s=report["audio"]["seconds"],
        into_mp4=report.get("into_mp4"),
    )


def text_encoding(tiny: bool) -> dict:
    """One 300-token prompt through the pack's encoder at the released size, resident and streamed
    (``bench/text_encode.py``)."""
    return bench_in_process("text_encode.py", *(["--tiny"] if tiny else []))[1]


def reserve_for_budget(budget_gib: float) -> float:
    """The ``--reserve-vram`` (GB as the host reads it: 2**30 bytes) that leaves the host ``budget_gib`` of the
    device's free memory (``get_free_memory`` less ``extra_reserved_memory``), from nvidia-smi (no CUDA context
    in this process)."""
    free_mib = int(
        subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", "0"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()[0]
    )
    return max(free_mib / 1024 - budget_gib, 0.0)


def environment() -> str:
    try:
        import flash_attn.cute  # noqa: F401

        return "fa4"
    except ImportError:
        return "pytorch"


def _first_run_extra(env_state: dict) -> float | None:
    """A restarted server's first run beyond warm: the median of the ``restart-warm`` servers' extras when the last
    served phase repeated it, else the restart run against the warm one."""
    samples = env_state.get("restart_samples")
    if samples:
        return statistics.median(sample["extra_s"] for sample in samples)
    restart, warm = env_state.get("restart"), env_state.get("warm")
    return restart["total_s"] - warm["total_s"] if restart and warm else None


def _warm_total(env_state: dict) -> float | None:
    """The warm run's total: the median of the ``restart-warm`` servers' warm runs when the last served phase
    repeated it, else the one warm run."""
    samples = env_state.get("restart_samples")
    if samples:
        return statistics.median(sample["warm_s"] for sample in samples)
    return env_state.get("warm", {}).get("total_s")


def restart_pairs(servers: list[dict]) -> tuple[dict, list[dict]]:
    """From ``restart-warm`` servers' results: the one with the median warm total (the lower middle for an even
    count), whose runs give the stages, and every server's totals and extra."""
    samples = [
        dict(
            extra_s=r["restart"]["total_s"] - r["warm"]["total_s"],
            restart_s=r["restart"]["total_s"],
            warm_s=r["warm"]["total_s"],
        )
        for r in servers
    ]
    order = sorted(range(len(servers)), key=lambda i: samples[i]["warm_s"])
    return servers[order[(len(order) - 1) // 2]], samples


def summary(env_state: dict) -> dict:
    cold, warm = env_state.get("cold", {}), env_state.get("warm", {})
    evaluation = env_state.get("eval", {}).get("stats", {})
    t_eval = evaluation.get("median_s", evaluation.get("seconds"))
    figures = dict(
        t_eval_s=t_eval,
        sampling_s=warm.get("sampling_s"),
        decode_s=warm.get("decode_s"),
        audio_s=warm.get("audio_s"),
        mp4_tail_s=warm.get("mp4_tail_s"),
        total_s=_warm_total(env_state),
        mp4_written_s=warm.get("mp4_written_s"),
        cold_total_s=cold.get("total_s"),
        text_encode_s=env_state.get("text_encode", {}).get("resident", {}).get("median_s"),
        text_encode_streamed_s=env_state.get("text_encode", {}).get("streamed", {}).get("median_s"),
        first_run_extra_s=_first_run_extra(env_state),
        empty_cache_first_run_s=cold.get("total_s"),
        small_card_total_s=env_state.get("small", {}).get("total_s"),
        small_card_peak_gib=(env_state.get("small", {}).get("peak") or {}).get("allocated_gib"),
        small_card_reserve_vram_gb=env_state.get("small_reserve_vram_gb"),
    )
    worker_peaks = [
        rank["peak_gib"] for rank in ((warm.get("ranks") or {}).get("sampling") or {}).values() if "peak_gib" in rank
    ]
    if worker_peaks:
        figures["worker_peak_gib"] = max(worker_peaks)
    if env_state.get("restart_samples"):
        figures["first_run_extra_samples_s"] = [sample["extra_s"] for sample in env_state["restart_samples"]]
        figures["warm_total_samples_s"] = [sample["warm_s"] for sample in env_state["restart_samples"]]
    if evaluation.get("ranks"):
        figures["eval_collectives_s"] = max(rank.get("collectives_s", 0.0) for rank in evaluation["ranks"])
    bench = env_state.get("decode_bench") or {}
    if bench.get("decode_s") and warm.get("decode_s"):
        figures["decode_bench_s"] = bench["decode_s"]
        figures["decode_over_bench"] = warm["decode_s"] / bench["decode_s"] - 1
    if t_eval and warm.get("steady_step_s"):
        figures["step_over_eval"] = warm["steady_step_s"] / t_eval - 1
    if t_eval and warm.get("sampling_s"):
        steps = env_state.get("size", {}).get("steps", RELEASE["steps"])
        figures["sampler_overhead"] = warm["sampling_s"] / (steps * t_eval) - 1
        figures["goal_total_s"] = steps * t_eval + 13
    return figures


def _cell(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value)
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def markdown(state: dict) -> str:
    lines = [
        "# Prompt to mp4 through the server",
        "",
        "Written by `bench/end_to_end.py` (see its docstring for the method). Random weights of the released "
        "sizes; the bundled workflows as shipped but for the prompt embedding in place of the text encoder.",
        "",
    ]
    for env, env_state in state.get("environments", {}).items():
        header = env_state.get("header", {})
        lines += [
            f"## {env}",
            "",
            f"{header.get('device')}, torch {header.get('torch')}, CUDA {header.get('cuda')}, "
            f"{header.get('date')}; size {env_state.get('size')}",
            "",
        ]
        figures = summary(env_state)
        lines += ["| figure | value |", "|---|---:|"]
        lines += [f"| `{k}` | {_cell(v)} |" for k, v in figures.items()]
        runs = [label for label in RUNS if label in env_state]
        lines += ["", "| stage (s) | " + " | ".join(runs) + " |", "|---|" + "---:|" * len(runs)]
        for stage in ("validation_s", "loaders_s", "dit_loader_s", "other_nodes_s") + STAGES[2:]:
            cells = [env_state[r].get(stage) for r in runs]
            lines.append(f"| {stage} | " + " | ".join("—" if c is None else f"{c:.2f}" for c in cells) + " |")
        peaks = [(env_state[r].get("peak") or {}).get("allocated_gib") for r in runs]
        lines.append("| torch peak (GiB) | " + " | ".join("—" if p is None else f"{p:.1f}" for p in peaks) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the server's base folder (models, output)")
    parser.add_argument(
        "--phase",
        nargs="+",
        required=True,
        choices=("write", "eval", "text", *SERVED, "report"),
    )
    parser.add_argument("--env", default=None, help="the kernel environment's label (default: detected)")
    parser.add_argument(
        "--state",
        type=Path,
        default=None,
        help="where the phases gather results (default: <base>/end_to_end_state.json)",
    )
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--budget-gib", type=float, default=24.0, help="the small-card run's budget (phase small)")
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoints on the CPU: a dry run")
    parser.add_argument("--gpus", type=int, default=1, help="H3 Multi-GPU's gpus in the workflows (1: none)")
    parser.add_argument("--softmax-ranks", type=int, default=0, help="with --gpus: H3 Multi-GPU's softmax_ranks")
    parser.add_argument(
        "--repeat", type=int, default=1, help="restart-warm: this many servers one after the other (the median kept)"
    )
    parser.add_argument(
        "--add-servers",
        action="store_true",
        help="restart-warm: add its servers to this environment's earlier restart-warm servers (one machine's "
        "servers over several calls) instead of replacing them",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat: got {args.repeat}; allowed: 1 or more")
    base = args.base.resolve()
    state_path = args.state or base / "end_to_end_state.json"
    state = load_state(state_path)
    env = args.env or environment()
    ranks = (args.gpus, args.softmax_ranks)
    if args.gpus > 1:
        env += f"_{args.gpus}gpus" + (f"_{args.softmax_ranks}softmax" if args.softmax_ranks else "")
    size = TINY if args.tiny else RELEASE
    env_state = state.setdefault("environments", {}).setdefault(env, {})
    if set(args.phase) - {"report", "write"}:  # a phase measuring this environment on this machine
        env_state["header"] = record.header("end_to_end.py", argv)
        env_state["size"] = size
    compile_cache = base / f"compile_cache_{env}"
    for phase in args.phase:
        started = time.perf_counter()
        if phase == "write":
            state["files"] = write_files(base, args.tiny)
        elif phase == "eval":
            env_state["eval"] = steady_evaluation(args.tiny, ranks)
            env_state["decode_bench"] = decode_bench(args.tiny)
        elif phase == "text":
            env_state["text_encode"] = text_encoding(args.tiny)
        elif phase in SERVED:
            server_args = ()
            if phase == "cold":
                shutil.rmtree(compile_cache, ignore_errors=True)
                for path in paths(base, args.tiny).values():
                    lora_repatch.drop_page_cache(path)
            if phase == "small":
                reserve = reserve_for_budget(args.budget_gib)
                env_state["small_reserve_vram_gb"] = reserve
                server_args = ("--reserve-vram", f"{reserve:.3f}")
            repeat = args.repeat if phase == "restart-warm" else 1
            servers = [
                serve(base, compile_cache, SERVED[phase], size, args.timeout, server_args, ranks=ranks)
                for _ in range(repeat)
            ]
            if phase == "restart-warm":
                if args.add_servers:
                    servers = env_state.get("restart_servers", []) + servers
                env_state["restart_servers"] = servers
                kept, env_state["restart_samples"] = restart_pairs(servers)
                env_state.update(kept)
            else:
                if {label for label, _, _ in SERVED[phase]} & {"restart", "warm"}:
                    # the restart or the warm run is no longer theirs
                    env_state.pop("restart_samples", None)
                    env_state.pop("restart_servers", None)
                env_state.update(servers[0])
        elif phase == "report":
            result = dict(
                environments={
                    e: dict(
                        summary(s),
                        runs={k: v for k, v in s.items() if k in RUNS},
                        eval=s.get("eval"),
                        header=s.get("header"),
                        size=s.get("size"),
                    )
                    for e, s in state.get("environments", {}).items()
                },
                files=state.get("files"),
            )
            record.write(result, args.out)
            if args.out is not None:
                args.out.with_suffix(".md").write_text(markdown(state))
        print(f"{phase}: {time.perf_counter() - started:.1f} s", flush=True)
        save_state(state_path, state)
    return state


if __name__ == "__main__":
    main()
