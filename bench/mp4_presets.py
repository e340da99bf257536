"""What libx264's preset and thread count cost and give when the pack writes a clip: per configuration the wall
seconds of the encode, the file size and the PSNR of the decoded file against the source frames, on a
natural-content clip of the release size (345 frames, 1344×768, 24 fps).

The clip: photographs bundled with scikit-image, one after another, each panned and zoomed slowly and
continuously (bicubic ``grid_sample``) across its own share of the frames; built in memory as uint8
``[frames, height, width, 3]``. The photos are 300 to 741 pixels wide, so the frames are enlarged views of them.

Each configuration is written by the pack's own ``Mp4Writer`` (PyAV, ``libx264`` at 24 fps, ``yuv420p``, options
``crf``, ``preset``, ``threads``; ``threads`` 0 is libx264's auto) into a temporary file, every frame at once; the
seconds are ``time.perf_counter`` around opening, encoding, muxing and closing the file, frames already in memory
(the RGB-to-yuv420p conversion PyAV does before the encoder included). ``--thread-types``: ``frame`` is the pack's
(libx264's frame threads); ``slice`` puts back PyAV's default codec threading (libx264 then slices each frame).
The file is decoded back to rgb24 with PyAV: PSNR per frame (mean over the frames) and from the clip's total
squared error (global). The same figures for the yuv420p round trip alone (a lossless encoder) are the ceiling of
every configuration. The x264 settings each file records (its SEI) give the threads libx264 actually ran.

The streamed tail (crf 18, frame threads, ``--tail-threads``): the pack's ``Mp4Worker`` is fed as H3 Decode & Save
feeds it, each decoder window's final frames (the decoder's own temporal plan) ``--window-s`` apart, and the tail
is the time from the last window to the finished file: what the encoder adds to prompt→mp4.

``--out X.json`` also writes ``X.md``: a row per configuration, ΔPSNR and speed-up against crf 18 ``medium``
at the same threads, the fastest configuration within ``--tolerance-db`` (both PSNRs) of crf 18 ``medium``
with threads auto and the pack's threading, and the one with the shortest streamed tail within it.

Step 1, where scikit-image is installed (``pip install scikit-image``; the pack does not need it): the photos as
PNG files named by their scikit-image name (``motorcycle_left`` is ``stereo_motorcycle()``'s left image).

    python3 bench/mp4_presets.py --extract .photos

Step 2, on the machine measured (PyAV, PIL, torch):

    python3 bench/mp4_presets.py --photos .photos --out bench/results/mp4_presets.json

A dry run of the code: ``--frames 22 --width 256 --height 144 --threads 0 2`` (the clip's length must be one
the video decoder makes, as for 7 latent frames).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

from h3_core.media.mp4 import Mp4Worker, Mp4Writer
from h3_core.media.tiling import temporal_plan

PHOTOS = ("astronaut", "chelsea", "coffee", "motorcycle_left", "rocket")
PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium")
REFERENCE_PRESET, REFERENCE_CRF = "medium", 18
FPS = 24
PEAK = 255.0


def extract(folder: Path) -> dict:
    """Each of ``PHOTOS`` from ``skimage.data`` written as ``folder/<name>.png``; their sizes."""
    from PIL import Image
    from skimage import data

    loaders = {"motorcycle_left": lambda: data.stereo_motorcycle()[0]}
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in PHOTOS:
        pixels = loaders[name]() if name in loaders else getattr(data, name)()
        path = folder / f"{name}.png"
        Image.fromarray(np.ascontiguousarray(pixels[..., :3])).save(path, optimize=True)
        written[name] = dict(shape=list(pixels.shape), bytes=path.stat().st_size)
    return written


def read_photos(folder: Path) -> dict[str, torch.Tensor]:
    """The PNG files of ``folder`` by name (sorted), each as float ``[1, 3, H, W]`` in [0, 255]."""
    from PIL import Image

    paths = sorted(folder.glob("*.png"))
    if not paths:
        raise SystemExit(f"{folder}: no PNG photos (write them with --extract {folder})")
    photos = {}
    for path in paths:
        pixels = np.asarray(Image.open(path).convert("RGB"))
        photos[path.stem] = torch.from_numpy(pixels.copy()).permute(2, 0, 1)[None].float()
    return photos


def camera(photo_w: int, photo_h: int, aspect: float, t: float, forward: bool) -> torch.Tensor:
    """The affine ``theta`` ``[1, 2, 3]`` of one frame at ``t`` in [0, 1] of a photo's shot: the widest window of
    the frame's aspect zoomed 1.0 to 1.3 (or back) while its centre crosses most of the photo and drifts down."""
    full_x = min(1.0, aspect * photo_h / photo_w)
    full_y = full_x * photo_w / (aspect * photo_h)
    zoom = 1.0 + 0.3 * (t if forward else 1.0 - t)
    sx, sy = full_x / zoom, full_y / zoom
    across = (2 * t - 1) * (1 if forward else -1)
    tx, ty = 0.8 * across * (1 - sx), -0.5 * (2 * t - 1) * (1 - sy)
    return torch.tensor([[[sx, 0.0, tx], [0.0, sy, ty]]])


def build_clip(photos: dict[str, torch.Tensor], frames: int, height: int, width: int) -> torch.Tensor:
    """uint8 ``[frames, height, width, 3]``: the photos in order, each panned and zoomed over an equal share of
    the frames (the first ones one frame longer when they do not divide evenly)."""
    clip = torch.empty(frames, height, width, 3, dtype=torch.uint8)
    shares = [frames // len(photos) + (i < frames % len(photos)) for i in range(len(photos))]
    index = 0
    for shot, (photo, share) in enumerate(zip(photos.values(), shares)):
        for step in range(share):
            theta = camera(photo.shape[3], photo.shape[2], width / height, step / max(share - 1, 1), shot % 2 == 0)
            grid = F.affine_grid(theta, [1, 3, height, width], align_corners=False)
            frame = F.grid_sample(photo, grid, mode="bicubic", padding_mode="border", align_corners=False)
            clip[index] = frame[0].permute(1, 2, 0).clamp(0, 255).round().to(torch.uint8)
            index += 1
    return clip


def writer(path: Path, clip: torch.Tensor, preset: str, crf: int, threads: int, thread_type: str) -> Mp4Writer:
    """The pack's own writer for ``clip``; ``thread_type`` "slice" puts back PyAV's default codec threading, which
    the pack replaced by libx264's frame threads."""
    made = Mp4Writer(path, int(clip.shape[2]), int(clip.shape[1]), fps=FPS, crf=crf, preset=preset, threads=threads)
    if thread_type == "slice":
        made._video.codec_context.thread_type = "SLICE"  # the codec opens at the first frame
    return made


def encode(path: Path, clip: torch.Tensor, preset: str, crf: int, threads: int, thread_type: str) -> float:
    """Seconds to write ``clip`` to ``path`` with the pack's writer, every frame at once."""
    start = time.perf_counter()
    with writer(path, clip, preset, crf, threads, thread_type) as made:
        made.write(clip)
        made.close()
    return time.perf_counter() - start


def window_ends(frames: int) -> list[int]:
    """The frame counts final after each decoder window of a ``frames``-frame clip (what H3 Decode & Save hands
    the encoder), from the decoder's own temporal plan."""
    plan = next((p for p in map(temporal_plan, range(2, frames + 2)) if p.num_frames == frames), None)
    if plan is None:
        raise SystemExit(f"--frames {frames}: no latent count decodes to exactly that many frames")
    return [min(frames, plan.output_start(i + 1)) for i in range(len(plan.windows) - 1)] + [frames]


def streamed_tail(
    path: Path, clip: torch.Tensor, preset: str, crf: int, threads: int, window_s: float, busy: bool
) -> dict:
    """The encoder fed as H3 Decode & Save feeds it: the pack's ``Mp4Worker`` gets each window's final frames
    every ``window_s`` seconds (the decode's time per window); ``tail_s`` is the time from the last window to the
    finished file. ``busy``: the feeding thread runs Python for the whole window (as the decode's thread launching
    kernels holds the interpreter) instead of sleeping."""
    handed = 0
    with Mp4Worker(writer(path, clip, preset, crf, threads, "frame")) as worker:
        for end in window_ends(int(clip.shape[0])):
            until = time.perf_counter() + window_s
            if busy:
                while time.perf_counter() < until:
                    pass
            else:
                time.sleep(window_s)
            worker.put(clip[handed:end])
            handed = end
        worker.close()
    return dict(tail_s=worker.tail_s, frames_behind=worker.frames_behind)


def psnr(errors: list[tuple[int, int]]) -> dict:
    """PSNR in dB from per-frame (sum of squared errors, values): the mean of the frames' and the global one."""

    def db(sse, count):
        return 10 * math.log10(PEAK**2 / max(sse / count, 1e-10))

    return dict(
        psnr_mean=statistics.fmean(db(s, n) for s, n in errors),
        psnr_global=db(sum(s for s, _ in errors), sum(n for _, n in errors)),
    )


def frame_error(frame, source: torch.Tensor) -> tuple[int, int]:
    """A yuv420p ``frame`` converted to rgb24 by PyAV against ``source``: (sum of squared errors, values)."""
    diff = np.subtract(frame.to_ndarray(format="rgb24"), source.numpy(), dtype=np.int16).astype(np.int32)
    return int(np.einsum("ijk,ijk->", diff, diff, dtype=np.int64)), diff.size


def errors_of(frames, clip: torch.Tensor) -> list[tuple[int, int]]:
    """``frame_error`` of each of ``frames`` against the clip's frame of the same index, on every CPU."""
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        futures = [pool.submit(frame_error, frame, clip[min(i, clip.shape[0] - 1)]) for i, frame in enumerate(frames)]
        return [future.result() for future in futures]


def decoded_psnr(path: Path, clip: torch.Tensor) -> dict:
    """The file decoded and converted to rgb24 against ``clip``, frame by frame."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        errors = errors_of(container.decode(stream), clip)
    if len(errors) != clip.shape[0]:
        raise RuntimeError(f"{path}: {len(errors)} frames decoded, {clip.shape[0]} written")
    return psnr(errors)


def yuv420p_round_trip(clip: torch.Tensor) -> dict:
    """Seconds of PyAV's RGB-to-yuv420p conversion of the clip alone (one converter for every frame, as the
    encoder keeps; swscale's threads left to PyAV's default), and the PSNR of converting back (no encoder): the
    ceiling of every configuration."""
    import av
    from av.video.reformatter import VideoReformatter

    converter = VideoReformatter()
    start = time.perf_counter()
    frames = [
        converter.reformat(av.VideoFrame.from_ndarray(image.numpy(), format="rgb24"), format="yuv420p")
        for image in clip
    ]
    seconds = time.perf_counter() - start
    return dict(rgb_to_yuv420p_s=seconds, **psnr(errors_of(frames, clip)))


def x264_settings(path: Path) -> dict:
    """The x264 version and threading settings written into the file's SEI."""
    text = path.read_bytes()[: 1 << 20]
    found = re.search(rb"x264 - core (\d+)( r\d+ [0-9a-f]+)?", text)
    options = re.search(rb"options: ([^\x00]*)", text)
    pairs = {}
    if options:
        pairs = dict(item.split("=", 1) for item in options.group(1).decode(errors="replace").split() if "=" in item)
    return dict(
        x264=found.group(0).decode() if found else None,
        **{f"x264_{k}": pairs.get(k) for k in ("threads", "lookahead_threads", "sliced_threads")},
    )


def configurations(args) -> list[dict]:
    """crf 18 for every preset and threading type at threads auto, the extra crfs there, then the other thread
    counts."""

    def at(threads):
        return [
            dict(preset=p, crf=REFERENCE_CRF, threads=threads, thread_type=k)
            for k in args.thread_types
            for p in args.presets
        ]

    extra = [
        dict(preset=p, crf=c, threads=0, thread_type=k)
        for k in args.thread_types
        for p in args.extra_crf_presets
        for c in args.extra_crfs
    ]
    return at(0) + extra + [row for t in args.threads if t != 0 for row in at(t)]


def measure(clip: torch.Tensor, config: dict, folder: Path, args) -> dict:
    path = folder / "clip.mp4"
    seconds = [
        encode(path, clip, config["preset"], config["crf"], config["threads"], config["thread_type"])
        for _ in range(args.reps)
    ]
    row = dict(config, seconds=statistics.median(seconds), seconds_each=seconds, bytes=path.stat().st_size)
    row.update(decoded_psnr(path, clip))
    row.update((k, v) for k, v in x264_settings(path).items() if k != "x264")
    path.unlink()
    if config["thread_type"] == "frame" and config["threads"] in args.tail_threads and config["crf"] == REFERENCE_CRF:
        for load in args.tail_loads:
            tail = streamed_tail(
                path, clip, config["preset"], config["crf"], config["threads"], args.window_s, busy=load == "busy"
            )
            row.update({f"tail_{load}_s": tail["tail_s"], f"frames_behind_{load}": tail["frames_behind"]})
        path.unlink()
    return row


def reference(rows: list[dict], threads: int, thread_type: str) -> dict | None:
    return next(
        (
            r
            for r in rows
            if (r["preset"], r["crf"], r["threads"], r["thread_type"])
            == (REFERENCE_PRESET, REFERENCE_CRF, threads, thread_type)
        ),
        None,
    )


def compare(rows: list[dict]) -> None:
    """Each row's ΔPSNR (dB) and speed-up against crf 18 medium at its threads and threading type."""
    for row in rows:
        ref = reference(rows, row["threads"], row["thread_type"])
        row["delta_psnr_mean"] = None if ref is None else row["psnr_mean"] - ref["psnr_mean"]
        row["delta_psnr_global"] = None if ref is None else row["psnr_global"] - ref["psnr_global"]
        row["speedup_vs_medium"] = None if ref is None else ref["seconds"] / row["seconds"]


def fastest_within(rows: list[dict], ref: dict | None, tolerance: float, threads_auto: bool) -> dict | None:
    """The fastest row whose PSNRs (mean and global) are both no more than ``tolerance`` dB below ``ref``'s."""
    if ref is None:
        return None
    fits = [
        r
        for r in rows
        if r["psnr_mean"] >= ref["psnr_mean"] - tolerance
        and r["psnr_global"] >= ref["psnr_global"] - tolerance
        and (r["threads"] == 0 or not threads_auto)
    ]
    return min(fits, key=lambda r: r["seconds"], default=None)


def cell(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def describe(row: dict | None, ref: dict) -> str:
    if row is None:
        return "none measured"
    return (
        f"`{row['preset']}` crf {row['crf']}, threads {row['threads']} ({row['thread_type']}): "
        f"{row['seconds']:.2f} s against {ref['seconds']:.2f} s ({ref['seconds'] / row['seconds']:.2f}×), "
        f"{row['bytes'] / 1e6:.2f} MB against {ref['bytes'] / 1e6:.2f} MB, PSNR {row['psnr_mean']:.2f} / "
        f"{row['psnr_global']:.2f} dB ({row['psnr_mean'] - ref['psnr_mean']:+.2f} / "
        f"{row['psnr_global'] - ref['psnr_global']:+.2f})"
    )


def table_row(r: dict) -> str:
    return (
        f"| {r['preset']} | {r['threads']} | {r['thread_type']} "
        f"| {r['x264_threads']}+{r['x264_lookahead_threads']} | {r['crf']} | {r['seconds']:.2f} "
        f"| {r['bytes'] / 1e6:.2f} | {r['psnr_mean']:.2f} | {r['psnr_global']:.2f} "
        f"| {cell(r['delta_psnr_mean'], '+.2f')} | {cell(r['delta_psnr_global'], '+.2f')} "
        f"| {cell(r['speedup_vs_medium'], '.2f')} | {cell(r.get('tail_idle_s'), '.2f')} "
        f"| {cell(r.get('tail_busy_s'), '.2f')} |"
    )


def choice(result: dict) -> list[str]:
    ref, tol = result["reference"], result["tolerance_db"]
    if ref is None:
        return ["crf 18 `medium` with threads auto was not measured: no choice made."]
    today = ", the pack's threading" if ref["thread_type"] == "frame" else ""
    return [
        f"Reference: crf 18 `medium`, threads 0, {ref['thread_type']} threading{today}: {ref['seconds']:.2f} s, "
        f"{ref['bytes'] / 1e6:.2f} MB, PSNR {ref['psnr_mean']:.2f} / {ref['psnr_global']:.2f} dB.",
        "",
        f"- Fastest within {tol} dB (both PSNRs), threads auto: {describe(result['fastest_threads_auto'], ref)}.",
        f"- Fastest within {tol} dB (both PSNRs), any threads: {describe(result['fastest_any_threads'], ref)}.",
        f"- Shortest streamed tail within {tol} dB (both PSNRs): {tail_text(result.get('shortest_tail'))}.",
    ]


def tail_text(row: dict | None) -> str:
    if row is None:
        return "none measured"
    return (
        f"`{row['preset']}` crf {row['crf']}, threads {row['threads']}: tail "
        f"{cell(row.get('tail_idle_s'), '.2f')} s idle, {cell(row.get('tail_busy_s'), '.2f')} s busy "
        f"({row.get('frames_behind_busy', '—')} frames behind "
        f"at the last window)"
    )


def markdown(result: dict) -> str:
    clip, ceiling, rows = result["clip"], result["yuv420p_round_trip"], result["rows"]
    lines = [
        "# libx264 presets and threads for the pack's mp4",
        "",
        f"Written by `bench/mp4_presets.py` (see its docstring for the method): `{result['command']}`.",
        "",
        f"{result['cpu_count']} CPUs ({result['cpus_usable']} usable), PyAV {result['pyav']}, FFmpeg "
        f"{result['ffmpeg']}, {result['x264']}; {result['date']}.",
        "",
        f"Clip: {clip['frames']} frames, {clip['width']}×{clip['height']} at {FPS} fps, built from "
        f"{', '.join(clip['photos'])} (scikit-image) in {clip['build_s']:.1f} s. PyAV's RGB-to-yuv420p "
        f"conversion alone (part of every row's seconds, there with the row's threads) takes "
        f"{ceiling['rgb_to_yuv420p_s']:.2f} s; the yuv420p round trip "
        f"alone gives PSNR {ceiling['psnr_mean']:.2f} / {ceiling['psnr_global']:.2f} dB (mean / global), the "
        "ceiling of every row.",
        "",
        "Δ and speed-up: against crf 18 `medium` at the same threads and threading type. x264 threads: what "
        "libx264 ran (its SEI: threads + lookahead threads).",
        "",
        f"Tail: seconds from the last window's frames to the finished file when the pack's worker is fed "
        f"{result['window_s']:.3f} s apart per decoder window (idle: the feeding thread sleeps; busy: it runs "
        "Python), crf 18 rows with frame threads only.",
        "",
        "| preset | threads | threading | x264 threads | crf | s | MB | PSNR mean | PSNR global | Δ mean | "
        "Δ global | × vs medium | tail idle s | tail busy s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {p: i for i, p in enumerate(PRESETS)}
    types = list(dict.fromkeys(r["thread_type"] for r in rows))
    counts = list(dict.fromkeys(r["threads"] for r in rows))
    lines += [
        table_row(r)
        for r in sorted(
            rows,
            key=lambda r: (
                types.index(r["thread_type"]),
                counts.index(r["threads"]),
                r["crf"] != REFERENCE_CRF,
                order.get(r["preset"], len(order)),
                r["crf"],
            ),
        )
    ]
    return "\n".join(lines + [""] + choice(result)) + "\n"


def write(result: dict, out: Path | None) -> str:
    text = record.write(result, out)
    if out is not None:
        out.with_suffix(".md").write_text(markdown(result))
    return text


def versions() -> dict:
    import av

    return dict(
        pyav=av.__version__,
        ffmpeg=av.ffmpeg_version_info,
        libavcodec=".".join(map(str, av.library_versions["libavcodec"])),
    )


def finish(result: dict, thread_type: str, tolerance: float) -> None:
    """The comparisons and the choice, from the rows measured so far."""
    rows = result["rows"]
    compare(rows)
    result["reference"] = ref = reference(rows, 0, thread_type)
    result["fastest_threads_auto"] = fastest_within(rows, ref, tolerance, threads_auto=True)
    result["fastest_any_threads"] = fastest_within(rows, ref, tolerance, threads_auto=False)
    result["shortest_tail"] = shortest_tail(rows, ref, tolerance)


def shortest_tail(rows: list[dict], ref: dict | None, tolerance: float) -> dict | None:
    """The row with the shortest streamed tail (busy when measured, else idle) whose PSNRs are both no more than
    ``tolerance`` dB below ``ref``'s."""

    def tail(row):
        return row.get("tail_busy_s", row.get("tail_idle_s"))

    if ref is None:
        return None
    fits = [
        r
        for r in rows
        if tail(r) is not None
        and r["psnr_mean"] >= ref["psnr_mean"] - tolerance
        and r["psnr_global"] >= ref["psnr_global"] - tolerance
    ]
    return min(fits, key=tail, default=None)


def measure_all(clip: torch.Tensor, args, result: dict) -> None:
    """Every configuration into ``result["rows"]``, the comparisons and ``--out`` brought up to date after each."""
    reference_type = "frame" if "frame" in args.thread_types else args.thread_types[0]
    with tempfile.TemporaryDirectory(prefix="h3_mp4_presets_") as folder:
        warm = Path(folder) / "warm.mp4"
        encode(warm, clip[: min(8, args.frames)], "ultrafast", REFERENCE_CRF, 0, args.thread_types[0])
        result["x264"] = x264_settings(warm)["x264"]
        for config in configurations(args):
            row = measure(clip, config, Path(folder), args)
            result["rows"].append(row)
            print(
                f"{row['preset']:>9} crf {row['crf']} threads {row['threads']:>2} {row['thread_type']:>5}: "
                f"{row['seconds']:6.2f} s {row['bytes'] / 1e6:7.2f} MB {row['psnr_mean']:.2f} / "
                f"{row['psnr_global']:.2f} dB",
                flush=True,
            )
            finish(result, reference_type, args.tolerance_db)
            write(result, args.out)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extract", type=Path, help="write the photos as PNG files into this folder and stop")
    parser.add_argument("--photos", type=Path, help="the folder of PNG photos the clip is built from")
    parser.add_argument("--frames", type=int, default=345)
    parser.add_argument("--width", type=int, default=1344)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--threads", type=int, nargs="+", default=[0, 4, 8, 16], help="libx264 threads (0: auto)")
    parser.add_argument(
        "--thread-types",
        nargs="+",
        default=["slice", "frame"],
        choices=("slice", "frame"),
        help="PyAV's codec threading (slice: its default, the pack's today)",
    )
    parser.add_argument("--extra-crfs", type=int, nargs="*", default=[16, 20], help="also at threads auto, for:")
    parser.add_argument("--extra-crf-presets", nargs="*", default=["ultrafast", "superfast", "veryfast"])
    parser.add_argument("--reps", type=int, default=1, help="encodes per configuration (the median is kept)")
    parser.add_argument("--tolerance-db", type=float, default=0.5)
    parser.add_argument(
        "--window-s",
        type=float,
        default=0.567,
        help="seconds per decoder window when the encoder is fed as H3 Decode & Save feeds it (the "
        "release-size decode's time per window)",
    )
    parser.add_argument(
        "--tail-loads",
        nargs="*",
        default=["idle", "busy"],
        choices=("idle", "busy"),
        help="the feeding thread sleeps (idle) or runs Python (busy) between windows",
    )
    parser.add_argument(
        "--tail-threads",
        type=int,
        nargs="*",
        default=[0],
        help="thread counts whose crf 18 frame-threaded rows also get the streamed tail",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.extract:
        print(record.write(dict(photos=extract(args.extract), folder=str(args.extract)), None))
        return {}
    if args.photos is None:
        parser.error("--photos (or --extract) is required")

    start = time.perf_counter()
    photos = read_photos(args.photos)
    clip = build_clip(photos, args.frames, args.height, args.width)
    result = record.header("mp4_presets.py", argv)
    result.update(cpu_count=os.cpu_count(), cpus_usable=len(os.sched_getaffinity(0)), **versions())
    result["clip"] = dict(
        frames=args.frames,
        width=args.width,
        height=args.height,
        fps=FPS,
        photos=list(photos),
        build_s=time.perf_counter() - start,
    )
    result["yuv420p_round_trip"] = yuv420p_round_trip(clip)
    result.update(tolerance_db=args.tolerance_db, window_s=args.window_s, rows=[], reference=None)
    measure_all(clip, args, result)
    print(write(result, args.out))
    return result


if __name__ == "__main__":
    main()
