"""A file whose weights would not fit the host memory available is refused before it is read
(``nodes.checks.check_host_room``, which the DiT loader calls with ``psutil``'s available memory when it reads
into host memory), naming the file and both amounts; one that fits passes."""

from pathlib import Path

import pytest
from test_host_patches import pack  # noqa: F401  (the pack imported as the host imports it)

GiB = 2**30


def test_a_file_that_does_not_fit_host_memory_is_refused_naming_it(pack):  # noqa: F811
    import h3_hybrid.nodes.checks as checks
    from h3_hybrid.h3_core.errors import H3InputError

    path = Path("/models/minimax_h3_fl2va_bf16.safetensors")
    with pytest.raises(H3InputError, match=r"dit_name: minimax_h3_fl2va_bf16\.safetensors needs about 61\.8 GiB of "
                       r"host memory to load, and 31\.5 GiB is available"):  # fmt: skip
        checks.check_host_room("dit_name", path, int(61.8 * GiB), int(31.5 * GiB))
    checks.check_host_room("dit_name", path, 20 * GiB, int(31.5 * GiB))


def test_the_loader_counts_the_weights_it_will_hold(pack, tmp_path):  # noqa: F811
    import torch
    from h3_hybrid.nodes import loaders
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(10, 20, dtype=torch.bfloat16), "b": torch.zeros(5)}, str(path))
    assert loaders._host_bytes(path, torch.bfloat16, "dtype") == 205 * 2
    assert loaders._host_bytes(path, torch.bfloat16, "fp8") == 205
