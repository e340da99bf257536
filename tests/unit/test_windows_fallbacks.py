"""The pack off POSIX (docs/platforms.md): each call that Windows lacks, or where Windows behaves otherwise, is
taken away here on Linux (``delattr(os, "preadv")``, a parent id that never changes, the locale's code page in
place of UTF-8, ...) and the fallback the product chooses by feature detection must give what the POSIX path
gives. Last, the product's sources are searched for POSIX-only calls: each one found must be in the table of
docs/platforms.md, which names its fallback and the test here that covers it."""

import ast
import io
import json
import mmap
import multiprocessing
import os
import re
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from test_mp4 import tone
from test_staged_read import _bytes, _loaded, mixed_file  # noqa: F401 (mixed_file: a fixture)
from tiny_checkpoints import write_tiny_checkpoints

from h3_core.errors import H3BackendUnavailable
from h3_core.formats.files import CheckpointFiles
from h3_core.formats.staged_read import StagedReader
from h3_core.media import host_frames, mp4
from h3_core.media.mp4 import Mp4Worker, Mp4Writer, write_mp4
from h3_core.parallel import workers
from h3_core.pipeline import text_encoder

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_preadv(monkeypatch):
    """os as on Windows: no positional reads."""
    monkeypatch.delattr(os, "preadv")
    monkeypatch.delattr(os, "pread", raising=False)


# ---- staged_read: os.preadv -----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_bytes, threads", [(4096, 1), (5000, 3), (100, 2), (1 << 20, 8)])
def test_a_reader_without_preadv_reads_what_preadv_reads(mixed_file, monkeypatch, chunk_bytes, threads):  # noqa: F811
    with StagedReader("cpu", chunk_bytes=chunk_bytes, threads=threads) as reader:
        files = CheckpointFiles(mixed_file, reader)
        with_preadv = {key: files.get(key) for key in sorted(files.keys)}
    monkeypatch.delattr(os, "preadv")
    with StagedReader("cpu", chunk_bytes=chunk_bytes, threads=threads) as reader:
        assert reader._files is not None  # the portable path
        files = CheckpointFiles(mixed_file, reader)
        without = {key: files.get(key) for key in sorted(files.keys)}
    with safe_open(str(mixed_file), framework="pt") as oracle:
        for key, value in without.items():
            expected = oracle.get_tensor(key)
            assert value.dtype == expected.dtype == with_preadv[key].dtype and value.shape == expected.shape, key
            assert torch.equal(_bytes(value), _bytes(with_preadv[key])), key
            assert torch.equal(_bytes(value), _bytes(expected)), key


@pytest.mark.parametrize("chunk_bytes, slabs", [(4096, 2), (1000, 3), (64, 2)])
def test_the_read_ahead_without_preadv_serves_every_read_exactly(mixed_file, no_preadv, chunk_bytes, slabs):  # noqa: F811
    with StagedReader("cpu", chunk_bytes=chunk_bytes, threads=3, ahead_slabs=slabs) as reader:
        files = CheckpointFiles(mixed_file, reader)
        keys = sorted(files.keys) * 2
        reader.expect([files.span(key) for key in keys])
        with safe_open(str(mixed_file), framework="pt") as oracle:
            for key in keys:
                assert torch.equal(_bytes(files.get(key)), _bytes(oracle.get_tensor(key))), key
        assert reader._ahead.taken == len(keys)


def test_a_model_loaded_without_preadv_equals_the_mapped_load(tmp_path, monkeypatch):
    path = write_tiny_checkpoints(tmp_path).dit
    mapped = _loaded(path, None)
    monkeypatch.delattr(os, "preadv")
    with StagedReader("cpu", chunk_bytes=4096, threads=3) as reader:
        staged = _loaded(path, reader)
        assert reader._ahead.taken == len(staged)
    assert set(staged) == set(mapped)
    for key, value in mapped.items():
        assert staged[key].dtype == value.dtype and torch.equal(_bytes(staged[key]), _bytes(value)), key


def test_a_file_cut_short_is_named_without_preadv_too(mixed_file, no_preadv):  # noqa: F811
    size = mixed_file.stat().st_size
    with StagedReader("cpu", chunk_bytes=4096, threads=2) as reader:
        with pytest.raises(OSError, match=r"mixed\.safetensors: the file ended \d+ bytes early"):
            reader.read(mixed_file, size - 10, 100, torch.uint8, (100,))
    with pytest.raises(FileNotFoundError):  # a missing file fails where it is first asked for, as with preadv
        with StagedReader("cpu", chunk_bytes=4096, threads=2) as reader:
            reader.read(mixed_file.with_name("missing.safetensors"), 0, 8, torch.uint8, (8,))


def test_without_preadv_each_thread_has_its_own_files_all_closed_at_the_end(mixed_file, no_preadv):  # noqa: F811
    reader = StagedReader("cpu", chunk_bytes=4096, threads=4)
    files = CheckpointFiles(mixed_file, reader)
    for key in sorted(files.keys):
        files.get(key)
    handles = list(reader._files._open)
    assert 2 <= len(handles) <= 1 + 4  # the one opened to check the file, then one per reading thread
    assert all(not h.closed and isinstance(h, io.FileIO) for h in handles)  # unbuffered: readinto goes straight
    reader.close()
    assert all(h.closed for h in handles)  # Windows keeps an open file from being replaced or removed


def test_without_preadv_the_bytes_go_straight_into_the_staging_buffer(tmp_path, no_preadv):
    """No copy of what is read in Python's memory (tracemalloc sees bytes objects, not torch's buffers): each
    piece goes by ``readinto`` into the staging buffer."""
    path = tmp_path / "big.safetensors"
    save_file({"big": torch.randn(2 << 20)}, str(path))  # 8 MiB
    with StagedReader("cpu", chunk_bytes=4 << 20, threads=2) as reader:
        files = CheckpointFiles(path, reader)
        files.get("big")  # threads started and files opened before measuring
        tracemalloc.start()
        try:
            got = files.get("big")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < (256 << 10), peak  # a read() of one 2 MiB piece would show here
    with safe_open(str(path), framework="pt") as oracle:
        assert torch.equal(got, oracle.get_tensor("big"))


# ---- mp4: os.getpriority / os.setpriority ---------------------------------------------------------------


def test_without_setpriority_the_encoder_runs_at_the_process_priority(tmp_path, monkeypatch):
    frames = torch.rand(12, 32, 48, 3, generator=torch.Generator().manual_seed(5))
    whole = write_mp4(tmp_path / "whole.mp4", frames, tone(12 / 24), 32000)
    monkeypatch.delattr(os, "setpriority")
    monkeypatch.delattr(os, "getpriority")
    assert mp4.lower_this_threads_priority(10) is None
    with Mp4Worker(Mp4Writer(tmp_path / "worker.mp4", 48, 32, waveform=tone(12 / 24)), niceness=10) as worker:
        worker.put(frames[:5])
        worker.put(frames[5:])
        path = worker.close()
    assert path.read_bytes() == whole.read_bytes()


def test_where_setpriority_takes_processes_only_no_thread_id_is_passed(monkeypatch):
    """macOS and the BSDs have setpriority, but a thread's id there is no process's: it is never called."""

    def refuse(*args):
        raise AssertionError(f"setpriority called with {args}")

    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(os, "setpriority", refuse, raising=False)
    monkeypatch.setattr(os, "getpriority", refuse, raising=False)
    assert mp4.lower_this_threads_priority(10) is None


# ---- host_frames: mmap.MADV_HUGEPAGE, mmap.MAP_PRIVATE ------------------------------------------------------


@pytest.mark.parametrize("missing", ["MADV_HUGEPAGE", "MAP_PRIVATE"])
def test_frames_without_huge_page_advice_are_ordinary_memory(monkeypatch, missing):
    shape = (3, 256, 512, 3)  # 4.5 MiB of float32: above the huge-page threshold
    values = torch.rand(shape, generator=torch.Generator().manual_seed(6))
    advised = host_frames.empty_frames(shape, torch.float32)
    advised.copy_(values)
    monkeypatch.delattr(mmap, missing, raising=False)  # Windows has neither, macOS no MADV_HUGEPAGE
    plain = host_frames.empty_frames(shape, torch.float32)
    assert plain.shape == shape and plain.dtype == torch.float32 and plain.is_contiguous()
    plain.copy_(values)
    assert torch.equal(plain, advised)


def test_a_kernel_refusing_the_advice_still_gives_the_frames(monkeypatch):
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE on this platform: the plain path runs (the test above)")

    class Refusing(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(mmap, "mmap", Refusing)
    frames = host_frames.empty_frames((4, 1024, 1024), torch.uint8)
    frames.fill_(7)
    assert frames.shape == (4, 1024, 1024) and int(frames.sum()) == 7 * 4 * 1024 * 1024


# ---- parallel.workers: NCCL, os.getppid -------------------------------------------------------------------


def test_ranks_on_cuda_without_nccl_are_refused_before_any_worker_starts(monkeypatch):
    def no_start(*args, **kwargs):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    monkeypatch.setattr(workers.mp, "get_context", no_start)
    with pytest.raises(H3BackendUnavailable, match=r"H3 Multi-GPU needs NCCL for ranks on CUDA.*remove the H3"):
        workers.RankWorkers(1, devices=["cuda:0", "cuda:1"])
    assert workers._backend(torch.device("cpu")) == "gloo"  # CPU ranks: gloo, which Windows builds have
    monkeypatch.setattr(dist, "is_gloo_available", lambda: False)
    with pytest.raises(H3BackendUnavailable, match="needs gloo for ranks on CPU, which this PyTorch build lacks;"):
        workers._backend(torch.device("cpu"))


class _Exited(BaseException):
    pass


@pytest.mark.parametrize("parent_alive", [True, False])
def test_a_worker_whose_parent_died_exits_where_its_parent_id_never_changes(monkeypatch, parent_alive):
    """Windows adopts no orphan: ``os.getppid()`` keeps naming the dead parent. The worker's watchdog asks the
    parent's sentinel too (multiprocessing's ``parent_process()``, the parent's process handle on Windows)."""

    class Parent:
        def is_alive(self):
            return parent_alive

    exits = []

    def exit_(code):
        exits.append(code)
        raise _Exited

    parent = os.getppid()
    monkeypatch.setattr(os, "getppid", lambda: parent)
    monkeypatch.setattr(multiprocessing, "parent_process", Parent)
    monkeypatch.setattr(os, "_exit", exit_)
    monkeypatch.setattr(workers.time, "sleep", lambda s: threading.Event().wait(0.01))
    watchdog = threading.Thread(target=lambda: _run_quietly(workers._watch_parent, parent), daemon=True)
    watchdog.start()
    watchdog.join(2.0 if not parent_alive else 0.3)
    assert exits == ([] if parent_alive else [3])
    if parent_alive:  # still watching: let it go
        parent_alive = False
        watchdog.join(2.0)
        assert exits == [3]


def _run_quietly(fn, *args):
    try:
        fn(*args)
    except _Exited:
        pass


# ---- JSON read as UTF-8, not the locale's code page -------------------------------------------------------


@pytest.fixture
def windows_code_page(monkeypatch):
    """Text opened without an encoding as on Windows outside UTF-8 mode: in the ANSI code page."""
    monkeypatch.setattr(io, "text_encoding", lambda encoding, stacklevel=2: encoding or "cp1252")


NAME = "C:/Users/Ádám/models/H3"  # "Á" is C3 81 in UTF-8, and 0x81 is no character of cp1252


def test_json_beside_the_weights_is_read_as_utf8_under_any_code_page(tmp_path, windows_code_page):
    folder = tmp_path / "vae"
    folder.mkdir()
    save_file({"w": torch.zeros(2)}, str(folder / "w.safetensors"))
    (folder / "config.json").write_bytes(json.dumps({"_name_or_path": NAME}, ensure_ascii=False).encode())
    assert CheckpointFiles(folder).config() == {"_name_or_path": NAME}
    (folder / text_encoder.SETTINGS_FILE).write_bytes(json.dumps({"note": NAME}, ensure_ascii=False).encode())
    assert text_encoder._folder_settings(folder) == {"note": NAME}


def _text_calls_without_encoding(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call) or any(k.arg == "encoding" for k in node.keywords):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name in ("read_text", "write_text"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
        elif name == "open" and isinstance(func, ast.Name):
            modes = [*node.args[1:2], *(k.value for k in node.keywords if k.arg == "mode")]
            if not (modes and isinstance(modes[0], ast.Constant) and "b" in str(modes[0].value)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} open")
    return found


def _product_sources() -> list[Path]:
    return [ROOT / "__init__.py", *sorted((ROOT / "h3_core").rglob("*.py")), *sorted((ROOT / "nodes").rglob("*.py"))]


def test_the_product_opens_no_text_file_in_the_locales_encoding():
    found = [call for path in _product_sources() for call in _text_calls_without_encoding(path)]
    assert not found, "text read or written without encoding= (the ANSI code page on Windows): " + ", ".join(found)


# ---- the inventory: every POSIX-only call in the product is in docs/platforms.md ---------------------------

POSIX_OS = {
    "preadv", "pread", "pwrite", "pwritev", "posix_fadvise", "posix_fallocate", "sched_getaffinity",
    "sched_setaffinity", "nice", "setpriority", "getpriority", "killpg", "getuid", "geteuid", "getgid",
    "sysconf", "statvfs", "O_DIRECT", "memfd_create", "fork", "forkpty", "setsid", "getpgid", "getppid",
    "mkfifo", "getloadavg", "PRIO_PROCESS", "O_NOATIME", "sync",
}  # fmt: skip
POSIX_MODULES = {"resource", "fcntl", "pwd", "grp", "termios", "pty", "posix"}
POSIX_SIGNALS = {"SIGKILL", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGALRM", "SIGCHLD", "alarm", "setitimer"}
POSIX_PATHS = ("/proc", "/sys/", "/dev/shm", "/tmp")


def _posix_uses(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner, name = node.value.id, node.attr
            if (owner == "os" and name in POSIX_OS) or (owner == "signal" and name in POSIX_SIGNALS):
                found.add(f"{owner}.{name}")
            elif owner == "mmap" and re.fullmatch(r"(MADV|MAP)_\w+", name):
                found.add(f"mmap.{name}")
            elif owner == "mp" or owner == "multiprocessing":
                if name in ("set_start_method", "get_context"):
                    found.add(f"{owner}.{name}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if node.value.startswith(POSIX_PATHS) or node.value in ("fork", "forkserver"):
                found.add(repr(node.value))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found.update(f"import {n}" for n in names if n.split(".")[0] in POSIX_MODULES)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "madvise":
            found.add("madvise")
        elif (  # getattr(os, "NAME", ...) and hasattr(os, "NAME") name it too
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and isinstance(node.args[1], ast.Constant)
        ):
            owner, name = node.args[0].id, str(node.args[1].value)
            if (owner == "os" and name in POSIX_OS) or (owner == "mmap" and re.fullmatch(r"(MADV|MAP)_\w+", name)):
                found.add(f"{owner}.{name}")
    return found


def test_every_posix_only_call_of_the_product_is_in_the_platforms_table():
    table = (ROOT / "docs" / "platforms.md").read_text(encoding="utf-8")
    rows = [line for line in table.splitlines() if line.startswith("|")]
    missing = []
    for path in _product_sources():
        where = path.relative_to(ROOT).as_posix()
        for use in sorted(_posix_uses(path)):
            if not any(where in row and f"`{use}`" in row for row in rows):
                missing.append(f"{where}: {use}")
    assert not missing, "POSIX-only calls missing from docs/platforms.md's table: " + "; ".join(missing)
    for row in rows:  # each test the table names exists in this file
        for test in re.findall(r"`(test_\w+)`", row):
            assert test in globals(), f"docs/platforms.md names {test}, which is not in {Path(__file__).name}"
