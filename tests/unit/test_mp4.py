"""Writing clips as mp4 (at once, in ranges, from a thread of its own) and reading audio with PyAV
(h3_core.media.mp4), read back with av."""

import os
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path

import av
import pytest
import torch

from h3_core.errors import H3InputError
from h3_core.media.mp4 import Mp4Worker, Mp4Writer, read_audio, write_mp4


def tone(seconds, rate=32000, channels=2):
    t = torch.arange(int(seconds * rate)) / rate
    return torch.stack([0.5 * torch.sin(2 * torch.pi * (440 + 220 * c) * t) for c in range(channels)])


def test_video_and_stereo_audio_read_back(tmp_path):
    frames = torch.linspace(0, 1, 30 * 48 * 64 * 3).reshape(30, 48, 64, 3)
    path = write_mp4(tmp_path / "clip.mp4", frames, tone(30 / 24), 32000)
    with av.open(str(path)) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        assert (video.codec_context.name, video.codec_context.pix_fmt) == ("h264", "yuv420p")
        assert (video.width, video.height, video.average_rate) == (64, 48, Fraction(24))
        assert (audio.codec_context.name, audio.rate, audio.channels) == ("aac", 32000, 2)
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(decoded) == 30
    # a smooth ramp survives H.264 at crf 18 to within a few levels
    assert abs(torch.from_numpy(decoded[10]).float() - frames[10] * 255).mean() < 3
    waveform, rate = read_audio(path)
    assert rate == 32000 and waveform.shape[0] == 2 and abs(waveform.shape[1] / rate - 30 / 24) < 0.1
    assert list(tmp_path.iterdir()) == [path]


def test_uint8_frames_and_no_audio(tmp_path):
    frames = torch.zeros(5, 32, 32, 3, dtype=torch.uint8)
    path = write_mp4(tmp_path / "silent.mp4", frames)
    with av.open(str(path)) as container:
        assert not container.streams.audio and container.streams.video[0].frames == 5


def test_metadata_is_kept_as_custom_tags(tmp_path):
    """The tags a host stores its workflow under come back from the container as written."""
    tags = {"workflow": '{"nodes": [], "links": []}', "prompt": '{"1": {"class_type": "H3Sampler"}}'}
    path = write_mp4(tmp_path / "tagged.mp4", torch.rand(3, 32, 32, 3), metadata=tags)
    with av.open(str(path)) as container:
        assert {k: container.metadata.get(k) for k in tags} == tags
    with pytest.raises(H3InputError, match="metadata must map text keys to text values"):
        write_mp4(tmp_path / "bad.mp4", torch.rand(3, 32, 32, 3), metadata={"workflow": {"nodes": []}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tagged.mp4"]


def test_a_cancelled_write_leaves_no_file(tmp_path):
    calls = []

    def cancel():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("cancelled")

    with pytest.raises(KeyboardInterrupt):
        write_mp4(tmp_path / "clip.mp4", torch.rand(10, 32, 32, 3), tone(0.5), 32000, check_cancel=cancel)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "frames, audio, message",
    [
        (torch.rand(4, 32, 32), None, r"frames must be RGB images \[frames, height, width, 3\], got \(4, 32, 32\)"),
        (torch.rand(4, 33, 32, 3), None, r"even width and height, got 32x33"),
        (torch.rand(0, 32, 32, 3), None, "no frames"),
        (torch.zeros(2, 32, 32, 3, dtype=torch.int32), None, "floats in \\[0, 1\\] or uint8, got torch.int32"),
        (
            torch.rand(2, 32, 32, 3),
            torch.zeros(3, 100),
            r"audio must be a waveform \[channels \(1 or 2\), samples\], got \(3, 100\)",
        ),
    ],
)
def test_bad_inputs_are_named(tmp_path, frames, audio, message):
    with pytest.raises(H3InputError, match=message):
        write_mp4(tmp_path / "x.mp4", frames, audio, 32000)
    assert list(tmp_path.iterdir()) == []


def test_unreadable_audio_is_named(tmp_path):
    bad = tmp_path / "noise.wav"
    bad.write_bytes(b"not audio at all")
    with pytest.raises(H3InputError, match="noise.wav: cannot be read as an audio or video file"):
        read_audio(bad)
    silent = write_mp4(tmp_path / "silent.mp4", torch.zeros(2, 32, 32, 3, dtype=torch.uint8))
    with pytest.raises(H3InputError, match="silent.mp4: has no audio stream"):
        read_audio(silent)


def test_a_clip_written_in_ranges_is_the_clip_written_at_once(tmp_path):
    frames = torch.rand(30, 32, 48, 3, generator=torch.Generator().manual_seed(1))
    whole = write_mp4(tmp_path / "whole.mp4", frames, tone(30 / 24), 32000, metadata={"workflow": "{}"})
    with Mp4Writer(tmp_path / "ranges.mp4", 48, 32, waveform=tone(30 / 24), metadata={"workflow": "{}"}) as writer:
        for start in (0, 7, 19):
            writer.write(frames[start : {0: 7, 7: 19, 19: 30}[start]])
        ranges = writer.close()
    assert ranges.read_bytes() == whole.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ranges.mp4", "whole.mp4"]


def test_the_worker_writes_the_same_file_and_hands_back_failures(tmp_path):
    frames = torch.rand(20, 32, 48, 3, generator=torch.Generator().manual_seed(2))
    whole = write_mp4(tmp_path / "whole.mp4", frames, tone(20 / 24), 32000)
    with Mp4Worker(Mp4Writer(tmp_path / "worker.mp4", 48, 32, waveform=tone(20 / 24))) as worker:
        worker.put(frames[:13])
        worker.put(frames[13:])
        path = worker.close()
    assert path.read_bytes() == whole.read_bytes() and worker.tail_s is not None
    worker = Mp4Worker(Mp4Writer(tmp_path / "bad.mp4", 48, 32))
    worker.put(frames[:5])
    worker.put(torch.rand(2, 16, 16, 3))  # another size: fails in the thread
    with pytest.raises(H3InputError, match="frames: got 16x16, the clip is 48x32"):
        worker.close()
    with Mp4Worker(Mp4Writer(tmp_path / "aborted.mp4", 48, 32)) as worker:
        worker.put(frames[:5])
        worker.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["whole.mp4", "worker.mp4"]


@pytest.mark.parametrize(
    "preset, threads, message",
    [("warp", 0, "preset: got 'warp'; allowed: ultrafast"), ("medium", -1, "threads: got -1")],
)
def test_encoder_settings_are_checked(tmp_path, preset, threads, message):
    with pytest.raises(H3InputError, match=message):
        Mp4Writer(tmp_path / "x.mp4", 32, 32, preset=preset, threads=threads)
    assert list(tmp_path.iterdir()) == []


def test_a_cancel_while_the_worker_still_encodes_leaves_no_file(tmp_path):
    worker = Mp4Worker(Mp4Writer(tmp_path / "late.mp4", 320, 240))
    worker.put(torch.rand(200, 240, 320, 3))

    def cancel():
        raise InterruptedError("cancelled")

    with pytest.raises(InterruptedError):
        worker.close(cancel)
    assert list(tmp_path.iterdir()) == []


def test_a_hardware_encoder_is_used_where_it_opens_and_libx264_elsewhere(tmp_path, monkeypatch, caplog):
    """Detection opens each candidate: one this FFmpeg lacks and NVENC where no NVIDIA encoder is reachable
    fail, libx264 is used and one line says why; a candidate that opens (libx264 standing in for a hardware
    encoder) is the one written with."""
    import logging

    from h3_core.media import mp4

    if mp4._fails_to_open("h264_nvenc", 64, 32, 24) is None:
        pytest.skip("NVENC opens on this machine")
    used, why = mp4.video_encoder(64, 32, candidates=("h264_missing", "h264_nvenc"))
    assert used == "libx264" and "h264_missing: UnknownCodecError" in why and "h264_nvenc:" in why
    with pytest.raises(H3InputError, match="encoder: h264_nvenc does not open on this machine"):
        mp4.video_encoder(64, 32, choice="h264_nvenc")
    with pytest.raises(H3InputError, match="encoder: got 'x265'; allowed: auto, libx264, h264_nvenc"):
        mp4.video_encoder(64, 32, choice="x265")
    with caplog.at_level(logging.INFO, logger="h3_core.media.mp4"):
        path = write_mp4(tmp_path / "auto.mp4", torch.rand(4, 32, 64, 3), encoder="auto")
    assert "writing H.264 with libx264: no hardware encoder opened (h264_nvenc:" in caplog.text
    with av.open(str(path)) as container:
        assert container.streams.video[0].codec_context.name == "h264"
    monkeypatch.setattr(mp4, "HARDWARE_ENCODERS", ("h264_missing", "libx264"))
    with Mp4Writer(tmp_path / "first_that_opens.mp4", 64, 32, encoder="auto") as writer:
        assert (writer.encoder_used, writer.encoder_reason) == ("libx264", "libx264 opened")
        writer.abort()


def test_the_soundtrack_is_encoded_before_the_first_frame(tmp_path):
    """The worker encodes the audio as soon as it starts, before any frame arrives (so the encoder's work after the
    last frame is video only), and writes the same bytes as the whole write."""
    frames = torch.rand(30, 32, 48, 3, generator=torch.Generator().manual_seed(3))
    whole = write_mp4(tmp_path / "whole.mp4", frames, tone(30 / 24), 32000)
    writer = Mp4Writer(tmp_path / "late.mp4", 48, 32, waveform=tone(30 / 24))
    with Mp4Worker(writer) as worker:
        for _ in range(200):  # the thread starts with the soundtrack, before any frame is handed over
            if writer.audio_written:
                break
            threading.Event().wait(0.01)
        assert writer.audio_written and writer.frames == 0
        worker.put(frames)
        late = worker.close()
    assert late.read_bytes() == whole.read_bytes()


def test_an_encoder_that_failed_at_the_probe_size_is_not_opened_again(monkeypatch):
    """The probe made ahead (``probe_hardware_encoders``, at ``PROBE_SIZE``, in a child process) answers for every
    later size when the encoder failed there; one that opens is still opened at the clip's own size, here."""
    from h3_core.media import mp4

    monkeypatch.setattr(mp4, "_opened", {})
    monkeypatch.setattr(mp4, "HARDWARE_ENCODERS", ("h264_missing", "libx264"))
    opened = []
    create = av.CodecContext.create
    monkeypatch.setattr(av.CodecContext, "create", lambda name, mode: opened.append(name) or create(name, mode))
    probed = mp4.probe_hardware_encoders()
    assert probed["libx264"] is None and probed["h264_missing"].startswith("UnknownCodecError")
    assert opened == []  # the probe opened them in a child process
    assert mp4._fails_to_open("h264_missing", 1344, 768, 24) == probed["h264_missing"]
    assert mp4.video_encoder(1344, 768) == ("libx264", "libx264 opened")
    assert opened == ["libx264"]  # the failed one not opened again; the one that opens tried at the clip's size


def _nice_values() -> dict[str, int]:
    """Each thread of this process and its nice value (``/proc/self/task/<tid>/stat``, field 19)."""
    values = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = (Path("/proc/self/task") / tid / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        values[tid] = int(stat[stat.rfind(")") + 2 :].split()[16])
    return values


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads have nice values of their own on Linux")
def test_the_encoders_threads_run_below_the_rest_of_the_process(tmp_path):
    frames = torch.randint(0, 256, (48, 240, 320, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    before = _nice_values()
    writer = Mp4Writer(tmp_path / "nice.mp4", 320, 240, threads=3)
    with Mp4Worker(writer, niceness=5) as worker:
        worker.put(frames[:24])
        while writer.frames == 0 and worker._error is None:  # libx264 is open once a frame went in
            time.sleep(0.01)
        started = {tid: nice for tid, nice in _nice_values().items() if tid not in before}
        worker.put(frames[24:])
        path = worker.close()
    assert len(started) >= 3, started  # the worker and libx264's frame threads
    assert set(started.values()) == {min(caller + 5, 19)}, started
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller
    with av.open(str(path)) as container:
        assert sum(1 for _ in container.decode(video=0)) == 48
    with pytest.raises(H3InputError, match="niceness: got -1"):
        Mp4Worker(Mp4Writer(tmp_path / "x.mp4", 32, 32), niceness=-1)
