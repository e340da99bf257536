"""The sampler node: one T2VA or FL2VA generation from the prompt (and keyframes) to video + audio latents."""

from __future__ import annotations

from h3_core.errors import H3InputError
from h3_core.pipeline.generate import generate, generate_ref2va
from h3_core.pipeline.media import encode_keyframes
from h3_core.pipeline.schedule import AUDIO_SHIFT, VIDEO_SHIFT
from h3_core.placement import fuse_for, place_for_run, working_bytes

from . import _host
from .attention import DEFAULT
from .conditioning import prompt_of, references_of
from .images import single_image
from .latents import to_latent
from .references import encoded
from .residency import make_room, ready

MODES = ("T2VA", "FL2VA", "Ref2VA")


class H3Sampler:
    CATEGORY = _host.CATEGORY
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("latent",)
    FUNCTION = "sample"
    DESCRIPTION = ("Generates video and stereo audio latents: T2VA from the prompt alone, FL2VA with a first and/or "
                   "last frame (encoded with the video VAE), Ref2VA with references (images and videos through the "
                   "video VAE, audio and soundtracks through the audio VAE). Euler flow matching, video shift 12 and audio shift 3 "
                   "as released. Progress per step; cancel stops within one model evaluation.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("H3_MODEL",),
            "conditioning": ("CONDITIONING",),
            "mode": (list(MODES), {"default": "T2VA"}),
            "width": ("INT", {"default": 1344, "min": 32, "max": 4096, "step": 32}),
            "height": ("INT", {"default": 768, "min": 32, "max": 4096, "step": 32}),
            "length": ("INT", {"default": 124, "min": 5, "max": 3600, "step": 17,
                               "tooltip": "frames at 24 fps: 17k + 5 (124-362 trained)"}),
            "steps": ("INT", {"default": 20, "min": 1, "max": 200}),
            "video_shift": ("FLOAT", {"default": VIDEO_SHIFT, "min": 0.1, "max": 100.0, "step": 0.1}),
            "audio_shift": ("FLOAT", {"default": AUDIO_SHIFT, "min": 0.1, "max": 100.0, "step": 0.1}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF}),
        }, "optional": {
            "attention": ("H3_ATTENTION",),
            "video_vae": ("H3_VIDEO_VAE", {"tooltip": "encodes the keyframes (FL2VA) and image/video references"}),
            "audio_vae": ("H3_AUDIO_VAE", {"tooltip": "encodes audio references and video soundtracks (Ref2VA)"}),
            "first_frame": ("IMAGE",),
            "last_frame": ("IMAGE",),
            "references": ("H3_REFERENCES",),
        }, "hidden": {"node_id": "UNIQUE_ID"}}

    def sample(self, model, conditioning, mode, width, height, length, steps, video_shift, audio_shift, seed,
               attention=None, video_vae=None, audio_vae=None, first_frame=None, last_frame=None, references=None,
               node_id=None):
        settings = attention or DEFAULT
        prompt = prompt_of(conditioning)
        images = [(anchor, image) for anchor, image in (("first", first_frame), ("last", last_frame)) if image is not None]
        if mode not in MODES:
            raise H3InputError(f"mode must be one of {list(MODES)}, got {mode!r}")
        if mode != "FL2VA" and images:
            raise H3InputError(f"mode {mode} takes no keyframes, but {' and '.join(a + '_frame' for a, _ in images)} "
                               "is connected; choose mode FL2VA or disconnect it")
        if mode != "Ref2VA" and references:
            raise H3InputError(f"mode {mode} takes no references, but references are connected; choose mode Ref2VA "
                               "or disconnect them")
        reference_latents = None
        if mode == "Ref2VA":
            reference_latents = self._references(references, conditioning, length, video_vae, audio_vae,
                                                 settings.overrides)
        keyframes = ()
        if mode == "FL2VA":
            if not images:
                raise H3InputError("mode FL2VA needs a first_frame, a last_frame or both; connect an image")
            if video_vae is None:
                raise H3InputError("mode FL2VA needs the video_vae input to encode the keyframes; connect an H3 Video "
                                   "VAE loader")
            anchors = tuple(anchor for anchor, _ in images)
            if prompt.keyframe_anchors and (prompt.keyframe_anchors != anchors or (prompt.width, prompt.height)
                                            != (width, height)):
                raise H3InputError(f"the conditioning was encoded with keyframes {list(prompt.keyframe_anchors)} on a "
                                   f"{prompt.width}x{prompt.height} canvas, but the sampler has {list(anchors)} on "
                                   f"{width}x{height}; connect the same images and size to H3 Text Encode")
            video_vae = ready(video_vae, "video VAE")
            keyframes = encode_keyframes(video_vae, [(a, single_image(i, a + "_frame")) for a, i in images], width,
                                         height, check_cancel=_host.check_cancel)
        device = _host.torch_device()
        holder = model

        def fit(packed):
            fuse_for(holder.model, device)  # the paths the run will take, so the room asked for is theirs
            make_room(holder, device, working_bytes(holder.model, packed))
            if holder.fitted is not None:
                holder.fitted.remove()
            holder.fitted = place_for_run(holder.model, packed, device, placement=holder.offload,
                                          memory=settings.memory, steps=steps)
            _host.tell(node_id, holder.fitted.said)

        common = dict(frames=length, width=width, height=height, steps=steps, seed=seed, video_shift=video_shift,
                      audio_shift=audio_shift, device=device, progress=_host.Progress(steps),
                      check_cancel=_host.check_cancel, backend=settings.window_backend, before_sampling=fit)
        if reference_latents is not None:
            video, audio = generate_ref2va(model.model, prompt, reference_latents, **common)
        else:
            video, audio = generate(model.model, prompt, keyframes=keyframes, **common)
        return (to_latent(video, audio, length),)

    @staticmethod
    def _references(references, conditioning, length, video_vae, audio_vae, overrides):
        if not references:
            raise H3InputError("mode Ref2VA needs references; connect an H3 Add Reference chain")
        kinds = tuple(ref.kind for ref in references)
        if references_of(conditioning) != (kinds, length):
            raise H3InputError(f"the conditioning was encoded with references {references_of(conditioning) or 'none'}, "
                               f"but the sampler has {kinds} at length {length}; connect the same references and "
                               "length to H3 Text Encode")
        if video_vae is None and any(kind != "audio" for kind in kinds):
            raise H3InputError("image and video references need the video_vae input; connect an H3 Video VAE loader")
        needs_audio = any(ref.kind == "audio" or ref.waveform is not None for ref in references)
        if audio_vae is None and needs_audio:
            raise H3InputError("audio references and video soundtracks need the audio_vae input; connect an H3 Audio "
                               "VAE loader")
        video_vae = ready(video_vae, "video VAE") if video_vae is not None else None
        audio_vae = ready(audio_vae, "audio VAE") if audio_vae is not None else None
        return encoded(references, length, video_vae, audio_vae, _host.check_cancel, overrides)
