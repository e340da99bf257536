"""h3_core.formats.staged_read: tensors read through two staging buffers and several threads equal, byte for
byte, what the safetensors library itself reads from the same file (the outside oracle) and the plain whole
read (``read_eager``), whatever the chunk size against the tensors' sizes; through ``CheckpointFiles`` and
``load_into``, a whole model loads the same. On the CPU the staging buffers are plain memory; the GPU test
(tests/gpu/test_staged_read_cuda.py) runs the pinned, asynchronous form."""

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_checkpoints import TINY_DIT, write_tiny_checkpoints

from h3_core.formats.dit import layouts
from h3_core.formats.files import CheckpointFiles
from h3_core.formats.keymap import load_into
from h3_core.formats.staged_read import StagedReader, read_eager
from h3_core.models.dit import H3DiT
from h3_core.models.precision import keeps_fp32


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory) -> Path:
    """Tensors of every dtype the reader maps, of sizes around and across a few pages, one empty."""
    torch.manual_seed(3)
    tensors = {
        "f32": torch.randn(1000, 37),
        "f16": torch.randn(513).half(),
        "bf16": torch.randn(3, 4097).bfloat16(),
        "e4m3": (torch.randn(257, 129) * 8).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(77).to(torch.float8_e5m2),
        "f64": torch.randn(5, 5).double(),
        "i64": torch.randint(-(2**40), 2**40, (333,)),
        "i32": torch.randint(-1000, 1000, (4, 4, 4), dtype=torch.int32),
        "i8": torch.randint(-128, 127, (4099,), dtype=torch.int8),
        "u8": torch.randint(0, 255, (1,), dtype=torch.uint8),
        "bool": torch.rand(31) > 0.5,
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(2.5),
    }
    path = tmp_path_factory.mktemp("staged") / "mixed.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("chunk_bytes, threads", [(4096, 1), (5000, 3), (1 << 20, 8), (100, 2)])
def test_every_tensor_equals_the_safetensors_read(mixed_file, chunk_bytes, threads):
    with StagedReader("cpu", chunk_bytes=chunk_bytes, threads=threads) as reader:
        staged = CheckpointFiles(mixed_file, reader)
        with safe_open(str(mixed_file), framework="pt") as oracle:
            assert staged.keys == set(oracle.keys())
            for key in oracle.keys():
                expected, got = oracle.get_tensor(key), staged.get(key)
                assert got.dtype == expected.dtype and got.shape == expected.shape, key
                assert torch.equal(_bytes(got), _bytes(expected)), key


def test_staged_equals_the_eager_read(mixed_file):
    plain = CheckpointFiles(mixed_file)
    with StagedReader("cpu", chunk_bytes=8192, threads=4) as reader:
        staged = CheckpointFiles(mixed_file, reader)
        for key in sorted(plain.keys):
            offset, nbytes = staged._spans[key]
            dtype = staged.get(key).dtype
            eager = read_eager(mixed_file, offset, nbytes, dtype, plain.shape(key), "cpu")
            assert torch.equal(_bytes(staged.get(key)), _bytes(eager)), key


def test_a_read_past_the_end_names_the_file(mixed_file):
    size = mixed_file.stat().st_size
    with StagedReader("cpu", chunk_bytes=4096, threads=2) as reader:
        with pytest.raises(OSError, match=r"mixed\.safetensors: the file ended \d+ bytes early"):
            reader.read(mixed_file, size - 10, 100, torch.uint8, (100,))


def test_bad_reader_sizes_are_refused():
    with pytest.raises(ValueError, match="chunk_bytes and threads must be positive, got 0 and 2"):
        StagedReader("cpu", chunk_bytes=0, threads=2)


def test_parameters_count_every_value(mixed_file):
    with safe_open(str(mixed_file), framework="pt") as oracle:
        expected = sum(oracle.get_tensor(k).numel() for k in oracle.keys())
    assert CheckpointFiles(mixed_file).parameters == expected


def _loaded(path: Path, reader) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = H3DiT(TINY_DIT)
    files = CheckpointFiles(path, reader)
    load_into(model, files, layouts(TINY_DIT), what="DiT", dtype=torch.bfloat16, keep_fp32=lambda k: keeps_fp32(k))
    return model.state_dict()


def test_a_model_loaded_through_the_reader_equals_the_mapped_load(tmp_path):
    path = write_tiny_checkpoints(tmp_path).dit
    mapped = _loaded(path, None)
    with StagedReader("cpu", chunk_bytes=4096, threads=3) as reader:
        staged = _loaded(path, reader)
        assert reader._ahead.taken == len(staged)  # every tensor came from the read-ahead
    assert set(staged) == set(mapped)
    assert {v.dtype for v in mapped.values()} == {torch.bfloat16, torch.float32}
    for key, value in mapped.items():
        assert staged[key].dtype == value.dtype and torch.equal(_bytes(staged[key]), _bytes(value)), key


# ---- the read-ahead (h3_core.formats.read_ahead) ------------------------------------------------------


def _spans(files: CheckpointFiles, keys) -> list:
    return [files.span(key) for key in keys]


def _check_all(files: CheckpointFiles, oracle_path: Path, keys) -> None:
    with safe_open(str(oracle_path), framework="pt") as oracle:
        for key in keys:
            expected, got = oracle.get_tensor(key), files.get(key)
            assert got.dtype == expected.dtype and got.shape == expected.shape, key
            assert torch.equal(_bytes(got), _bytes(expected)), key


@pytest.mark.parametrize("chunk_bytes, slabs", [(4096, 2), (1000, 3), (1 << 20, 8), (64, 2)])
def test_reads_taken_in_the_expected_order_come_from_the_read_ahead(mixed_file, chunk_bytes, slabs):
    with StagedReader("cpu", chunk_bytes=chunk_bytes, threads=3, ahead_slabs=slabs) as reader:
        files = CheckpointFiles(mixed_file, reader)
        keys = sorted(files.keys) * 2  # every range twice: the ring is refilled many times over
        reader.expect(_spans(files, keys))
        _check_all(files, mixed_file, keys)
        assert reader._ahead.taken == len(keys)


def test_reads_out_of_order_skipped_or_unexpected_are_still_exact(mixed_file):
    with StagedReader("cpu", chunk_bytes=2048, threads=2, ahead_slabs=2) as reader:
        files = CheckpointFiles(mixed_file, reader)
        keys = sorted(files.keys)
        reader.expect(_spans(files, keys))
        # the fourth asked first (the first three passed over), then one passed over, then in order again
        asked = [keys[3], keys[0], *keys[4:9], keys[12]]
        _check_all(files, mixed_file, asked)
        assert reader._ahead.taken == len(asked) - 1  # all but keys[0], read as if nothing were expected
        _check_all(files, mixed_file, keys)  # none left ahead: read as without the read-ahead


def test_the_read_ahead_reports_a_file_cut_short_on_the_read_that_needs_it(tmp_path, mixed_file):
    short = tmp_path / "short.safetensors"
    short.write_bytes(mixed_file.read_bytes())
    with StagedReader("cpu", chunk_bytes=4096, threads=2, ahead_slabs=2) as reader:
        files = CheckpointFiles(short, reader)  # the header checked against the whole file
        keys = sorted(files.keys, key=lambda k: files._spans[k][0])
        last = keys[-1]
        cut = files._spans[last][0] + files._spans[last][1] - 6
        os.truncate(short, cut)  # then the file shrinks under the load
        reader.expect(_spans(files, keys))
        for key in keys[:-1]:
            if sum(files._spans[key]) <= cut:
                files.get(key)
        with pytest.raises(OSError, match=r"short\.safetensors: the file ended 6 bytes early"):
            files.get(last)


def test_closing_with_ranges_still_ahead_does_not_wait_for_them(mixed_file):
    reader = StagedReader("cpu", chunk_bytes=1024, threads=2, ahead_slabs=2)
    files = CheckpointFiles(mixed_file, reader)
    reader.expect(_spans(files, sorted(files.keys)) * 50)  # far more than the slabs hold
    files.get(sorted(files.keys)[0])
    reader.close()
    assert not reader._ahead._thread.is_alive()
