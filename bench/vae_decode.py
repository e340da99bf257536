"""VAE decode at the release geometry: 345 frames at 1344×768 (102 latents of 48×84) and 14.4 s of
stereo audio, with random weights of the released shapes (timings do not depend on the values).

Reports, per attention backend of the video decoder: seconds for the whole clip (trained 256/64 tiles,
tiles batched), peak GPU memory above the weights, and the same peak for a 2-window clip (memory must
not grow with the clip); a profile of one window split into attention, linear layers and the rest; and
the audio decoder's seconds and peak for the same duration.

    python3 bench/vae_decode.py --out results.json

``--into-mp4 0 8`` adds the decode streamed into an mp4 as H3 Decode & Save runs it (libx264's threads beside the
decode's launching thread), per thread count and per ``--encoder-niceness`` (the encoder's threads that much below
the process; the nodes' default first), in turn with the plain decode.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

from h3_core.attention.vae import resolve_vae_attention
from h3_core.media.mp4 import ENCODER_NICENESS, Mp4Writer
from h3_core.media.tiling import DecodeHooks, Tiling, decode_video, temporal_plan
from h3_core.models.audio_vae import AudioVAE, AudioVAEConfig
from h3_core.models.video_vae import VideoVAE, VideoVAEConfig, keeps_fp32
from h3_core.pipeline.decode_to_mp4 import decode_to_mp4

GiB = record.GiB


def random_video_vae(device, dtype=torch.float16, cfg=VideoVAEConfig()):
    with torch.device("meta"):
        vae = VideoVAE(cfg)
    vae = vae.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            p.normal_(0, 0.02, generator=gen)
            if not keeps_fp32(name):
                p.data = p.data.to(dtype)
    return vae.eval()


def random_audio_vae(device):
    with torch.device("meta"):
        vae = AudioVAE(AudioVAEConfig())
    vae = vae.to_empty(device=device)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            p.normal_(0, 0.02)
        for name, b in vae.named_buffers():
            if name.endswith("filter"):
                from h3_core.models.audio_vae import kaiser_sinc

                b.copy_(kaiser_sinc(0.25, 0.3, 12))
            else:
                b.zero_()
    return vae.eval()


def timed(fn):
    """``fn()``'s result, its wall seconds (the host's copies of the frames included) and its device peak above
    what was allocated before it (``record.peak_gib``)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out, peak = record.peak_gib(fn, True)
    return out, time.perf_counter() - t0, peak


def decode_into_mp4(
    vae, latents, path: Path, threads: int, waveform=None, niceness: int = ENCODER_NICENESS, **options
) -> dict:
    """``latents`` decoded straight into an mp4 at ``path`` as H3 Decode & Save does (``decode_to_mp4``: each
    window's 8-bit frames to libx264 at the nodes' preset on a thread of its own while the next window decodes),
    libx264 with ``threads`` (0: it chooses, the nodes' setting) ``niceness`` below the process. The seconds to the
    last tile (the server's ``decode_s``), to the finished file, the encoder's tail and the frames it still had
    then."""
    last_tile = [0.0]

    def progress(done, total):
        last_tile[0] = time.perf_counter()

    height, width = (n * vae.cfg.spatial_ratio for n in latents.shape[-2:])
    writer = Mp4Writer(path, width, height, threads=threads, waveform=waveform)
    if latents.is_cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    clip = decode_to_mp4(
        vae, latents, writer, hooks=DecodeHooks(progress=progress), encoder_niceness=niceness, **options
    )
    finished = time.perf_counter()
    return dict(
        threads=threads,
        niceness=niceness,
        decode_s=last_tile[0] - started,
        seconds=finished - started,
        tail_s=clip.tail_s,
        frames_behind=clip.frames_behind,
        frames=clip.frames.shape[0],
        file_mb=path.stat().st_size / 1e6,
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=345)
    parser.add_argument("--tiles-per-batch", type=int, nargs="*", default=[4])
    parser.add_argument("--backends", nargs="*", default=["auto", "efficient", "flash", "sdpa"])
    parser.add_argument(
        "--output-memory",
        nargs="*",
        default=["pinned"],
        choices=["pinned", "pageable"],
        help="where the frames go: a pinned buffer given as out=, or the default pageable tensor",
    )
    parser.add_argument(
        "--compile",
        choices=("auto", "off"),
        default="auto",
        help="the decoder blocks compiled where CUDA and Triton run (the nodes' default), or the plain path",
    )
    parser.add_argument(
        "--streamed",
        action="store_true",
        help="also time the lowest-memory fallback (blocks streamed from host) on a 2-window clip",
    )
    parser.add_argument(
        "--into-mp4",
        type=int,
        nargs="*",
        default=[],
        metavar="THREADS",
        help="also decode the clip into an mp4 as H3 Decode & Save does, once per libx264 thread count given "
        "(0: libx264 chooses, the nodes' setting), each beside a plain decode into pageable memory, --mp4-reps "
        "rounds in turn",
    )
    parser.add_argument(
        "--encoder-niceness",
        type=int,
        nargs="*",
        default=[ENCODER_NICENESS],
        metavar="N",
        help="with --into-mp4: the encoder's threads N below the process (Linux nice), each thread count per N",
    )
    parser.add_argument("--mp4-reps", type=int, default=2)
    parser.add_argument("--skip-audio", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("vae_decode.py times the decoders on a GPU: run it where CUDA is available")
    device = torch.device("cuda")
    report = dict(record.header("vae_decode.py", argv), compile=args.compile, video=[], audio=None)

    # A tiny decoder first, so a broken path fails in seconds.
    tiny = random_video_vae(
        device, cfg=VideoVAEConfig(decoder_layers=1, decoder_heads=2, block_out_channels=(8,) * 6, norm_groups=4)
    )
    assert torch.isfinite(decode_video(tiny, torch.randn(24, 7, 4, 4, device=device))).all()
    del tiny

    vae = random_video_vae(device)
    weights = torch.cuda.memory_allocated() / GiB
    latents = (args.frames - 5) // 17 * 5 + 2
    z = torch.randn(24, latents, 48, 84, device=device)
    pinned = torch.empty(args.frames, 768, 1344, 3, pin_memory=True)
    print(f"video VAE weights {weights:.2f} GiB; {latents} latents → {args.frames} frames", flush=True)
    for backend in args.backends:
        for tiles_per_batch in args.tiles_per_batch:
            for memory in args.output_memory:
                overrides = None if backend == "auto" else {"video_vae": backend}
                out = pinned if memory == "pinned" else None
                options = dict(
                    overrides=overrides, tiling=Tiling(tiles_per_batch=tiles_per_batch), compile=args.compile
                )
                try:
                    kernel = resolve_vae_attention("video_vae", device, torch.float16, 64, backend).backend
                    decode_video(vae, z[:, :7, :16, :], **options)  # warm-up
                    frames, seconds, peak = timed(lambda: decode_video(vae, z, hooks=DecodeHooks(out=out), **options))
                    _, _, peak_two = timed(lambda: decode_video(vae, z[:, :12], **options))
                    ok = bool(torch.isfinite(frames).all())
                    row = dict(
                        backend=backend,
                        kernel=kernel,
                        tiles_per_batch=tiles_per_batch,
                        output=memory,
                        seconds=seconds,
                        peak_gib=peak,
                        peak_two_windows_gib=peak_two,
                        finite=ok,
                    )
                    del frames
                except Exception as exc:  # one failing backend must not hide the others
                    row = dict(
                        backend=backend,
                        tiles_per_batch=tiles_per_batch,
                        output=memory,
                        error=f"{type(exc).__name__}: {exc}"[:300],
                    )
                report["video"].append(row)
                print(row, flush=True)
                torch.cuda.empty_cache()

    if args.into_mp4:
        # The decode as the node runs it, the encoder's threads beside it, against the plain decode in turn.
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="h3_vae_decode_mp4_"))
        waveform = torch.rand(2, round(args.frames / 24 * 32000)) * 0.2 - 0.1  # the soundtrack, encoded first
        report["into_mp4"] = []
        for round_ in range(args.mp4_reps):
            _, seconds, _ = timed(lambda: decode_video(vae, z, compile=args.compile))
            report["into_mp4"].append(dict(round=round_, threads=None, seconds=seconds))
            print(report["into_mp4"][-1], flush=True)
            for threads in args.into_mp4:
                for niceness in args.encoder_niceness:
                    row = decode_into_mp4(
                        vae,
                        z,
                        folder / f"clip_{round_}_{threads}_{niceness}.mp4",
                        threads,
                        waveform,
                        niceness,
                        compile=args.compile,
                    )
                    report["into_mp4"].append(dict(round=round_, **row))
                    print(report["into_mp4"][-1], flush=True)
        for clip in folder.iterdir():
            clip.unlink()
        folder.rmdir()

    # Where one window's time goes (28 tiles at the release geometry).
    window = z[:, :7]
    from torch.profiler import ProfilerActivity, profile

    window_out = torch.empty(temporal_plan(7).num_frames, 768, 1344, 3, pin_memory=True)
    decode_video(vae, window, hooks=DecodeHooks(out=window_out), compile=args.compile)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        decode_video(vae, window, hooks=DecodeHooks(out=window_out), compile=args.compile)
        torch.cuda.synchronize()
        report["window_wall_ms"] = (time.perf_counter() - t0) * 1e3
    buckets = {"attention": 0.0, "linear (gemm)": 0.0, "other": 0.0}
    for e in prof.key_averages():
        name, t = e.key.lower(), e.device_time_total / 1e3
        if any(s in name for s in ("attention", "fmha", "flash", "cudnn", "sdpa")):
            buckets["attention"] += t
        elif any(s in name for s in ("gemm", "matmul", "cutlass", "sm90_xmma", "nvjet")):
            buckets["linear (gemm)"] += t
        else:
            buckets["other"] += t
    report["window_profile_ms"] = buckets
    report["top_kernels"] = [
        (e.key[:80], round(e.device_time_total / 1e3, 2))
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]
    ]
    print(report["window_profile_ms"], flush=True)

    if args.streamed:
        # The fallback a card too small for one tile gets: blocks stay in pinned host memory.
        said = vae.offload_decoder_blocks()
        report["streamed"] = dict(said=said, rows=[])
        two = z[:, :12]
        for tiles_per_batch in (1, 4):
            _, seconds, peak = timed(
                lambda: decode_video(vae, two, tiling=Tiling(tiles_per_batch=tiles_per_batch), compile=args.compile)
            )
            row = dict(
                tiles_per_batch=tiles_per_batch,
                seconds_two_windows=seconds,
                peak_gib=peak,
                resident_gib=torch.cuda.memory_allocated() / GiB,
            )
            report["streamed"]["rows"].append(row)
            print(row, flush=True)
    vae = z = pinned = None  # freed before the audio decoder
    torch.cuda.empty_cache()
    if args.skip_audio:
        record.write(report, args.out)
        return report

    audio = random_audio_vae(device)
    latents = torch.randn(2, 32, round(args.frames / 24 * 40), device=device)
    with torch.inference_mode():
        audio.decode(latents[:, :, :40])
        wave, seconds, peak = timed(lambda: audio.decode(latents))
    report["audio"] = dict(
        seconds=seconds, peak_gib=peak, samples=wave.shape[-1], finite=bool(torch.isfinite(wave).all())
    )
    print(report["audio"], flush=True)
    record.write(report, args.out)
    return report


if __name__ == "__main__":
    main()
