"""ComfyUI adapters over h3_core, as the host's V3 nodes: input validation before anything loads, the host's model
management, progress, cancel and error messages; no tensor math."""

from comfy_api.v0_0_2 import ComfyExtension

from .attention import H3AttentionSettings
from .canvas import H3Canvas
from .decode import H3AudioDecode, H3VideoDecode
from .decode_and_save import H3DecodeAndSave
from .host_sampling import H3Scheduler
from .keyframes import H3AddKeyframe
from .loaders import H3AudioVAELoader, H3DiTLoader, H3PromptEmbeddingLoader, H3TextEncoderLoader, H3VideoVAELoader
from .lora import H3LoraLoader, H3LoraLoaderNative
from .multi_gpu import H3MultiGPU
from .native_vdn import H3VDNPatch
from .references import H3AddReference, H3LoadAudio
from .regenerate import H3ExtendOrInpaint
from .sampler import H3Sampler
from .save import H3SaveVideo
from .text import H3TextEncode

NODES = [
    H3VDNPatch,
    H3LoraLoaderNative,
    H3DiTLoader,
    H3LoraLoader,
    H3MultiGPU,
    H3VideoVAELoader,
    H3AudioVAELoader,
    H3TextEncoderLoader,
    H3PromptEmbeddingLoader,
    H3Canvas,
    H3TextEncode,
    H3AddKeyframe,
    H3AddReference,
    H3LoadAudio,
    H3AttentionSettings,
    H3ExtendOrInpaint,
    H3Scheduler,
    H3Sampler,
    H3VideoDecode,
    H3AudioDecode,
    H3SaveVideo,
    H3DecodeAndSave,
]


class H3Extension(ComfyExtension):
    async def get_node_list(self):
        return list(NODES)
