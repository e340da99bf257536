"""The sampler node: one T2VA, FL2VA or Ref2VA generation from the prompt (and keyframes or references) to video
+ audio latents, on the canvas the text encoding used."""

from __future__ import annotations

from pathlib import Path

import torch
from comfy_api.v0_0_2 import io

from ..h3_core.errors import H3InputError, is_out_of_memory
from ..h3_core.pipeline.clip_on_ranks import generate_clip
from ..h3_core.pipeline.conditioning import encode_keyframes
from ..h3_core.pipeline.noise import NOISE_DRAWS, REFERENCE_AUDIO_T
from ..h3_core.pipeline.request import ClipRequest, Runner
from ..h3_core.pipeline.schedule import AUDIO_SHIFT, VIDEO_SHIFT, check_sigmas
from . import _host
from .attention import DEFAULT
from .checks import check_choice, check_linked_types, linked, verdict
from .conditioning import native_keyframes_of, native_references_of, prompt_of, references_of
from .images import single_image
from .io_types import H3Attention, H3AudioVAE, H3Canvas, H3Keyframes, H3Model, H3References, H3Start, H3VideoVAE
from .latents import LATENT_FORMS, to_latent
from .ranks import RANKS_KEY, SOURCE_KEY, sample_on_ranks
from .references import encoded

MODES = ("T2VA", "FL2VA", "Ref2VA")


def checkpoint_mode(file_name: str) -> str | None:
    """Which of H3's released transformers a DiT file is, by the name it was released under: ``"Ref2VA"`` (its own
    checkpoint, ``minimax_h3_ref2va_*``), ``"FL2VA"`` (T2VA and FL2VA, ``minimax_h3_fl2va_*``), else None."""
    name = file_name.lower()
    return "Ref2VA" if "ref2va" in name else "FL2VA" if "fl2va" in name else None


def check_mode_file(mode: str, file_name: str | None, branch: bool) -> None:
    """The mode against the released transformer the DiT file says it is: H3's Ref2VA runs on its own checkpoint,
    T2VA and FL2VA on the FL2VA one; VDN-H3 (a branch) was trained on the FL2VA transformer, in every mode."""
    kind = None if file_name is None else checkpoint_mode(Path(file_name).name)
    if kind is None:
        return
    want = "FL2VA" if branch or mode != "Ref2VA" else "Ref2VA"
    if kind != want:
        why = (
            "VDN-H3's linear branch was trained on H3's FL2VA transformer"
            if branch
            else f"mode {mode} of plain H3 runs on H3's {want} checkpoint (minimax_h3_{want.lower()}_*)"
        )
        raise H3InputError(
            f"dit_name: {Path(file_name).name} is H3's {kind} checkpoint, but {why}; load that checkpoint in H3 DiT "
            "Loader" + ("" if branch or mode == "Ref2VA" else ", or choose mode Ref2VA")
        )


def check_mode(mode, connected) -> None:
    """What ``mode`` needs connected and refuses (``connected(name)``: whether an input is linked)."""
    check_choice("mode", mode, MODES)
    keyframes = [name for name in ("first_frame", "last_frame", "keyframes") if connected(name)]
    if mode != "FL2VA" and keyframes:
        raise H3InputError(
            f"mode {mode}: takes no keyframes, but {' and '.join(keyframes)} is connected; choose mode "
            "FL2VA or disconnect it"
        )
    if connected("sampler") and connected("start"):
        raise H3InputError(
            "sampler: extending or inpainting (start) runs with the released sampler; disconnect the sampler input"
        )
    if mode == "Ref2VA" and connected("start"):
        raise H3InputError("mode Ref2VA: takes no start clip; extend or inpaint in mode T2VA or FL2VA")
    if mode != "Ref2VA" and connected("references"):
        raise H3InputError(
            f"mode {mode}: takes no references, but references are connected; choose mode Ref2VA or disconnect them"
        )
    if mode == "FL2VA":
        if not keyframes:
            raise H3InputError(
                "mode FL2VA: needs a first_frame, a last_frame or both, or keyframes (H3 Add Keyframe); connect an "
                "image"
            )
        if (connected("first_frame") or connected("last_frame")) and not connected("video_vae"):
            raise H3InputError(
                "mode FL2VA: needs the video_vae input to encode the keyframes; connect an H3 Video VAE Loader"
            )
    if mode == "Ref2VA" and not connected("references"):
        raise H3InputError("mode Ref2VA: needs references; connect an H3 Add Reference chain")


REFERENCE_AUDIO_T_RANGE = (0.5, 1.0)


def check_reference_audio_t(mode, value) -> None:
    """``reference_audio_t`` in its range, and other than 1 only where there are audio references to mix: mode
    Ref2VA. (Named in ``validate_inputs``, the host leaves its range to this check.)"""
    if value is None:
        return
    low, high = REFERENCE_AUDIO_T_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= float(value) <= high:
        raise H3InputError(f"reference_audio_t: got {value!r}; allowed: a number from {low} to {high}")
    if mode is not None and mode != "Ref2VA" and float(value) != REFERENCE_AUDIO_T:
        raise H3InputError(
            f"reference_audio_t: {value} mixes noise into audio references, which only mode Ref2VA has (mode "
            f"{mode}); set it to {REFERENCE_AUDIO_T} or choose mode Ref2VA"
        )


class H3Sampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3Sampler",
            display_name="H3 Sampler",
            category=_host.CATEGORY,
            description="Generates video and stereo audio latents: T2VA from the prompt alone, FL2VA with a first "
            "and/or last frame (encoded with the video VAE) and/or keyframes anywhere (H3 Add Keyframe: images, "
            "clips and audio at any frame), Ref2VA with references (images and videos through "
            "the video VAE, audio and soundtracks through the audio VAE). Euler flow matching, video shift "
            "12 and audio shift 3 as released. Progress per step; cancel stops within one model "
            "evaluation.",
            inputs=[
                H3Model.Input("model"),
                io.Conditioning.Input("conditioning"),
                H3Canvas.Input("canvas", tooltip="the clip's size and length (H3 Canvas), as on H3 Text Encode"),
                io.Combo.Input("mode", options=list(MODES), default="T2VA"),
                io.Int.Input("steps", default=20, min=1, max=200),
                io.Float.Input("video_shift", default=VIDEO_SHIFT, min=0.1, max=100.0, step=0.1),
                io.Float.Input("audio_shift", default=AUDIO_SHIFT, min=0.1, max=100.0, step=0.1),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True),
                H3Attention.Input("attention", optional=True),
                H3VideoVAE.Input(
                    "video_vae", optional=True, tooltip="encodes the keyframes (FL2VA) and image/video references"
                ),
                H3AudioVAE.Input(
                    "audio_vae", optional=True, tooltip="encodes audio references and video soundtracks (Ref2VA)"
                ),
                io.Image.Input("first_frame", optional=True),
                io.Image.Input("last_frame", optional=True),
                H3Keyframes.Input(
                    "keyframes",
                    optional=True,
                    tooltip="FL2VA: keyframes at any frame (H3 Add Keyframe), after first_frame / last_frame",
                ),
                H3References.Input("references", optional=True),
                io.Sigmas.Input(
                    "sigmas",
                    optional=True,
                    tooltip="a σ schedule from 1 down to 0 (e.g. a turbo LoRA's) in place of the released one; "
                    "steps then follows it. The audio stream's σ are derived as ComfyUI's H3 derives them",
                ),
                io.Sampler.Input(
                    "sampler",
                    optional=True,
                    tooltip="one of the host's samplers (KSamplerSelect: euler, res_multistep, ...) in place of the "
                    "released Euler steps, run as on ComfyUI's own H3 model (the audio carried on the video "
                    "schedule); the schedule is the sigmas input (H3 Scheduler) or the released one for steps",
                ),
                H3Start.Input(
                    "start",
                    optional=True,
                    tooltip="T2VA / FL2VA: a clip to extend or inpaint (H3 Extend / Inpaint), with its canvas",
                ),
                io.Float.Input(
                    "reference_audio_t",
                    default=REFERENCE_AUDIO_T,
                    min=REFERENCE_AUDIO_T_RANGE[0],
                    max=REFERENCE_AUDIO_T_RANGE[1],
                    step=0.01,
                    optional=True,
                    tooltip="Ref2VA: 1 holds the audio references clean, as MiniMax's release and ComfyUI's own H3 "
                    "nodes do; below 1 mixes them with that much of the clean signal and the rest noise (t = the "
                    "value), as ComfyUI's H3 model can be asked to",
                ),
                io.Combo.Input(
                    "noise",
                    options=list(NOISE_DRAWS),
                    default=NOISE_DRAWS[0],
                    optional=True,
                    tooltip="how the seed becomes the starting noise: released (as MiniMax's pipeline and diffusers "
                    "draw it) or comfyui (as ComfyUI's own H3 nodes draw it, so the same seed starts from the same "
                    "noise there)",
                ),
                io.Combo.Input(
                    "latent_form",
                    options=list(LATENT_FORMS),
                    default=LATENT_FORMS[0],
                    optional=True,
                    tooltip="h3: the pack's LATENT; native: ComfyUI's own H3 AV latent (a nested video + audio "
                    "pair), for native H3 nodes downstream. The pack's decoders read both",
                ),
            ],
            outputs=[io.Latent.Output(display_name="latent")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, mode=None, input_types=None, reference_audio_t=None, noise=None, latent_form=None):
        def connections():
            if mode is not None:
                check_mode(mode, lambda name: linked(input_types, name))

        return verdict(
            lambda: check_linked_types(cls, input_types),
            connections,
            lambda: check_reference_audio_t(mode, reference_audio_t),
            lambda: noise is None or check_choice("noise", noise, NOISE_DRAWS),
            lambda: latent_form is None or check_choice("latent_form", latent_form, LATENT_FORMS),
        )

    @classmethod
    def execute(
        cls,
        model,
        conditioning,
        canvas,
        mode,
        steps,
        video_shift,
        audio_shift,
        seed,
        attention=None,
        video_vae=None,
        audio_vae=None,
        first_frame=None,
        last_frame=None,
        keyframes=None,
        references=None,
        start=None,
        sigmas=None,
        sampler=None,
        reference_audio_t=REFERENCE_AUDIO_T,
        noise=NOISE_DRAWS[0],
        latent_form=LATENT_FORMS[0],
    ):
        from .patchers import DiTRun, load_vae

        settings = attention or DEFAULT
        given = {
            "first_frame": first_frame,
            "last_frame": last_frame,
            "keyframes": keyframes,
            "references": references,
            "start": start,
            "sampler": sampler,
            "video_vae": video_vae,
            "audio_vae": audio_vae,
        }
        check_mode(mode, lambda name: given[name] is not None)
        source = model.attachments.get(SOURCE_KEY)
        if source is not None:
            check_mode_file(mode, source.base, source.branch is not None)
        check_reference_audio_t(mode, reference_audio_t)
        check_choice("noise", noise, NOISE_DRAWS)
        check_choice("latent_form", latent_form, LATENT_FORMS)
        prompt = prompt_of(conditioning)
        width, height, length = canvas.width, canvas.height, canvas.length
        if settings.attention_precision == "fp8" and getattr(model.model.cfg, "hybrid", False):
            from ..h3_core.attention.fp8 import resolve_fp8_kernel

            # before anything loads: an error if no fp8 kernel runs on the model's device
            kernel = resolve_fp8_kernel(model.load_device, model.model.cfg.head_dim)
            _host.tell(cls.hidden.unique_id, [f"window softmax in fp8 ({kernel} kernel)"])
        if sigmas is not None:
            sigmas = check_sigmas(sigmas)
            steps = int(sigmas.numel()) - 1
            _host.tell(cls.hidden.unique_id, [f"sigmas: {steps} steps from {float(sigmas[0]):g} to 0, as connected"])
        solver = None
        if sampler is not None:
            from .host_sampling import host_solver, sampler_name

            solver = host_solver(sampler, video_shift, audio_shift, seed)
            _host.tell(cls.hidden.unique_id, [f"sampler: {sampler_name(sampler)}, as connected"])
        reference_latents, placed = None, tuple(native_keyframes_of(conditioning))
        if placed and mode == "Ref2VA":
            raise H3InputError(
                f"conditioning: carries {len(placed)} keyframes from ComfyUI's own H3 nodes, which mode Ref2VA "
                "does not take; choose mode T2VA or FL2VA"
            )
        if placed:
            from .keyframes import placed_lines

            _host.tell(cls.hidden.unique_id, ["from the conditioning:", *placed_lines(placed)])
        native_references = native_references_of(conditioning)
        if native_references:
            if mode != "T2VA" or placed:
                raise H3InputError(
                    f"conditioning: carries {len(native_references)} references from ComfyUI's own H3 nodes, which "
                    f"run in mode T2VA with no keyframes (the conditioning brings them); got mode {mode}"
                    + (f" and {len(placed)} keyframes" if placed else "")
                )
            kinds = ", ".join(
                ref.kind + (" with sound" if ref.kind == "video" and ref.audio is not None else "")
                for ref in native_references
            )
            _host.tell(cls.hidden.unique_id, [f"references from the conditioning: {kinds}"])
            reference_latents = native_references
        if mode == "Ref2VA":
            reference_latents = _reference_latents(references, conditioning, length, video_vae, audio_vae, settings)
        if mode == "FL2VA":
            images = [
                (anchor, given[f"{anchor}_frame"])
                for anchor in ("first", "last")
                if given[f"{anchor}_frame"] is not None
            ]
            anchors = tuple(anchor for anchor, _ in images)
            if prompt.keyframe_anchors and (
                prompt.keyframe_anchors != anchors or (prompt.width, prompt.height) != (width, height)
            ):
                raise H3InputError(
                    f"conditioning: was encoded with keyframes {list(prompt.keyframe_anchors)} on a "
                    f"{prompt.width}x{prompt.height} canvas, but the sampler has {list(anchors)} on "
                    f"{width}x{height}; connect the same images and canvas to H3 Text Encode"
                )
            if images:
                placed += encode_keyframes(
                    load_vae(video_vae),
                    [(a, single_image(i, a + "_frame")) for a, i in images],
                    width,
                    height,
                    check_cancel=_host.check_cancel,
                )
            if keyframes:
                from .keyframes import placed_lines

                anywhere = _keyframes_anywhere(keyframes, canvas, video_vae, audio_vae, settings)
                _host.tell(cls.hidden.unique_id, placed_lines(anywhere))
                placed = (*placed, *anywhere)
        node_id = cls.hidden.unique_id

        def fit(packed):
            options = model.fit(DiTRun(packed, settings.memory, steps, settings.compile, settings.attention_precision))
            _host.tell(node_id, model.said())
            return options

        progress = _host.PreviewProgress(steps, model.load_device)
        request = ClipRequest(
            frames=length,
            width=width,
            height=height,
            steps=steps,
            seed=seed,
            keyframes=placed,  # none where there are references (refused above)
            start=start if reference_latents is None else None,  # Ref2VA's clip starts from noise
            video_shift=video_shift,
            audio_shift=audio_shift,
            sigmas=sigmas,
            noise=noise,
            backend=settings.window_backend,
            attention_precision=settings.attention_precision,
            compile=settings.compile,
            reference_audio_t=reference_audio_t,
        )
        runner = Runner(
            device=model.load_device,
            progress=progress.on_progress,
            preview=progress.on_step,
            check_cancel=_host.check_cancel,
            before_sampling=fit,
            solver=solver,
        )
        ranks = model.attachments.get(RANKS_KEY)
        try:
            if ranks is not None:
                video, audio = sample_on_ranks(
                    model, ranks, prompt, request, runner, reference_latents, settings.memory
                )
            else:
                video, audio = generate_clip(model.model, prompt, request, runner, reference_latents)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            # Raised again as torch's own kind, so the host frees its models for the next prompt whatever the
            # error was raised as.
            raise torch.OutOfMemoryError(
                f"out of memory while sampling {width}x{height}, {length} frames (memory_mode {settings.memory}): set "
                "memory_mode auto on H3 Attention & Memory (it plans for the room the card has), choose a smaller "
                f"canvas or length, or free other models. {str(exc).splitlines()[0]}"
            ) from exc
        return io.NodeOutput(to_latent(video, audio, length, latent_form))


def _keyframes_anywhere(keyframes, canvas, video_vae, audio_vae, settings):
    from .keyframes import encoded
    from .patchers import load_vae

    video = load_vae(video_vae) if video_vae is not None and any(k.pixels is not None for k in keyframes) else None
    audio = load_vae(audio_vae) if audio_vae is not None and any(k.waveform is not None for k in keyframes) else None
    return encoded(
        keyframes, canvas.length, canvas.width, canvas.height, video, audio, _host.check_cancel, settings.overrides
    )


def _reference_latents(references, conditioning, length, video_vae, audio_vae, settings):
    from .patchers import load_vae

    kinds = tuple(ref.kind for ref in references)
    if references_of(conditioning) != (kinds, length):
        raise H3InputError(
            f"conditioning: was encoded with references {references_of(conditioning) or 'none'}, but "
            f"the sampler has {kinds} at length {length}; connect the same references and canvas to H3 "
            "Text Encode"
        )
    if video_vae is None and any(kind != "audio" for kind in kinds):
        raise H3InputError("video_vae: image and video references need it; connect an H3 Video VAE Loader")
    needs_audio = any(ref.kind == "audio" or ref.waveform is not None for ref in references)
    if audio_vae is None and needs_audio:
        raise H3InputError("audio_vae: audio references and video soundtracks need it; connect an H3 Audio VAE Loader")
    video = load_vae(video_vae) if video_vae is not None else None
    audio = load_vae(audio_vae) if audio_vae is not None else None
    return encoded(references, length, video, audio, _host.check_cancel, settings.overrides)
