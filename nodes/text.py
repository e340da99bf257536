"""The text encode node: a prompt (and the FL2VA keyframes as the model's text encoder sees them) to H3's
conditioning."""

from __future__ import annotations

from h3_core.pipeline.media import fit_keyframes

from . import _host
from .conditioning import to_conditioning
from .images import single_image


class H3TextEncode:
    CATEGORY = _host.CATEGORY
    RETURN_TYPES = ("CONDITIONING",)
    RETURN_NAMES = ("conditioning",)
    FUNCTION = "encode"
    DESCRIPTION = ("Encodes the prompt with Qwen3-VL (layer-50 states). For FL2VA connect the same first/last frame "
                   "images as on the sampler: the text encoder sees them as they are placed on the canvas.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "text_encoder": ("H3_TEXT_ENCODER",),
            "prompt": ("STRING", {"multiline": True, "default": ""}),
            "width": ("INT", {"default": 1344, "min": 32, "max": 4096, "step": 32}),
            "height": ("INT", {"default": 768, "min": 32, "max": 4096, "step": 32}),
        }, "optional": {"first_frame": ("IMAGE",), "last_frame": ("IMAGE",)}}

    def encode(self, text_encoder, prompt, width, height, first_frame=None, last_frame=None):
        keyframes = [(anchor, single_image(image, anchor + "_frame"))
                     for anchor, image in (("first", first_frame), ("last", last_frame)) if image is not None]
        placed = fit_keyframes([image for _, image in keyframes], width, height) if keyframes else []
        embedding = text_encoder.encode(prompt, keyframes=placed)
        embedding.keyframe_anchors = tuple(anchor for anchor, _ in keyframes)
        embedding.width, embedding.height = (width, height) if keyframes else (None, None)
        return (to_conditioning(embedding),)
