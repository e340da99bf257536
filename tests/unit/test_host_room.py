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
    parameters = loaders.CheckpointFiles(path).parameters
    assert parameters == 205
    assert loaders._host_bytes(parameters, torch.bfloat16, "dtype") == 205 * 2
    assert loaders._host_bytes(parameters, torch.bfloat16, "fp8") == 205


def host_with(monkeypatch, tmp_path, *, host_rule, free_gpu_gib, free_host_gib, reserved_gib=0, dynamic=False):
    """The host's model management as a machine with these amounts free (GiB) would answer, its rule for diffusion
    models answering ``host_rule`` ("cuda" or "cpu"), and a 2 MiB bf16 DiT file; returns the loaders module, the
    GPU and the file's weight count."""
    import comfy.model_management as mm
    import torch
    from h3_hybrid.nodes import _host, loaders
    from safetensors.torch import save_file

    path = tmp_path / "dit.safetensors"
    save_file({"w": torch.zeros(1024, 1024, dtype=torch.bfloat16)}, str(path))  # 2 MiB of bf16
    gpu = torch.device("cuda", 0)
    rule = gpu if host_rule == "cuda" else torch.device("cpu")
    monkeypatch.setattr(mm, "get_torch_device", lambda: gpu)
    monkeypatch.setattr(mm, "unet_inital_load_device", lambda parameters, dtype: rule)
    monkeypatch.setattr(
        mm, "get_free_memory", lambda dev=None: (free_gpu_gib if dev.type == "cuda" else free_host_gib) * GiB
    )
    monkeypatch.setattr(mm, "extra_reserved_memory", lambda: int(reserved_gib * GiB))
    monkeypatch.setattr(_host, "dynamic_vram", lambda: dynamic)
    return loaders, gpu, loaders.CheckpointFiles(path).parameters


@pytest.mark.parametrize("dynamic, free_device, want", [(False, 80, "cpu"), (True, 80, "cuda"), (True, 20, "cpu")])
def test_the_dit_goes_straight_to_the_gpu_by_the_hosts_earlier_rule_under_dynamic_vram(
    pack,  # noqa: F811
    tmp_path,
    monkeypatch,
    dynamic,
    free_device,
    want,  # noqa: F811
):
    """ComfyUI 0.38 with dynamic VRAM answers host memory for every diffusion model it loads (it streams its own);
    the pack, which places its DiT itself, keeps 0.3.75's rule there: the GPU when it has more memory free than the
    host and the weights fit."""
    import torch

    loaders, gpu, parameters = host_with(
        monkeypatch, tmp_path, host_rule="cpu", free_gpu_gib=free_device, free_host_gib=30, dynamic=dynamic
    )
    assert loaders._first_device(parameters, torch.bfloat16, "auto", gpu, lambda: 100 * GiB).type == want


@pytest.mark.parametrize("reserved_gib, want", [(70, "cuda"), (80 - 1 / 1024, "cpu")])
def test_the_dit_goes_straight_to_the_gpu_only_within_the_memory_the_user_left(
    pack,  # noqa: F811
    tmp_path,
    monkeypatch,
    reserved_gib,
    want,
):
    """Where the host's rule answers the GPU (it has more memory free than the host), the weights still have to
    fit what ``--reserve-vram`` leaves: a budget narrowed below them reads them to host memory, from where the plan
    streams them (the host's rule looks at the free memory alone)."""
    import torch
    from h3_hybrid.nodes import _host

    loaders, gpu, parameters = host_with(
        monkeypatch, tmp_path, host_rule="cuda", free_gpu_gib=80, free_host_gib=30, reserved_gib=reserved_gib
    )
    assert loaders._first_device(parameters, torch.bfloat16, "auto", gpu, lambda: 20 * GiB).type == want
    assert _host.free_memory(gpu) == int(80 * GiB) - int(reserved_gib * GiB)


@pytest.mark.parametrize(
    "free_gpu_gib, reserved_gib, runs_as_is_gib, want",
    [(78, 0, 32.6, "cuda"), (78, 54.8, 32.6, "cpu"), (78, 0, 78, "cpu"), (24, 0, 32.6, "cpu")],
)
def test_a_dit_that_will_run_as_it_is_goes_straight_to_the_gpu_whatever_the_host_has_free(
    pack,  # noqa: F811
    tmp_path,
    monkeypatch,
    free_gpu_gib,
    reserved_gib,
    runs_as_is_gib,
    want,
):
    """On a machine with more host memory free than the card (an 80 GB card beside 125 GB) the host's rule reads
    a diffusion model to host memory, and the sampler then moves it; where the weights and one evaluation of the
    released clip fit the share of the budget a plan fills, the plan keeps the model resident, so it is read
    straight to the card. Where they do not (a budget narrowed to 24 GiB, a card of 24 GB), the host's rule
    stands."""
    import torch

    loaders, gpu, parameters = host_with(
        monkeypatch, tmp_path, host_rule="cpu", free_gpu_gib=free_gpu_gib, free_host_gib=125, reserved_gib=reserved_gib
    )
    asked = []

    def runs_as_is():
        asked.append(True)
        return int(runs_as_is_gib * GiB)

    assert loaders._first_device(parameters, torch.bfloat16, "auto", gpu, runs_as_is).type == want
    assert asked  # asked for the host's own device
    asked.clear()
    assert loaders._first_device(parameters, torch.bfloat16, "stream blocks", gpu, runs_as_is).type == "cpu"
    assert not asked  # streamed blocks live in host memory: nothing to predict
