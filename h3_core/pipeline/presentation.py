"""What Qwen3-VL reads for one request: the prompt, preceded by a label (and vision blocks) per keyframe or
reference, with no chat template and no special tokens around it.

* FL2VA: for keyframe i (1-based, packed order) ``"<Picture i>: "`` and one image vision block
  (``<|vision_start|>``, ``<|image_pad|>`` × its token count, ``<|vision_end|>``), then the prompt.
* Ref2VA, per reference in packed order, numbered per modality: an image gives ``"<Picture i>: "`` and an
  image block; an audio reference gives ``"<Audio j>: "`` alone (a waveform never reaches Qwen); a video
  gives ``"<Video k>: "`` and, per merged group of sampled frames, ``"<{t:.1f} seconds>"`` and a video
  block. A video with a soundtrack is labelled ``"<Audio j>: "`` before its ``"<Video k>: "``, the order its
  rows are packed in. Then the prompt.

Label rows are tagged text (1) and vision-block rows 0, the tags H3's AdaLN rows key off. Qwen reads a
reference video at 2 frames per second: every ``fps / 2``-th frame (rounded, no repeats); its processor
merges ``temporal_patch`` sampled frames into one block (repeating the last frame to fill a group), and a
block is labelled with the mean timestamp of its group, formatted by Python's ``{:.1f}`` (which rounds
half to even: a 2 fps pair at 0 s and 0.5 s reads ``"<0.2 seconds>"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import H3InputError

__all__ = [
    "PresentedReference",
    "VisionIds",
    "video_blocks",
    "presentation_tokens",
    "TEXT_TAG",
    "VISION_TAG",
    "VIDEO_SAMPLE_FPS",
]

TEXT_TAG, VISION_TAG = 1, 0
VIDEO_SAMPLE_FPS = 2.0
KINDS = ("image", "video", "audio")


@dataclass(frozen=True)
class PresentedReference:
    """One Ref2VA reference as Qwen sees it: ``kind`` "image" (``media`` ``[H, W, 3]``), "video" (``media``
    ``[F, H, W, 3]`` at ``fps``; ``has_audio`` when it carries a soundtrack) or "audio" (no media). Pixels
    are floats in [0, 1] or uint8; they should be the normalised reference the VAE encodes."""

    kind: str
    media: torch.Tensor | None = None
    has_audio: bool = False
    fps: float = 24.0

    def check(self, index: int) -> None:
        name = f"reference {index}"
        if self.kind not in KINDS:
            raise H3InputError(f"{name}: kind must be one of {list(KINDS)}, got {self.kind!r}")
        want = {"image": 3, "video": 4}.get(self.kind)
        if want is None:
            if self.media is not None:
                raise H3InputError(f"{name}: an audio reference shows Qwen no pixels; pass media=None")
            return
        if not isinstance(self.media, torch.Tensor) or self.media.dim() != want or self.media.shape[-1] != 3:
            shape = tuple(self.media.shape) if isinstance(self.media, torch.Tensor) else type(self.media).__name__
            layout = "[H, W, 3]" if self.kind == "image" else "[frames, H, W, 3]"
            raise H3InputError(f"{name}: {self.kind} pixels must be {layout}, got {shape}")
        if self.kind == "image" and self.has_audio:
            raise H3InputError(f"{name}: an image reference has no soundtrack")
        if self.kind == "video" and not self.fps > 0:
            raise H3InputError(f"{name}: fps must be positive, got {self.fps}")


@dataclass(frozen=True)
class VisionIds:
    """Token ids of the vision block markers in the tokenizer."""

    start: int
    end: int
    image_pad: int
    video_pad: int

    @classmethod
    def of(cls, tokenizer) -> "VisionIds":
        names = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
        ids = [tokenizer.convert_tokens_to_ids(name) for name in names]
        unk = getattr(tokenizer, "unk_token_id", None)
        missing = [name for name, i in zip(names, ids) if i is None or i == unk]
        if missing:
            raise H3InputError(f"the tokenizer has no {missing} tokens; it is not Qwen3-VL's")
        return cls(*ids)


def video_blocks(
    num_frames: int, fps: float, temporal_patch: int, sample_fps: float = VIDEO_SAMPLE_FPS
) -> tuple[list[int], list[float]]:
    """The frames Qwen reads from a ``num_frames`` video at ``fps`` and the timestamp of each vision block.

    Returns ``(frame indices, block timestamps)``; the processor merges the frames ``temporal_patch`` at a
    time, so there is one timestamp per group."""
    step = fps / sample_fps
    indices: list[int] = []
    k = 0
    while round(k * step) < num_frames:
        index = round(k * step)
        if not indices or index > indices[-1]:
            indices.append(index)
        k += 1
    if len(indices) < temporal_patch:
        shortest = round((temporal_patch - 1) * step) + 1
        raise H3InputError(
            f"a reference video must run at least {shortest} frames at {fps:g} fps so that Qwen "
            f"reads {temporal_patch} frames at {sample_fps:g} fps; got {num_frames}"
        )
    times = [i / sample_fps for i in range(len(indices))]
    times += [times[-1]] * (-len(times) % temporal_patch)
    blocks = [(times[g] + times[g + temporal_patch - 1]) / 2 for g in range(0, len(times), temporal_patch)]
    return indices, blocks


def presentation_tokens(
    tokenize,
    ids: VisionIds,
    prompt: str,
    items: list[tuple[str, bool]],
    image_tokens: list[int],
    video_tokens: list[int],
    video_times: list[list[float]],
) -> tuple[list[int], list[int]]:
    """Token ids and tags of the presentation (module docstring).

    ``tokenize(text) -> ids`` without special tokens; ``items``: ``(kind, has_audio)`` per keyframe or
    reference in packed order (keyframes are images); ``image_tokens``: vision tokens per image;
    ``video_tokens``: tokens per block of each video; ``video_times``: block timestamps of each video."""
    token_ids: list[int] = []
    tags: list[int] = []

    def text(value: str) -> None:
        pieces = tokenize(value)
        token_ids.extend(pieces)
        tags.extend([TEXT_TAG] * len(pieces))

    def block(pad: int, count: int) -> None:
        token_ids.extend([ids.start] + [pad] * count + [ids.end])
        tags.extend([VISION_TAG] * (count + 2))

    numbers = dict.fromkeys(KINDS, 0)
    for kind, has_audio in items:
        if has_audio or kind == "audio":
            numbers["audio"] += 1
            text(f"<Audio {numbers['audio']}>: ")
        if kind == "image":
            numbers["image"] += 1
            text(f"<Picture {numbers['image']}>: ")
            block(ids.image_pad, image_tokens[numbers["image"] - 1])
        elif kind == "video":
            numbers["video"] += 1
            text(f"<Video {numbers['video']}>: ")
            for stamp in video_times[numbers["video"] - 1]:
                text(f"<{stamp:.1f} seconds>")
                block(ids.video_pad, video_tokens[numbers["video"] - 1])
    text(prompt)
    return token_ids, tags
