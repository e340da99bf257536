"""The tiled decode's options (h3_core.media.tiling): the VAE's geometry, the tiling and the caller's hooks, frozen
objects checked when they are made, and the decode functions that take them with a handful of parameters."""

import dataclasses
import inspect

import pytest

from h3_core.errors import H3InputError
from h3_core.media.tiling import (
    TRAINED_OVERLAP_PX,
    TRAINED_TILE_PX,
    DecodeHooks,
    Tiling,
    VAEGeometry,
    decode_tiled,
    decode_video,
)
from h3_core.models.video_vae import VideoVAEConfig


@pytest.mark.parametrize(
    "given, message",
    [
        (dict(tiles_per_batch=0), "tiles_per_batch must be >= 1, got 0"),
        (dict(tiles_per_batch=-3), "tiles_per_batch must be >= 1, got -3"),
        (dict(tile_px=64, overlap_px=64), "tile size 64 and overlap 64 must satisfy 0 <= overlap < tile"),
        (dict(tile_px=128, overlap_px=256), "tile size 128 and overlap 256 must satisfy 0 <= overlap < tile"),
        (dict(tile_px=0), "tile size 0 and overlap 64 must satisfy 0 <= overlap < tile"),
        (dict(overlap_px=-16), "tile size 256 and overlap -16 must satisfy 0 <= overlap < tile"),
    ],
)
def test_a_bad_tiling_is_refused_when_made(given, message):
    with pytest.raises(H3InputError) as raised:
        Tiling(**given)
    assert str(raised.value) == message


def test_the_defaults_are_the_trained_tiling_and_h3s_geometry():
    tiling = Tiling()
    assert (tiling.tile_px, tiling.overlap_px, tiling.tiles_per_batch) == (TRAINED_TILE_PX, TRAINED_OVERLAP_PX, 4)
    assert tiling.trained and not Tiling(tile_px=192, overlap_px=48).trained
    assert VAEGeometry() == VAEGeometry(spatial_ratio=16, temporal_ratio=4, clip_length=17, token_drop=3)
    assert VAEGeometry.of(VideoVAEConfig()) == VAEGeometry()
    cfg = dataclasses.make_dataclass("Cfg", ["spatial_ratio", "temporal_ratio", "clip_length", "token_drop"])
    assert VAEGeometry.of(cfg(8, 2, 9, 1)) == VAEGeometry(8, 2, 9, 1)
    hooks = DecodeHooks()
    assert hooks.progress is hooks.check_cancel is hooks.offload is hooks.report is hooks.on_frames is hooks.out is None
    assert hooks.uint8_frames is False


@pytest.mark.parametrize("made", [Tiling(), VAEGeometry(), DecodeHooks()], ids=lambda m: type(m).__name__)
def test_the_options_are_frozen(made):
    field = dataclasses.fields(made)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, field, getattr(made, field))


@pytest.mark.parametrize("function", [decode_tiled, decode_video], ids=lambda f: f.__name__)
def test_the_decode_functions_take_a_handful_of_parameters(function):
    parameters = inspect.signature(function).parameters
    assert len(parameters) <= 8, list(parameters)
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
