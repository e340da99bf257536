"""The pack's own socket types, as the host's V3 schema declares custom types. The schema version is pinned
(``comfy_api.v0_0_2``), as the host's documentation advises for nodes written against it."""

from comfy_api.v0_0_2 import io

H3Model = io.Custom("H3_MODEL")  # nodes.patchers.H3DiTPatcher
H3VideoVAE = io.Custom("H3_VIDEO_VAE")  # the host's ModelPatcher around h3_core's VideoVAE
H3AudioVAE = io.Custom("H3_AUDIO_VAE")  # the host's ModelPatcher around h3_core's AudioVAE
H3TextEncoder = io.Custom("H3_TEXT_ENCODER")  # nodes.patchers.TextEncoderPatcher
H3References = io.Custom("H3_REFERENCES")  # a list of nodes.references.RawReference, in prompt order
H3Attention = io.Custom("H3_ATTENTION")  # nodes.attention.AttentionSettings
H3Canvas = io.Custom("H3_CANVAS")  # nodes.canvas.Canvas
H3Keyframes = io.Custom("H3_KEYFRAMES")  # a list of nodes.keyframes.RawKeyframe, in packed order
H3Start = io.Custom("H3_START")  # h3_core.pipeline.masks.MaskedStart: held latents and denoise masks
