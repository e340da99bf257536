"""The canvas node: the clip's size and length, entered once and read by both the text encoding (keyframes
are placed on the canvas, references cut to the length) and the sampler."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from comfy_api.v0_0_2 import io

from ..h3_core.pipeline.geometry import check_canvas, check_frames
from . import _host, io_types
from .checks import verdict


@dataclass(frozen=True)
class Canvas:
    width: int
    height: int
    length: int  # frames at 24 fps, 17k + 5


def check(width=None, height=None, length=None) -> None:
    """The size on the 16-px latent grid and the length on the 17k + 5 grid; a value not known yet (None: the input is
    linked, so only execution knows it) is skipped."""
    if width is not None or height is not None:
        check_canvas(32 if width is None else width, 32 if height is None else height)
    if length is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # outside the trained lengths is allowed; the sampler says so
            check_frames(length)


class H3Canvas(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3Canvas",
            display_name="H3 Canvas",
            category=_host.CATEGORY,
            description="The clip's width, height (multiples of 16, at least 32; 1344x768 released; a side of an odd "
            "number of latents, a multiple of 16 but not 32, is padded for the model and cropped after, as ComfyUI's "
            "own H3 does) and length (17k + 5 frames at 24 fps; 124-362 trained). Connect it to H3 Text Encode and "
            "to the H3 Sampler.",
            inputs=[
                io.Int.Input("width", default=1344, min=32, max=4096, step=16),
                io.Int.Input("height", default=768, min=32, max=4096, step=16),
                io.Int.Input(
                    "length",
                    default=124,
                    min=5,
                    max=3600,
                    step=17,
                    tooltip="frames at 24 fps: 17k + 5 (124-362 trained)",
                ),
            ],
            outputs=[
                io_types.H3Canvas.Output(display_name="canvas"),
                io.Int.Output(display_name="width"),
                io.Int.Output(display_name="height"),
                io.Int.Output(display_name="length"),
            ],
        )

    @classmethod
    def validate_inputs(cls, width=None, height=None, length=None):
        return verdict(lambda: check(width, height, length))

    @classmethod
    def execute(cls, width, height, length):
        check(width, height, length)
        return io.NodeOutput(Canvas(int(width), int(height), int(length)), width, height, length)
