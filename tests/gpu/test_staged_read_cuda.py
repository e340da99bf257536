"""Reading straight onto a CUDA GPU (h3_core.formats.staged_read; skipped without one): pinned staging buffers,
asynchronous copies, several reads in flight. Every tensor equals, byte for byte, what the safetensors library
reads (moved to the GPU); buffers pinned ahead (``pin_staging_buffers``, what the pack's warm-up does) are the ones
a later reader gets, and a closed reader gives its page-locked memory back to the system; a DiT loaded to the GPU
(fp8 linears and bf16, with the VDN branch) equals the same files loaded into host memory and moved."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_checkpoints import write_tiny_checkpoints

from h3_core.formats.checkpoints import load_h3_model
from h3_core.formats.files import CheckpointFiles, spans_of
from h3_core.formats.staged_read import AHEAD_SLABS, StagedReader, pin_staging_buffers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = torch.device("cuda")


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 16, 64 << 20])
def test_reads_equal_the_safetensors_read(tmp_path, chunk_bytes):
    torch.manual_seed(0)
    tensors = {
        "big": torch.randn(3, 1 << 18),  # 3 MiB: many chunks at the small sizes
        "bf16": torch.randn(4097).bfloat16(),
        "e4m3": (torch.randn(513, 65) * 4).to(torch.float8_e4m3fn),
        "i64": torch.arange(1001),
        "empty": torch.empty(0),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path))
    with StagedReader(DEV, chunk_bytes=chunk_bytes, threads=4) as reader:
        files = CheckpointFiles(path, reader)
        got = {key: files.get(key) for key in sorted(files.keys)}  # all in flight before any is checked
        torch.cuda.synchronize()
    with safe_open(str(path), framework="pt") as oracle:
        for key, value in got.items():
            expected = oracle.get_tensor(key)
            assert value.device.type == "cuda" and value.dtype == expected.dtype and value.shape == expected.shape
            assert torch.equal(_bytes(value).cpu(), _bytes(expected)), key


def test_buffers_pinned_ahead_are_the_ones_a_later_reader_gets(tmp_path):
    chunk_bytes = 3 << 20  # a size no other test pins: PyTorch's host allocator keeps blocks by rounded size
    blocks = lambda: torch.cuda.host_memory_stats()["num_host_alloc"]  # noqa: E731
    before = blocks()
    pin_staging_buffers(chunk_bytes)
    assert blocks() - before == 2 + AHEAD_SLABS  # each buffer a new page-locked block, then freed to the cache
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.randn(1 << 20), "b": torch.randn(1 << 19)}, str(path))
    pinned = blocks()
    with StagedReader(DEV, chunk_bytes=chunk_bytes, threads=2) as reader:
        files = CheckpointFiles(path, reader)
        reader.expect(spans_of([(files, "a"), (files, "b")]))  # the read-ahead's slabs too
        got = {key: files.get(key) for key in ("a", "b")}
        torch.cuda.synchronize()
    assert blocks() == pinned  # the reader's buffers and slabs came from the cache: nothing locked anew
    with safe_open(str(path), framework="pt") as oracle:
        for key, value in got.items():
            assert torch.equal(value.cpu(), oracle.get_tensor(key)), key


def test_a_closed_reader_gives_its_pinned_memory_back(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.randn(1 << 20)}, str(path))
    reserved = lambda: torch.cuda.host_memory_stats()["allocated_bytes.current"]  # noqa: E731 (active + cached)
    with StagedReader(DEV, chunk_bytes=5 << 20, threads=2) as reader:
        files = CheckpointFiles(path, reader)
        reader.expect(spans_of([(files, "a")]))
        files.get("a")
        torch.cuda.synchronize()
        assert reserved() >= (2 + AHEAD_SLABS) * (5 << 20)
    assert reserved() < 5 << 20  # back to the system, not kept in PyTorch's cache


@pytest.mark.parametrize("linears, dtype", [("fp8", torch.bfloat16), ("dtype", torch.bfloat16)])
def test_a_dit_loaded_to_the_gpu_equals_one_loaded_to_the_host_and_moved(tmp_path, linears, dtype):
    files = write_tiny_checkpoints(tmp_path)
    args = dict(branch=files.linear_branch, dtype=dtype, linears=linears, run_device=DEV)
    on_host = load_h3_model(files.dit, device="cpu", **args).to(DEV)
    direct = load_h3_model(files.dit, device=DEV, **args)
    assert direct.linears == on_host.linears and direct.layout == on_host.layout
    expected, got = on_host.state_dict(), direct.state_dict()
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key].device.type == "cuda", key
        assert got[key].dtype == value.dtype and torch.equal(_bytes(got[key]), _bytes(value)), key
