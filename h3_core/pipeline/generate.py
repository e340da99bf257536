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
from typing import Sequence

import torch

from ..errors import H3InputError
from ..models.hybrid import HybridContext
from ..models.options import PLAIN
from .geometry import audio_latents, latent_frames
from .keyframes import Keyframe
from .noise import REFERENCE_AUDIO_T, noised_reference_audio, starting_rows
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
from .request import ClipRequest, Runner
from .sampler import SequenceRows, denoise

__all__ = ["generate", "generate_ref2va", "ReferenceLatents"]


@torch.inference_mode()
def generate(
    model, prompt: PromptEmbedding, request: ClipRequest, runner: Runner = Runner()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate one clip's latents as ``request`` says (``request.ClipRequest``), run as ``runner`` says
    (``request.Runner``). Runs under inference mode whatever the caller's grad state (a model fresh from its
    constructor included). Returns ``(video [24, T, h, w], audio [2, 32, Ta])`` in model space, fp32."""
    frames, width, height = request.frames, request.width, request.height
    T, h, w, Ta = _clip_shape(request)
    slots, conditions, audio_rows = [], [], []
    for i, keyframe in enumerate(request.keyframes):
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
    return _sample(model, prompt, packed, conditions, audio_rows, (T, h, w, Ta), request, runner, REFERENCE_AUDIO_T)


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
    request: ClipRequest,
    runner: Runner = Runner(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate one Ref2VA clip's latents from ``references`` in packed order (the order the prompt names
    them), as ``generate``; ``request.reference_audio_t`` below 1 mixes the audio references with noise to that
    ``t`` as ComfyUI's native H3 does when asked (``noise.noised_reference_audio``). A Ref2VA request takes no
    keyframes and no masked start."""
    if request.keyframes or request.start is not None:
        raise H3InputError("a Ref2VA request takes no keyframes and no masked start (they are T2VA/FL2VA guides)")
    T, h, w, Ta = _clip_shape(request)
    geometry = [ref.geometry(i) for i, ref in enumerate(references)]
    packed = pack_ref2va(prompt.tags, geometry, T, *padded_size(h, w), Ta)
    conditions = [ref.video for ref in references if ref.kind in ("image", "video")]
    audio_refs = [rows for rows in (ref.audio_rows() for ref in references) if rows is not None]
    audio_t = float(request.reference_audio_t)
    audio_refs = noised_reference_audio(audio_refs, audio_t, request.seed)
    return _sample(model, prompt, packed, conditions, audio_refs, (T, h, w, Ta), request, runner, audio_t)


def _clip_shape(request: ClipRequest) -> tuple[int, int, int, int]:
    """Latent frames, latent height and width, audio latents per channel (the request checked its frames and
    canvas)."""
    return latent_frames(request.frames), request.height // 16, request.width // 16, audio_latents(request.frames)


def _sample(model, prompt, packed: PackedSequence, conditions, audio_refs, shape, request, runner, audio_t: float):
    """Noise drawn as the request says, conditioning in front (its audio rows at ``audio_t``), the denoising loop,
    the target unpacked."""
    T, h, w, Ta = shape
    padded = padded_size(h, w)  # the latent grid the model reads (``packing.pad_to_patch``)
    if request.start is not None:
        request.start.check(T, h, w, Ta)
    text_dim = getattr(getattr(model, "cfg", None), "text_dim", None)
    if text_dim is not None and prompt.embeds.shape[1] != text_dim:
        raise H3InputError(
            f"the prompt embedding is {prompt.embeds.shape[1]} wide but this DiT reads {text_dim}-wide "
            "text states; encode the prompt with the text encoder made for this model"
        )
    device = torch.device(runner.device)
    condition, video, audio = starting_rows(request.noise, request.seed, conditions, T, h, w, Ta)
    video_rows = torch.cat([condition, video]).to(device)
    audio_rows = torch.cat([*audio_refs, audio]).to(device)
    hybrid = None
    if getattr(getattr(model, "cfg", None), "hybrid", False):
        text = (int(packed.text_index.min()), int(packed.text_index.max()) + 1)
        hybrid = HybridContext(
            packed.layout, request.window, request.backend, text, precision=request.attention_precision
        )
    if runner.ranks is not None:
        hybrid = runner.ranks.shards(packed.positions.shape[0], model.cfg.heads, hybrid)
    reference_audio = sum(int(rows.shape[0]) for rows in audio_refs)
    run = (runner.before_sampling(packed) if runner.before_sampling is not None else None) or PLAIN
    rows = SequenceRows(prompt.embeds.to(device), video_rows, audio_rows, reference_audio, audio_t)
    video_rows, audio_rows = denoise(
        model, packed, rows, request, runner, hybrid=hybrid, run=run, video_size=(T, h, w) if padded != (h, w) else None
    )
    target = video_rows[packed.condition_rows :].float().cpu()
    video_latents = unpatchify(target, 24, T, *padded)[:, :, :h, :w]
    audio_latents_lr = audio_rows[reference_audio:].float().cpu().reshape(2, Ta, 32).transpose(1, 2)
    return video_latents, audio_latents_lr
