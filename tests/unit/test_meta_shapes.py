"""``formats.meta_shapes``: a model's state-dict shapes built once on the meta device, kept in memory and, where a
folder is named, on disk for the next process; a kept file read back gives the shapes built, a damaged one is
built and written again, and another configuration or another version of the sources is another file."""

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from h3_core.formats import meta_shapes as shapes_module
from h3_core.formats.meta_shapes import keep_on_disk, meta_shapes
from h3_core.models.audio_vae import AudioVAE, AudioVAEConfig

BUILT = []


@dataclass(frozen=True)
class Sizes:
    width: int
    depth: int


class Stack(nn.Module):
    def __init__(self, cfg: Sizes):
        super().__init__()
        BUILT.append(cfg)
        self.layers = nn.ModuleList(nn.Linear(cfg.width, cfg.width) for _ in range(cfg.depth))


@pytest.fixture
def folder(tmp_path):
    BUILT.clear()
    shapes_module._remembered.cache_clear()  # each test starts as a new process would
    keep_on_disk(tmp_path)
    yield tmp_path
    keep_on_disk(None)
    shapes_module._remembered.cache_clear()


def test_a_new_process_reads_the_kept_shapes_instead_of_building(folder):
    first = meta_shapes(Stack, Sizes(4, 2))
    assert first == {"layers.0.weight": (4, 4), "layers.0.bias": (4,), "layers.1.weight": (4, 4), "layers.1.bias": (4,)}
    assert BUILT == [Sizes(4, 2)] and len(list(folder.glob("Stack-*.json"))) == 1
    shapes_module._remembered.cache_clear()
    assert meta_shapes(Stack, Sizes(4, 2)) == first and BUILT == [Sizes(4, 2)]  # read, not built
    assert meta_shapes(Stack, Sizes(4, 3)) != first and len(BUILT) == 2  # another configuration, another file
    assert len(list(folder.glob("Stack-*.json"))) == 2 and not list(folder.glob(".*partial"))


def test_a_damaged_file_is_built_again_and_rewritten(folder):
    expected = meta_shapes(Stack, Sizes(6, 1))
    (kept,) = folder.glob("Stack-*.json")
    kept.write_text('[["layers.0.weight", [6')
    shapes_module._remembered.cache_clear()
    assert meta_shapes(Stack, Sizes(6, 1)) == expected and len(BUILT) == 2
    shapes_module._remembered.cache_clear()
    assert meta_shapes(Stack, Sizes(6, 1)) == expected and len(BUILT) == 2  # the rewritten file is read


def test_other_sources_or_another_torch_are_other_files(folder, monkeypatch):
    key = shapes_module._disk_key(Stack, Sizes(4, 2))
    monkeypatch.setattr(shapes_module, "_sources_digest", lambda: "edited sources")
    assert shapes_module._disk_key(Stack, Sizes(4, 2)) != key
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert shapes_module._disk_key(Stack, Sizes(4, 2)) != key


def test_a_released_model_read_back_matches_its_build(folder):
    built = meta_shapes(AudioVAE, AudioVAEConfig())
    shapes_module._remembered.cache_clear()
    keep_on_disk(None)
    assert meta_shapes(AudioVAE, AudioVAEConfig()) == built  # built again, in memory only
    keep_on_disk(folder)
    shapes_module._remembered.cache_clear()
    assert meta_shapes(AudioVAE, AudioVAEConfig()) == built  # read from the file


def test_a_folder_that_cannot_be_written_keeps_the_shapes_in_memory(tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    BUILT.clear()
    shapes_module._remembered.cache_clear()
    keep_on_disk(blocker / "meta_shapes")  # its parent is a file: nothing can be written there
    try:
        assert meta_shapes(Stack, Sizes(2, 1))["layers.0.weight"] == (2, 2)
        assert meta_shapes(Stack, Sizes(2, 1))["layers.0.weight"] == (2, 2) and BUILT == [Sizes(2, 1)]
    finally:
        keep_on_disk(None)
        shapes_module._remembered.cache_clear()
