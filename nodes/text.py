"""The text encode node: a prompt (and the FL2VA keyframes as the model's text encoder sees them, or the Ref2VA
references) to H3's conditioning."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..h3_core.errors import H3InputError
from ..h3_core.pipeline.conditioning import fit_keyframes
from . import _host
from .checks import check_linked_types, linked, verdict
from .conditioning import to_conditioning
from .images import single_image
from .io_types import H3Canvas, H3References, H3TextEncoder
from .references import presented


def check_connections(input_types) -> None:
    if linked(input_types, "references") and (linked(input_types, "first_frame") or linked(input_types, "last_frame")):
        raise H3InputError(
            "keyframes (first_frame / last_frame: FL2VA) and references (Ref2VA) cannot be used "
            "together; connect one kind"
        )


def check_prompt(prompt) -> None:
    if prompt is not None and not prompt.strip():
        raise H3InputError("prompt: is empty; describe the clip to generate")


class H3TextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3TextEncode",
            display_name="H3 Text Encode",
            category=_host.CATEGORY,
            description="Encodes the prompt with Qwen3-VL (layer-50 states). For FL2VA connect the same first/last "
            "frame images as on the sampler (the text encoder sees them as they are placed on the canvas); "
            "for Ref2VA the same references. The canvas is the one the sampler reads.",
            inputs=[
                H3TextEncoder.Input("text_encoder"),
                io.String.Input("prompt", multiline=True, default=""),
                H3Canvas.Input("canvas", tooltip="the clip's size and length (H3 Canvas), as on the sampler"),
                io.Image.Input("first_frame", optional=True),
                io.Image.Input("last_frame", optional=True),
                H3References.Input("references", optional=True),
            ],
            outputs=[io.Conditioning.Output(display_name="conditioning")],
        )

    @classmethod
    def validate_inputs(cls, prompt=None, input_types=None):
        return verdict(
            lambda: check_linked_types(cls, input_types),
            lambda: check_connections(input_types),
            lambda: check_prompt(prompt),
        )

    @classmethod
    def execute(cls, text_encoder, prompt, canvas, first_frame=None, last_frame=None, references=None):
        from .patchers import load_text_encoder

        check_prompt(prompt)
        keyframes = [
            (anchor, single_image(image, anchor + "_frame"))
            for anchor, image in (("first", first_frame), ("last", last_frame))
            if image is not None
        ]
        if keyframes and references:
            check_connections({"first_frame": None, "references": None})
        placed = fit_keyframes([image for _, image in keyframes], canvas.width, canvas.height) if keyframes else []
        shown = presented(references, canvas.length) if references else ()
        encoder = load_text_encoder(text_encoder)
        embedding = encoder.encode(prompt, keyframes=placed, references=shown)
        embedding.keyframe_anchors = tuple(anchor for anchor, _ in keyframes)
        embedding.width, embedding.height = (canvas.width, canvas.height) if keyframes else (None, None)
        kinds = (tuple(ref.kind for ref in references), canvas.length) if references else ()
        return io.NodeOutput(to_conditioning(embedding, kinds))
