"""The text encode node: a prompt (and the FL2VA keyframes as the model's text encoder sees them) to H3's
conditioning."""

from __future__ import annotations

from h3_core.pipeline.media import fit_keyframes

from h3_core.errors import H3InputError

from . import _host
from .conditioning import to_conditioning
from .images import single_image
from .references import presented
from .residency import text_ready


class H3TextEncode:
    CATEGORY = _host.CATEGORY
    RETURN_TYPES = ("CONDITIONING",)
    RETURN_NAMES = ("conditioning",)
    FUNCTION = "encode"
    DESCRIPTION = ("Encodes the prompt with Qwen3-VL (layer-50 states). For FL2VA connect the same first/last frame "
                   "images as on the sampler (the text encoder sees them as they are placed on the canvas); for Ref2VA "
                   "the same references and length.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "text_encoder": ("H3_TEXT_ENCODER",),
            "prompt": ("STRING", {"multiline": True, "default": ""}),
            "width": ("INT", {"default": 1344, "min": 32, "max": 4096, "step": 32}),
            "height": ("INT", {"default": 768, "min": 32, "max": 4096, "step": 32}),
            "length": ("INT", {"default": 124, "min": 5, "max": 3600, "step": 17,
                               "tooltip": "the clip's length (as on the sampler): Ref2VA video and audio references "
                                          "are cut to it"}),
        }, "optional": {"first_frame": ("IMAGE",), "last_frame": ("IMAGE",), "references": ("H3_REFERENCES",)}}

    def encode(self, text_encoder, prompt, width, height, length, first_frame=None, last_frame=None, references=None):
        keyframes = [(anchor, single_image(image, anchor + "_frame"))
                     for anchor, image in (("first", first_frame), ("last", last_frame)) if image is not None]
        if keyframes and references:
            raise H3InputError("keyframes (FL2VA) and references (Ref2VA) cannot be used together; connect one kind")
        placed = fit_keyframes([image for _, image in keyframes], width, height) if keyframes else []
        shown = presented(references, length) if references else ()
        embedding = text_ready(text_encoder).encode(prompt, keyframes=placed, references=shown)
        embedding.keyframe_anchors = tuple(anchor for anchor, _ in keyframes)
        embedding.width, embedding.height = (width, height) if keyframes else (None, None)
        kinds = (tuple(ref.kind for ref in references), length) if references else ()
        return (to_conditioning(embedding, kinds),)
