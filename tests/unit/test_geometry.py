"""Canvas and clip-length rules (h3_core.pipeline.geometry) against diffusers 0.42.1's pipeline helpers."""

import warnings

import pytest

from h3_core.errors import H3InputError
from h3_core.pipeline.geometry import (
    audio_latents,
    canvas_size,
    check_canvas,
    check_frames,
    latent_frames,
    snap_frames,
)

diffusers = pytest.importorskip("diffusers")
from diffusers.modular_pipelines.minimax_h3 import modular_pipeline as ref

RATIOS = [(16, 9), (9, 16), (1, 1), (4, 3), (3, 4), (21, 9), (4, 1), (1, 4), (1920, 1080), (1000, 333), (7, 5)]


@pytest.mark.parametrize("w, h", RATIOS)
def test_canvas_matches_the_released_rule(w, h):
    assert canvas_size(w, h) == ref.resolve_canvas_size(w, h, 32, 768, 768 * 1344)


def test_release_canvas():
    assert canvas_size(16, 9) == (768, 1344)
    assert canvas_size(9, 16) == (1344, 768)


def test_canvas_refuses_extreme_ratios():
    with pytest.raises(H3InputError, match=r"aspect ratios from 1:4 to 4:1, got 5:1 \(5\)"):
        canvas_size(5, 1)
    with pytest.raises(H3InputError, match="must be positive"):
        canvas_size(0, 1)


def test_frame_rules_match_the_released_helpers():
    for n in range(1, 400):
        assert snap_frames(n) == ref.align_num_frames(n, 17, 5)
        assert audio_latents(n) == ref.audio_latent_num_frames(n)
    for k in range(0, 22):
        assert latent_frames(17 * k + 5) == ref.video_latent_num_frames(17 * k + 5, 17, 5) == 5 * k + 2


def test_check_frames():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_frames(124), check_frames(345), check_frames(362)
    with pytest.warns(UserWarning, match="outside the 124-362 frames"):
        check_frames(22)
    with pytest.raises(H3InputError, match=r"length must be 17k \+ 5 frames .* got 100; nearest: 90 or 107"):
        check_frames(100)
    with pytest.raises(H3InputError, match="got 3; nearest: 5"):
        check_frames(3)
    with pytest.raises(H3InputError, match="got '345'"):
        check_frames("345")


def test_check_canvas():
    check_canvas(1344, 768)
    check_canvas(1360, 784)  # 85 x 49 latents: odd sides, padded for the model as native H3 pads them
    with pytest.raises(H3InputError, match="width must be a multiple of 16 px and at least 32, got 1000; nearest: 992"):
        check_canvas(1000, 768)
    with pytest.raises(H3InputError, match="height must be .* got 16; nearest: 32"):
        check_canvas(1344, 16)
