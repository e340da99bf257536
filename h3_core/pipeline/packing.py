"""The packed sequence of one T2VA / I2VA / L2VA / FL2VA request: ``[text | keyframe rows | audio | video]``.

Every row gets a modality tag (0 video, 1 text, 2 audio; the vision rows inside the text span are tagged
video by the text encoder's tags), and a rotary ``(t, h, w)`` position in float64, as released:
  * text row i sits at ``(i, 0, 0)``; the media clock starts at ``origin = L`` (the text length);
  * video latent frame k at ``origin + Σ_{j<k} 5/3 · (1, 4, 4, 4, 4)[j mod 5]`` — 5/3 rotary units per pixel
    frame, so 40 units per second at 24 fps;
  * the spatial axes are area-normalised: an axis of ``n`` patches over ``dim`` latents spans
    ``[(1 − ρ)/2, (1 + ρ)/2) · 32`` with ``ρ = dim / √(h · w)`` (a square canvas spans [0, 32));
  * audio latent j of both channels at time ``origin + j`` (the same clock at 40 latents/s), no height,
    the left channel at the first width coordinate and the right one at the last;
  * a keyframe block takes the target frame grid, at the first latent's time ("first") or the last's
    ("last", summed pairwise as released); a keyframe placed at pixel frame ``i`` (``KeyframeSlot``, ComfyUI's
    native placement) starts at ``origin + 5/3 · i``, its latent frames on the video clock from there and its
    soundtrack's rows (after its video rows) on the audio clock from the same time.
Audio rows are channel-major (all left-channel latents, then all right). Video rows are t-major, then
rows of 2×2 latent patches (``patchify``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from einops import rearrange

from ..attention.layout import SequenceLayout, Span
from ..errors import H3InputError

__all__ = [
    "pad_to_patch",
    "padded_size",
    "repad_rows",
    "KeyframeSlot",
    "PackedSequence",
    "Reference",
    "pack_sequence",
    "pack_ref2va",
    "patchify",
    "unpatchify",
    "soundtrack_rows",
    "AUDIO_TAG",
    "VIDEO_TAG",
    "TEXT_TAG",
]

VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2
FRAME_RESCALE = 5.0 / 3.0  # rotary units per pixel frame
FRAMES_PER_LATENT = (1, 4, 4, 4, 4)  # pixel frames each latent of a 17-frame clip covers
SPATIAL_SCALE = 32


def patchify(latents: torch.Tensor, patch: tuple[int, int, int] = (1, 2, 2)) -> torch.Tensor:
    """Video latents ``[C, T, h, w]`` → rows ``[T/pt · h/ph · w/pw, C·pt·ph·pw]`` (t-major; feature index
    ``c·pt·ph·pw + ...``)."""
    pt, ph, pw = patch
    C, T, h, w = latents.shape
    if T % pt or h % ph or w % pw:
        raise H3InputError(f"latents of shape {tuple(latents.shape)} do not divide into {patch} patches")
    return rearrange(latents, "c (t pt) (h ph) (w pw) -> (t h w) (c pt ph pw)", pt=pt, ph=ph, pw=pw)


def pad_to_patch(
    latents: torch.Tensor, patch: tuple[int, int, int] = (1, 2, 2), mode: str = "circular"
) -> torch.Tensor:
    """``[C, T, h, w]`` padded at the end of each axis to whole patches, circularly (the first frames, rows and
    columns again), as ComfyUI's native H3 pads a latent of odd size before it patchifies it
    (comfy/ldm/common_dit.py ``pad_to_patch_size``, called by comfy/ldm/minimax/model.py ``_forward`` at
    Comfy-Org/ComfyUI 2c64d4aa); ``mode="replicate"`` repeats the last frame, row and column instead, as it pads
    a denoise mask (``mask_row_values``). Unchanged (the same tensor) when it divides."""
    pads = [(p - n % p) % p for p, n in zip(patch, latents.shape[1:])]
    if not any(pads):
        return latents
    pt, ph, pw = pads
    return torch.nn.functional.pad(latents[None], (0, pw, 0, ph, 0, pt), mode=mode)[0]


def padded_size(height: int, width: int, patch: tuple[int, int, int] = (1, 2, 2)) -> tuple[int, int]:
    """The latent grid ``pad_to_patch`` makes of ``height`` × ``width``."""
    _, ph, pw = patch
    return height + (-height) % ph, width + (-width) % pw


def repad_rows(rows: torch.Tensor, frames: int, height: int, width: int, patch=(1, 2, 2)) -> torch.Tensor:
    """Target rows on the padded grid with the padding made again from the ``height`` × ``width`` latent they
    hold (what the model sees of a state that lives on the unpadded grid); the rows themselves when nothing is
    padded."""
    hp, wp = padded_size(height, width, patch)
    if (hp, wp) == (height, width):
        return rows
    latents = unpatchify(rows, rows.shape[1] // (patch[0] * patch[1] * patch[2]), frames, hp, wp, patch)
    return patchify(pad_to_patch(latents[:, :, :height, :width], patch), patch)


def unpatchify(
    rows: torch.Tensor, channels: int, frames: int, height: int, width: int, patch: tuple[int, int, int] = (1, 2, 2)
) -> torch.Tensor:
    """The inverse of ``patchify``: rows → ``[C, T, h, w]``."""
    pt, ph, pw = patch
    return rearrange(
        rows,
        "(t h w) (c pt ph pw) -> c (t pt) (h ph) (w pw)",
        t=frames // pt,
        h=height // ph,
        w=width // pw,
        c=channels,
        pt=pt,
        ph=ph,
        pw=pw,
    )


def soundtrack_rows(audio: torch.Tensor) -> torch.Tensor:
    """Audio latents ``[2, 32, Ta]`` → rows ``[2 · Ta, 32]`` (channel-major: the left channel's latents first)."""
    return audio.float().transpose(1, 2).reshape(-1, audio.shape[1])


def _spatial_axis(dim: int, patch: int, sqrt_area: float) -> torch.Tensor:
    ratio = dim / sqrt_area
    left = (1.0 - ratio) / 2.0
    # numpy's endpoint-free linspace (start + i · step), which is the float64 grid the model was trained on
    return torch.from_numpy(np.linspace(left, left + ratio, dim // patch, endpoint=False) * SPATIAL_SCALE)


def _frame_grid(h: int, w: int, ph: int, pw: int) -> tuple[torch.Tensor, torch.Tensor]:
    root = float(np.sqrt(h * w))
    ys, xs = _spatial_axis(h, ph, root), _spatial_axis(w, pw, root)
    gy, gx = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack([gy.reshape(-1), gx.reshape(-1)], dim=-1), xs


def _frame_times(frames: int, origin: float) -> torch.Tensor:
    spans = torch.tensor([FRAME_RESCALE * FRAMES_PER_LATENT[i % 5] for i in range(frames)], dtype=torch.float64)
    return origin + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])


def _last_frame_time(frames: int, origin: float) -> float:
    spans = np.ones(frames, dtype=np.float64) * FRAME_RESCALE
    for offset in range(5):
        spans[offset::5] *= FRAMES_PER_LATENT[offset]
    return origin + float(spans.sum()) - FRAME_RESCALE


def _fill_audio(positions, start, latents, time, xs, channels):
    """Channel-major audio rows from ``start``: latent j of every channel at ``time + j``, no height, the
    first channel pinned to the first width coordinate ``xs[0]``, the others to the last."""
    rows = slice(start, start + latents * channels)
    positions[rows, 0] = (time + torch.arange(latents, dtype=torch.float64)).repeat(channels)
    positions[rows, 2] = torch.cat(
        [
            torch.full((latents,), float(xs[0]), dtype=torch.float64),
            torch.full((latents * (channels - 1),), float(xs[-1]), dtype=torch.float64),
        ]
    )
    return rows.stop


def _fill_video(positions, start, frames, grid, time):
    """t-major video rows from ``start``: every row of latent frame k at the frame's time, on ``grid``."""
    per_frame = grid.shape[0]
    rows = slice(start, start + frames * per_frame)
    positions[rows, 0] = _frame_times(frames, time).repeat_interleave(per_frame)
    positions[rows, 1:] = grid.repeat(frames, 1)
    return rows.stop


def _tags(T, text_tags, text_index, audio_index, video_index):
    tags = torch.empty(T, dtype=torch.long)
    tags[text_index] = text_tags.to(torch.long)
    tags[audio_index] = AUDIO_TAG
    tags[video_index] = VIDEO_TAG
    return tags


@dataclass(frozen=True)
class KeyframeSlot:
    """One keyframe block by its geometry: placed at pixel frame ``frame_index`` of the target clip, ``frames``
    latent frames of video rows (1 for an image, 0 for none) and ``audio_latents`` of soundtrack per channel."""

    frame_index: int
    frames: int = 1
    audio_latents: int = 0


def _keyframe_slot(keyframe) -> KeyframeSlot | str:
    if isinstance(keyframe, KeyframeSlot):
        if keyframe.frame_index < 0 or keyframe.frames < 0 or keyframe.audio_latents < 0:
            raise H3InputError(f"a keyframe slot counts from 0, got {keyframe}")
        if keyframe.frames == 0 and keyframe.audio_latents == 0:
            raise H3InputError(f"a keyframe needs video or audio rows, got {keyframe}")
        return keyframe
    if keyframe not in ("first", "last"):
        raise H3InputError(f"a keyframe anchor must be 'first' or 'last', got {keyframe!r}")
    return keyframe


@dataclass(frozen=True)
class PackedSequence:
    """Positions ``[T, 3]`` (float64), tags ``[T]``, the row indices of each kind, and the geometry."""

    positions: torch.Tensor
    tags: torch.Tensor
    video_index: torch.Tensor  # keyframe rows first, then the target video rows
    audio_index: torch.Tensor
    text_index: torch.Tensor
    condition_rows: int
    layout: SequenceLayout  # for the window softmax: globals = text, keyframes and audio
    condition_audio_rows: int = 0  # keyframe soundtrack rows, first in ``audio_index``

    def model_inputs(self, device) -> tuple[torch.Tensor, ...]:
        """What a DiT evaluation reads of the layout, in its argument order after the timesteps, on ``device``:
        tags, positions and the video, audio and text row indices."""
        return tuple(
            t.to(device) for t in (self.tags, self.positions, self.video_index, self.audio_index, self.text_index)
        )


def pack_sequence(
    text_tags: torch.Tensor,
    frames: int,
    height: int,
    width: int,
    audio_latents: int,
    *,
    keyframes: tuple[str | KeyframeSlot, ...] = (),
    patch: tuple[int, int, int] = (1, 2, 2),
    audio_channels: int = 2,
) -> PackedSequence:
    """Lay out one request (module docstring). ``frames``/``height``/``width`` are the target latent
    geometry; ``keyframes`` lists, in packed order, each keyframe block: "first" / "last" (one latent frame at
    the released anchors) or a ``KeyframeSlot`` (ComfyUI's native placement at a pixel frame, with its
    soundtrack)."""
    _, ph, pw = patch
    if height % ph or width % pw:
        raise H3InputError(f"latent size {height}x{width} must be a multiple of the patch {ph}x{pw}")
    slots = [_keyframe_slot(k) for k in keyframes]
    L = int(text_tags.shape[0])
    per_frame = (height // ph) * (width // pw)
    blocks = [(1, 0) if isinstance(s, str) else (s.frames, s.audio_latents) for s in slots]
    cond_rows = sum(f for f, _ in blocks) * per_frame
    cond_audio_rows = sum(a for _, a in blocks) * audio_channels
    cond0 = L
    audio0 = cond0 + cond_rows + cond_audio_rows
    video0 = audio0 + audio_latents * audio_channels
    T = video0 + frames * per_frame

    positions = torch.zeros(T, 3, dtype=torch.float64)
    positions[:L, 0] = torch.arange(L, dtype=torch.float64)
    grid, xs = _frame_grid(height, width, ph, pw)
    cond_video, cond_audio, cursor = [], [], cond0
    for slot in slots:
        if isinstance(slot, str):
            time = float(L) if slot == "first" else _last_frame_time(frames, float(L))
            stop = _fill_video(positions, cursor, 1, grid, time)
        else:
            time = float(L) + FRAME_RESCALE * slot.frame_index
            stop = _fill_video(positions, cursor, slot.frames, grid, time) if slot.frames else cursor
        cond_video.append(torch.arange(cursor, stop))
        cursor = stop
        if not isinstance(slot, str) and slot.audio_latents:
            stop = _fill_audio(positions, cursor, slot.audio_latents, time, xs, audio_channels)
            cond_audio.append(torch.arange(cursor, stop))
            cursor = stop
    _fill_audio(positions, audio0, audio_latents, float(L), xs, audio_channels)
    _fill_video(positions, video0, frames, grid, float(L))

    video_index = torch.cat([*cond_video, torch.arange(video0, T)])
    audio_index = torch.cat([*cond_audio, torch.arange(audio0, video0)])
    text_index = torch.arange(L)
    tags = _tags(T, text_tags, text_index, audio_index, video_index)
    layout = SequenceLayout(
        seq_len=T,
        video=Span("video", video0, T - video0),
        num_frames=frames,
        tokens_per_frame=per_frame,
        frame_h=height // ph,
        frame_w=width // pw,
        global_spans=(
            Span("text", 0, L),
            Span("conditioning", cond0, audio0 - cond0),
            Span("audio", audio0, video0 - audio0),
        ),
    )
    return PackedSequence(
        positions, tags, video_index, audio_index, text_index, cond_rows, layout, condition_audio_rows=cond_audio_rows
    )


@dataclass(frozen=True)
class Reference:
    """One Ref2VA reference block, by its latent geometry: ``kind`` "image" (one latent frame), "video"
    (``frames`` latents, with ``audio_latents`` of soundtrack per channel, 0 for none) or "audio"."""

    kind: str
    frames: int = 0
    height: int = 0
    width: int = 0
    audio_latents: int = 0


def pack_ref2va(
    text_tags: torch.Tensor,
    references: list[Reference],
    frames: int,
    height: int,
    width: int,
    audio_latents: int,
    *,
    patch: tuple[int, int, int] = (1, 2, 2),
    audio_channels: int = 2,
) -> PackedSequence:
    """Lay out a Ref2VA request ``[text | reference blocks | audio | video]``. One clock runs through the
    references in order, from the text length: an image takes one unit, an audio reference its latent
    count, a video reference (its soundtrack rows first, on its own width grid) the longer of its
    soundtrack and its frames' span; the target audio and video start where the references end."""
    _, ph, pw = patch
    L = int(text_tags.shape[0])
    per_frame = (height // ph) * (width // pw)
    ref_video_rows = ref_audio_rows = 0
    for ref in references:
        if ref.kind not in ("image", "video", "audio"):
            raise H3InputError(f"a reference must be 'image', 'video' or 'audio', got {ref.kind!r}")
        if ref.kind in ("image", "video"):
            ref_video_rows += max(ref.frames, 1 if ref.kind == "image" else 0) * (ref.height // ph) * (ref.width // pw)
        ref_audio_rows += ref.audio_latents * audio_channels
    T = L + ref_video_rows + ref_audio_rows + audio_latents * audio_channels + frames * per_frame

    positions = torch.zeros(T, 3, dtype=torch.float64)
    positions[:L, 0] = torch.arange(L, dtype=torch.float64)
    grid, xs = _frame_grid(height, width, ph, pw)
    video_index, audio_index = [], []
    cursor, time = L, float(L)
    for ref in references:
        if ref.kind == "image":
            ref_grid, _ = _frame_grid(ref.height, ref.width, ph, pw)
            rows = slice(cursor, cursor + ref_grid.shape[0])
            positions[rows, 0] = time
            positions[rows, 1:] = ref_grid
            video_index.append(torch.arange(rows.start, rows.stop))
            cursor, time = rows.stop, time + 1.0
        elif ref.kind == "audio":
            stop = _fill_audio(positions, cursor, ref.audio_latents, time, xs, audio_channels)
            audio_index.append(torch.arange(cursor, stop))
            cursor, time = stop, time + float(ref.audio_latents)
        else:
            ref_grid, ref_xs = _frame_grid(ref.height, ref.width, ph, pw)
            audio_stop = _fill_audio(positions, cursor, ref.audio_latents, time, ref_xs, audio_channels)
            video_stop = _fill_video(positions, audio_stop, ref.frames, ref_grid, time)
            audio_index.append(torch.arange(cursor, audio_stop))
            video_index.append(torch.arange(audio_stop, video_stop))
            # summed in order, as released (the keyframe "last" anchor sums the same series pairwise)
            span = sum(FRAME_RESCALE * FRAMES_PER_LATENT[i % 5] for i in range(ref.frames))
            cursor, time = video_stop, time + max(float(ref.audio_latents), span)
    audio0 = cursor
    video0 = _fill_audio(positions, audio0, audio_latents, time, xs, audio_channels)
    _fill_video(positions, video0, frames, grid, time)

    video_index = torch.cat(video_index + [torch.arange(video0, T)])
    audio_index = torch.cat(audio_index + [torch.arange(audio0, video0)])
    text_index = torch.arange(L)
    tags = _tags(T, text_tags, text_index, audio_index, video_index)
    layout = SequenceLayout(
        seq_len=T,
        video=Span("video", video0, T - video0),
        num_frames=frames,
        tokens_per_frame=per_frame,
        frame_h=height // ph,
        frame_w=width // pw,
        global_spans=(Span("text", 0, L), Span("references", L, audio0 - L), Span("audio", audio0, video0 - audio0)),
    )
    return PackedSequence(positions, tags, video_index, audio_index, text_index, ref_video_rows, layout)
