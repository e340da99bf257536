"""ComfyUI adapters over h3_core: input validation, progress, cancel and error messages; no tensor math."""

from .attention import H3AttentionSettings
from .decode import H3AudioDecode, H3VideoDecode
from .loaders import (H3AudioVAELoader, H3DiTLoader, H3LoraList, H3PromptEmbeddingLoader, H3TextEncoderLoader,
                      H3VideoVAELoader)
from .references import H3AddReference, H3LoadAudio
from .sampler import H3Sampler
from .save import H3SaveVideo
from .text import H3TextEncode

_NODES = {
    "H3DiTLoader": (H3DiTLoader, "H3 DiT Loader"),
    "H3LoraList": (H3LoraList, "H3 LoRA"),
    "H3VideoVAELoader": (H3VideoVAELoader, "H3 Video VAE Loader"),
    "H3AudioVAELoader": (H3AudioVAELoader, "H3 Audio VAE Loader"),
    "H3TextEncoderLoader": (H3TextEncoderLoader, "H3 Text Encoder Loader"),
    "H3PromptEmbeddingLoader": (H3PromptEmbeddingLoader, "H3 Prompt Embedding Loader"),
    "H3TextEncode": (H3TextEncode, "H3 Text Encode"),
    "H3AddReference": (H3AddReference, "H3 Add Reference (Ref2VA)"),
    "H3LoadAudio": (H3LoadAudio, "H3 Load Audio"),
    "H3AttentionSettings": (H3AttentionSettings, "H3 Attention & Memory"),
    "H3Sampler": (H3Sampler, "H3 Sampler"),
    "H3VideoDecode": (H3VideoDecode, "H3 Video Decode (tiled)"),
    "H3AudioDecode": (H3AudioDecode, "H3 Audio Decode"),
    "H3SaveVideo": (H3SaveVideo, "H3 Save Video (mp4)"),
}
NODE_CLASS_MAPPINGS = {name: cls for name, (cls, _) in _NODES.items()}
NODE_DISPLAY_NAME_MAPPINGS = {name: display for name, (_, display) in _NODES.items()}
