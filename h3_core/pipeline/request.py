"""One clip's request, made once per prompt and passed down: ``ClipRequest`` is what the clip is — its geometry, its
guides, its schedule and noise, the attention and the compile mode — the same on every rank; ``Runner`` is how this
process runs it — its device, progress, previews, cancel check, the placement before the first evaluation, a
solver from outside and the ranks — which rank 0 alone holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..attention.layout import WindowSpec
from ..attention.window import check_precision
from ..errors import H3InputError
from ..models.hybrid import RELEASE_WINDOW
from ..models.options import RunOptions
from ..parallel.ulysses import RankGroup
from ..triton_forms import check_compile
from .geometry import check_canvas, check_frames
from .keyframes import Keyframe
from .masks import MaskedStart
from .noise import REFERENCE_AUDIO_T, check_noise
from .packing import PackedSequence
from .schedule import AUDIO_SHIFT, VIDEO_SHIFT

__all__ = ["ClipRequest", "Runner"]


@dataclass(frozen=True, eq=False)
class ClipRequest:
    """One clip: ``frames`` (17k + 5) at ``width`` × ``height`` pixels, ``steps`` model evaluations from ``seed``.

    ``keyframes``: in packed order, ``(anchor, latent)`` pairs ("first" / "last", the released FL2VA anchors) and/or
    ``Keyframe``s (anywhere in the clip, with a soundtrack, as ComfyUI's native guides); ``start``: latents to hold
    where its masks are 0 (extend, inpaint: ``masks``); neither for Ref2VA. ``video_shift`` / ``audio_shift`` shape
    the released schedule, ``sigmas`` replaces its video σ; ``noise`` is the starting draw (``noise.NOISE_DRAWS``:
    ``released`` as the reference pipeline and diffusers draw it, ``comfyui`` as a native ComfyUI H3 graph does).
    ``window``, ``backend`` and ``attention_precision`` (``"bf16"`` exact, ``"fp8"`` approximate) pick VDN-H3's
    window softmax (``attention.window``; a plain H3 model ignores them). ``compile`` (``"auto"`` / ``"off"``):
    ``"off"`` runs every evaluation on the plain path (``run_options.Evaluations``). ``reference_audio_t``: Ref2VA's
    audio references held clean at 1 (as released) or mixed with noise to that ``t``, in (0, 1].

    Made, the request has been checked: a choice outside what is allowed raises ``H3InputError`` naming it."""

    frames: int
    width: int
    height: int
    steps: int
    seed: int
    keyframes: Sequence[tuple[str, torch.Tensor] | Keyframe] = ()
    start: MaskedStart | None = None
    video_shift: float = VIDEO_SHIFT
    audio_shift: float = AUDIO_SHIFT
    sigmas: torch.Tensor | None = None
    noise: str = "released"
    window: WindowSpec = RELEASE_WINDOW
    backend: str = "auto"
    attention_precision: str = "bf16"
    compile: str = "auto"
    reference_audio_t: float = REFERENCE_AUDIO_T

    def __post_init__(self):
        object.__setattr__(self, "keyframes", tuple(self.keyframes))  # a list given stays the caller's
        check_compile(self.compile)
        check_noise(self.noise)
        check_precision(self.attention_precision, self.backend)
        check_frames(self.frames)
        check_canvas(self.width, self.height)
        if not 0.0 < float(self.reference_audio_t) <= 1.0:
            raise H3InputError(
                f"reference_audio_t must be in (0, 1] (1: the references held clean), got {self.reference_audio_t!r}"
            )


@dataclass(frozen=True)
class Runner:
    """How this process runs a request: on ``device``; ``progress(step, steps)`` after each step; ``preview(step,
    steps, frame)`` with each step's clean estimate of the middle latent frame; ``check_cancel()`` raising to stop;
    ``before_sampling(packed)``, called once the request is packed, before the first evaluation (e.g. to fit the
    model to the device for that sequence), returning the ``RunOptions`` every evaluation is given (None: plain);
    ``solver``, an integrator in place of the released Euler loop (e.g. one of ComfyUI's samplers,
    ``sampler.denoise``); ``ranks``, a ``parallel.RankGroup`` every evaluation runs across (every rank calls with
    the same request), None for this process alone."""

    device: torch.device | str = "cpu"
    progress: Callable[[int, int], None] | None = None
    preview: Callable[[int, int, torch.Tensor], None] | None = None
    check_cancel: Callable[[], None] | None = None
    before_sampling: Callable[[PackedSequence], RunOptions | None] | None = None
    solver: object = None
    ranks: RankGroup | None = None
