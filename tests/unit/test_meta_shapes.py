"""``formats.meta_shapes``: a model's state-dict shapes built once per process on the meta device, a new dict each
call, and a configuration that cannot be hashed built each time."""

from dataclasses import dataclass, field

import pytest
from torch import nn

from h3_core.formats import meta_shapes as shapes_module
from h3_core.formats.meta_shapes import meta_shapes
from h3_core.models.audio_vae import AudioVAE, AudioVAEConfig

BUILT = []


@dataclass(frozen=True)
class Sizes:
    width: int
    depth: int


@dataclass
class Listed:  # holds a list, as a file's latent statistics do: not hashable
    width: int
    extra: list = field(default_factory=list)


class Stack(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        BUILT.append(cfg)
        self.layers = nn.ModuleList(nn.Linear(cfg.width, cfg.width) for _ in range(getattr(cfg, "depth", 1)))


@pytest.fixture(autouse=True)
def fresh():
    BUILT.clear()
    shapes_module._remembered.cache_clear()  # each test starts as a new process would
    yield
    shapes_module._remembered.cache_clear()


def test_shapes_are_built_once_per_configuration():
    first = meta_shapes(Stack, Sizes(4, 2))
    assert first == {"layers.0.weight": (4, 4), "layers.0.bias": (4,), "layers.1.weight": (4, 4), "layers.1.bias": (4,)}
    first["layers.0.weight"] = (0,)  # the caller's dict is its own
    assert meta_shapes(Stack, Sizes(4, 2))["layers.0.weight"] == (4, 4) and BUILT == [Sizes(4, 2)]
    assert meta_shapes(Stack, Sizes(4, 3))["layers.2.bias"] == (4,) and len(BUILT) == 2


def test_an_unhashable_configuration_is_built_each_time():
    assert (
        meta_shapes(Stack, Listed(3))
        == meta_shapes(Stack, Listed(3))
        == {"layers.0.weight": (3, 3), "layers.0.bias": (3,)}
    )
    assert len(BUILT) == 2


def test_a_released_model_matches_its_build_on_the_cpu():
    expected = {key: tuple(value.shape) for key, value in AudioVAE(AudioVAEConfig()).state_dict().items()}
    assert meta_shapes(AudioVAE, AudioVAEConfig()) == expected
