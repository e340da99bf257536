"""One T2VA / I2VA / L2VA / FL2VA generation, from conditioning to latents.

``generate`` packs the request, draws the noise from ``seed`` (in the released order, or as ComfyUI's native H3
does), runs the denoising loop
and returns the latents in model space: video ``[24, T, h, w]`` and audio ``[2, 32, Ta]`` (left, right). The
caller decodes them (``h3_core.media.tiling.decode_video``, the audio VAE). Keyframes come as latents in model space
(``[24, 1, h, w]``, as the released encode produces them) with their anchors, "first" and/or "last", or as
``Keyframe``s at any frame with their soundtracks (held clean at ``t = 1``, like reference audio).
``generate_ref2va`` does the same for a Ref2VA request: images and videos as latents of their own size, their
soundtracks and audio references as audio latents. Reference video rows are noised to ``t = 0.999`` and held
there; reference audio rows ride along clean at ``t = 1`` (or mixed to ``reference_audio_t`` when asked); the
noise order is the same as for keyframes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..attention.layout import WindowSpec
from ..attention.window import check_precision
from ..errors import H3InputError
from ..models.hybrid import RELEASE_WINDOW, HybridContext
from ..models.options import PLAIN, RunOptions
from ..parallel.ulysses import RankGroup
from ..triton_forms import check_compile
from .geometry import audio_latents, check_canvas, check_frames, latent_frames
from .keyframes import Keyframe
from .masks import MaskedStart
from .noise import REFERENCE_AUDIO_T, check_noise, noised_reference_audio, starting_rows
from .packing import (
    PackedSequence,
    Reference,
    pack_ref2va,
    pack_sequence,
    padded_size,
    soundtrack_rows,
    unpatchify,
)
from .prompt import PromptEmbedding
from .sampler import denoise
from .schedule import AUDIO_SHIFT, VIDEO_SHIFT

__all__ = ["generate", "generate_ref2va", "ReferenceLatents"]


@torch.inference_mode()
def generate(
    model,
    prompt: PromptEmbedding,
    *,
    frames: int,
    width: int,
    height: int,
    steps: int,
    seed: int,
    keyframes: Sequence[tuple[str, torch.Tensor] | Keyframe] = (),
    video_shift: float = VIDEO_SHIFT,
    audio_shift: float = AUDIO_SHIFT,
    device: torch.device | str = "cpu",
    progress: Callable[[int, int], None] | None = None,
    check_cancel: Callable[[], None] | None = None,
    window: WindowSpec = RELEASE_WINDOW,
    backend: str = "auto",
    attention_precision: str = "bf16",
    before_sampling: Callable[[PackedSequence], RunOptions | None] | None = None,
    compile: str = "auto",
    noise: str = "released",
    preview: Callable[[int, int, torch.Tensor], None] | None = None,
    start: MaskedStart | None = None,
    sigmas: torch.Tensor | None = None,
    solver=None,
    ranks: RankGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate one clip's latents. ``steps`` counts model evaluations; ``keyframes`` lists, in packed order,
    ``(anchor, latent)`` pairs ("first" / "last", the released FL2VA anchors) and/or ``Keyframe``s (anywhere in
    the clip, with a soundtrack, as ComfyUI's native guides: ``h3_core.pipeline.keyframes``). ``noise`` is the
    starting draw from ``seed`` (``noise.NOISE_DRAWS``): ``released`` as the reference pipeline and diffusers draw
    it, ``comfyui`` as a native ComfyUI H3 graph does. ``preview(step, steps, frame)`` receives each step's clean
    estimate of the middle latent frame (``sampler.denoise``). ``start``: latents to hold where its masks are 0
    and denoise masks for the rest (extend, inpaint: ``h3_core.pipeline.masks``); None generates the whole clip.
    ``sigmas``: a video σ schedule from outside in place of the released one for ``steps``; ``solver``: an integrator
    in place of the released Euler loop, e.g. one of ComfyUI's samplers (both ``sampler.denoise``).
    For a VDN-H3 model (``model.cfg.hybrid``) ``window``, ``backend`` and ``attention_precision`` (``"bf16"`` exact,
    ``"fp8"`` approximate: ``attention.window``) pick the window softmax; a plain H3 model ignores them.
    ``ranks``: run every evaluation across the ranks of a ``parallel.RankGroup`` (every rank calls this with the
    same arguments and returns the same latents); None runs it in this process alone.
    ``before_sampling(packed)`` is called once the request is packed, before the first evaluation (e.g. to fit
    the model to the device for that sequence): the ``RunOptions`` it returns (a placement's
    ``FittedModel.options``) are given to every evaluation, None runs them plain. ``compile`` (``"auto"`` /
    ``"off"``): ``"off"`` runs every evaluation on the plain path, no ``torch.compile`` and no Triton kernel
    (``run_options.Evaluations``); give ``policy.place_for_run`` the same. Runs under inference mode whatever the
    caller's grad state (a model fresh from its constructor included). Returns ``(video [24, T, h, w], audio [2,
    32, Ta])`` in model space, fp32."""
    check_compile(compile)
    check_noise(noise)
    check_precision(attention_precision, backend)
    T, h, w, Ta = _clip_shape(frames, width, height)
    slots, conditions, audio_rows = [], [], []
    for i, keyframe in enumerate(keyframes):
        if isinstance(keyframe, Keyframe):
            slots.append(keyframe.slot(i, frames, h, w, Ta))
            conditions += [keyframe.video] if keyframe.video is not None else []
            audio_rows += [keyframe.audio_rows()] if keyframe.audio is not None else []
            continue
        anchor, latent = keyframe
        if tuple(latent.shape) != (24, 1, h, w):
            raise H3InputError(
                f"the {anchor} keyframe latent must be [24, 1, {h}, {w}] for a {width}x{height} canvas, "
                f"got {tuple(latent.shape)}"
            )
        slots.append(anchor)
        conditions.append(latent)
    packed = pack_sequence(prompt.tags, T, *padded_size(h, w), Ta, keyframes=tuple(slots))
    return _sample(
        model,
        prompt,
        packed,
        conditions,
        audio_rows,
        (T, h, w, Ta),
        steps=steps,
        seed=seed,
        video_shift=video_shift,
        audio_shift=audio_shift,
        device=device,
        progress=progress,
        check_cancel=check_cancel,
        window=window,
        backend=backend,
        attention_precision=attention_precision,
        before_sampling=before_sampling,
        compile=compile,
        noise=noise,
        preview=preview,
        start=start,
        sigmas=sigmas,
        solver=solver,
        ranks=ranks,
    )


@dataclass(frozen=True)
class ReferenceLatents:
    """One Ref2VA reference in model space: ``kind`` "image" (``video`` ``[24, 1, h, w]``), "video" (``video``
    ``[24, t, h, w]``, ``audio`` its soundtrack ``[2, 32, Ta]`` or None) or "audio" (``audio`` ``[2, 32, Ta]``)."""

    kind: str
    video: torch.Tensor | None = None
    audio: torch.Tensor | None = None

    def geometry(self, index: int) -> Reference:
        name = f"reference {index} ({self.kind})"
        if self.kind not in ("image", "video", "audio"):
            raise H3InputError(f"reference {index}: kind must be 'image', 'video' or 'audio', got {self.kind!r}")
        frames = h = w = Ta = 0
        if self.kind in ("image", "video"):
            if self.video is None or self.video.dim() != 4 or self.video.shape[0] != 24:
                got = None if self.video is None else tuple(self.video.shape)
                raise H3InputError(f"{name}: the video latent must be [24, frames, h, w], got {got}")
            frames, h, w = (int(n) for n in self.video.shape[1:])
            if self.kind == "image" and frames != 1:
                raise H3InputError(f"{name}: an image latent has 1 frame, got {frames}")
            if h % 2 or w % 2:
                raise H3InputError(f"{name}: latent height and width must be even (2x2 patches), got {h}x{w}")
        elif self.video is not None:
            raise H3InputError(f"{name}: an audio reference takes no video latent")
        if self.audio is not None:
            if self.kind == "image":
                raise H3InputError(f"{name}: an image reference takes no audio")
            if self.audio.dim() != 3 or tuple(self.audio.shape[:2]) != (2, 32):
                raise H3InputError(f"{name}: the audio latent must be [2, 32, Ta], got {tuple(self.audio.shape)}")
            Ta = int(self.audio.shape[2])
        elif self.kind == "audio":
            raise H3InputError(f"{name}: an audio reference needs its audio latent [2, 32, Ta]")
        return Reference(self.kind, frames=frames, height=h, width=w, audio_latents=Ta)

    def audio_rows(self) -> torch.Tensor | None:
        """The soundtrack in row layout ``[2 · Ta, 32]``, left channel first."""
        return None if self.audio is None else soundtrack_rows(self.audio)


@torch.inference_mode()
def generate_ref2va(
    model,
    prompt: PromptEmbedding,
    references: Sequence[ReferenceLatents],
    *,
    frames: int,
    width: int,
    height: int,
    steps: int,
    seed: int,
    video_shift: float = VIDEO_SHIFT,
    audio_shift: float = AUDIO_SHIFT,
    device: torch.device | str = "cpu",
    progress: Callable[[int, int], None] | None = None,
    check_cancel: Callable[[], None] | None = None,
    window: WindowSpec = RELEASE_WINDOW,
    backend: str = "auto",
    attention_precision: str = "bf16",
    before_sampling: Callable[[PackedSequence], RunOptions | None] | None = None,
    compile: str = "auto",
    reference_audio_t: float = REFERENCE_AUDIO_T,
    noise: str = "released",
    preview: Callable[[int, int, torch.Tensor], None] | None = None,
    sigmas: torch.Tensor | None = None,
    solver=None,
    ranks: RankGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate one Ref2VA clip's latents from ``references`` in packed order (the order the prompt names
    them). Returns ``(video [24, T, h, w], audio [2, 32, Ta])`` in model space, fp32, as ``generate``.
    ``reference_audio_t``: 1 holds the audio references clean, as released; below 1 mixes them with noise to
    that ``t`` as ComfyUI's native H3 does when asked (``noise.noised_reference_audio``), in (0, 1]. ``noise``:
    the starting draw, ``ranks``: across ranks, as ``generate``."""
    check_compile(compile)
    check_noise(noise)
    check_precision(attention_precision, backend)
    if not 0.0 < float(reference_audio_t) <= 1.0:
        raise H3InputError(
            f"reference_audio_t must be in (0, 1] (1: the references held clean), got {reference_audio_t!r}"
        )
    T, h, w, Ta = _clip_shape(frames, width, height)
    geometry = [ref.geometry(i) for i, ref in enumerate(references)]
    packed = pack_ref2va(prompt.tags, geometry, T, *padded_size(h, w), Ta)
    conditions = [ref.video for ref in references if ref.kind in ("image", "video")]
    audio_refs = [rows for rows in (ref.audio_rows() for ref in references) if rows is not None]
    audio_refs = noised_reference_audio(audio_refs, float(reference_audio_t), seed)
    return _sample(
        model,
        prompt,
        packed,
        conditions,
        audio_refs,
        (T, h, w, Ta),
        steps=steps,
        seed=seed,
        video_shift=video_shift,
        audio_shift=audio_shift,
        device=device,
        progress=progress,
        check_cancel=check_cancel,
        window=window,
        backend=backend,
        attention_precision=attention_precision,
        before_sampling=before_sampling,
        compile=compile,
        reference_audio_t=float(reference_audio_t),
        noise=noise,
        preview=preview,
        sigmas=sigmas,
        solver=solver,
        ranks=ranks,
    )


def _clip_shape(frames: int, width: int, height: int) -> tuple[int, int, int, int]:
    """Latent frames, latent height and width, audio latents per channel, after the frame and canvas checks."""
    check_frames(frames)
    check_canvas(width, height)
    return latent_frames(frames), height // 16, width // 16, audio_latents(frames)


def _sample(
    model,
    prompt,
    packed: PackedSequence,
    conditions,
    audio_refs,
    shape,
    *,
    steps,
    seed,
    video_shift,
    audio_shift,
    device,
    progress,
    check_cancel,
    window,
    backend,
    before_sampling,
    compile,
    attention_precision="bf16",
    reference_audio_t=REFERENCE_AUDIO_T,
    noise="released",
    preview=None,
    start=None,
    sigmas=None,
    solver=None,
    ranks=None,
):
    """Noise drawn as ``noise`` says, conditioning in front, the denoising loop, the target unpacked."""
    T, h, w, Ta = shape
    padded = padded_size(h, w)  # the latent grid the model reads (``packing.pad_to_patch``)
    if start is not None:
        start.check(T, h, w, Ta)
    text_dim = getattr(getattr(model, "cfg", None), "text_dim", None)
    if text_dim is not None and prompt.embeds.shape[1] != text_dim:
        raise H3InputError(
            f"the prompt embedding is {prompt.embeds.shape[1]} wide but this DiT reads {text_dim}-wide "
            "text states; encode the prompt with the text encoder made for this model"
        )
    device = torch.device(device)
    condition, video, audio = starting_rows(noise, seed, conditions, T, h, w, Ta)
    video_rows = torch.cat([condition, video]).to(device)
    audio_rows = torch.cat([*audio_refs, audio]).to(device)
    hybrid = None
    if getattr(getattr(model, "cfg", None), "hybrid", False):
        text = (int(packed.text_index.min()), int(packed.text_index.max()) + 1)
        hybrid = HybridContext(packed.layout, window, backend, text, precision=attention_precision)
    if ranks is not None:
        hybrid = ranks.shards(packed.positions.shape[0], model.cfg.heads, hybrid)
    reference_audio = sum(int(rows.shape[0]) for rows in audio_refs)
    run = (before_sampling(packed) if before_sampling is not None else None) or PLAIN
    video_rows, audio_rows = denoise(
        model,
        packed,
        prompt.embeds.to(device),
        video_rows,
        audio_rows,
        steps,
        video_shift=video_shift,
        audio_shift=audio_shift,
        condition_audio_rows=reference_audio,
        condition_audio_t=reference_audio_t,
        progress=progress,
        check_cancel=check_cancel,
        hybrid=hybrid,
        compile=compile,
        preview=preview,
        start=start,
        sigmas=sigmas,
        solver=solver,
        video_size=(T, h, w) if padded != (h, w) else None,
        run=run,
    )
    target = video_rows[packed.condition_rows :].float().cpu()
    video_latents = unpatchify(target, 24, T, *padded)[:, :, :h, :w]
    audio_latents_lr = audio_rows[reference_audio:].float().cpu().reshape(2, Ta, 32).transpose(1, 2)
    return video_latents, audio_latents_lr
