"""Tiled decoding of H3 video latents, as the decoder was trained: 7-latent temporal windows cross-faded
over 5 frames, 256 px spatial tiles with tile-local positions, composed by a normalised overlap-add.

Temporal windows follow the released decoder exactly (the encoder saw 17-frame clips that each became 5
latents, with the last 3 latents of every clip dropped): window i decodes latents [5i, 5i + 7) into 28
frames; frames 0–2 are the causal pre-padding and frames 20–22 the pre-padding of the *next* clip, both
dropped; frames 3–19 are output, and frames 23–27 are the next window's first 5 frames, cross-faded with
them linearly (the previous window's weight falls 1, 0.8, …, 0.2). 5k + 2 latents give 17k + 5 frames; other
lengths are padded by repeating the last latent and the extra frames cut. A single latent frame is decoded
padded to two latents and its first frame returned.

Spatial tiles follow the released plan (``split_tiles``), but overlaps are composed by a normalised
overlap-add over EVERY tile covering a pixel, each tile weighted by the separable product of its ramps, so
corners where four tiles meet are blended correctly. The overlap-add is kept as a running weighted mean
in fp32, in a band one tile high, and rows are written out as soon as no later tile can reach them, so
device memory does not grow with the clip.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import H3InputError, is_out_of_memory
from ..parallel.spread import spread_in_order
from ..triton_forms import check_compile, compiles_on, plain_path
from .host_frames import empty_frames
from .host_sink import HostSink

__all__ = [
    "TRAINED_TILE_PX",
    "TRAINED_OVERLAP_PX",
    "UNTRAINED_TILES_NOTE",
    "TileGrid",
    "TemporalPlan",
    "VAEGeometry",
    "Tiling",
    "DecodeHooks",
    "split_tiles",
    "ramp_weights",
    "temporal_plan",
    "decode_tiled",
]

log = logging.getLogger(__name__)

TRAINED_TILE_PX = 256
TRAINED_OVERLAP_PX = 64
# What a user is told (tooltip and log) about choosing other tile sizes.
UNTRAINED_TILES_NOTE = (
    "The decoder was trained on 256 px tiles with 64 px overlap; other sizes leave the trained regime "
    "(seams and a 16 px lattice can appear)."
)


@dataclass(frozen=True)
class TileGrid:
    """Tiles along one axis, in pixels: tile i covers ``[starts[i], starts[i] + sizes[i])``;
    ``overlaps[i]`` is shared by tiles i and i + 1."""

    length: int
    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    overlaps: tuple[int, ...]


def split_tiles(
    length: int, tile: int = TRAINED_TILE_PX, min_overlap: int = TRAINED_OVERLAP_PX, unit: int = 16
) -> TileGrid:
    """Lay ``tile``-wide tiles over ``length`` pixels as the released VAE does: the fewest tiles whose
    overlaps are all at least ``min_overlap``, the slack spread round-robin over the overlaps in whole
    ``unit`` steps (one latent), first overlaps first. A length within one tile is one tile."""
    _check_tile(tile, min_overlap)
    if tile >= length:
        return TileGrid(length, (0,), (length,), ())
    count = math.ceil(length / tile)
    while tile * count - min_overlap * (count - 1) < length:
        count += 1
    overlaps = [min_overlap] * (count - 1)
    for i in range((tile * count - sum(overlaps) - length) // unit):
        overlaps[i % (count - 1)] += unit
    starts = [0]
    for overlap in overlaps:
        starts.append(starts[-1] + tile - overlap)
    return TileGrid(length, tuple(starts), (tile,) * count, tuple(overlaps))


def _check_tile(tile: int, overlap: int) -> None:
    if tile <= 0 or overlap < 0 or overlap >= tile:
        raise H3InputError(f"tile size {tile} and overlap {overlap} must satisfy 0 <= overlap < tile")


def ramp_weights(grid: TileGrid) -> list[torch.Tensor]:
    """Per tile, its fp32 weight along the axis: rising p/n over the overlap with the previous tile and
    falling 1 - p/n over the overlap with the next one (p = 0..n-1), 1 elsewhere — the released linear
    blend, as weights of an overlap-add."""
    weights = []
    for i, size in enumerate(grid.sizes):
        w = torch.ones(size, dtype=torch.float32)
        if i > 0:
            n = min(grid.overlaps[i - 1], size)
            w[:n] *= torch.arange(n, dtype=torch.float32) / n
        if i + 1 < len(grid.sizes):
            n = min(grid.overlaps[i], size)
            w[size - n :] *= 1 - torch.arange(n, dtype=torch.float32) / n
        weights.append(w)
    return weights


@dataclass(frozen=True)
class TemporalPlan:
    """How a latent video is cut into decoder windows and joined back.

    ``windows`` are latent ranges ``(start, stop)`` of the padded latents (``pad`` repeats of the last
    latent appended). From each window's decoded frames, ``keep`` is output and ``tail`` is cross-faded
    into the next window's first ``fade`` kept frames (the last window's tail is output as is); the first
    ``cut`` frames of the joined video are all that is returned."""

    num_latents: int
    pad: int
    windows: tuple[tuple[int, int], ...]
    keep: tuple[int, int]
    tail: tuple[int, int] | None
    fade: int
    num_frames: int

    def output_start(self, window: int) -> int:
        """The output frame where window ``window``'s kept frames begin."""
        return window * (self.keep[1] - self.keep[0])


def temporal_plan(
    num_latents: int, clip_length: int = 17, temporal_ratio: int = 4, token_drop: int = 3
) -> TemporalPlan:
    """The released decoder's temporal windows for ``num_latents`` latent frames (module docstring)."""
    if num_latents < 1:
        raise H3InputError(f"latent video needs at least 1 frame, got {num_latents}")
    chunk = math.ceil(clip_length / temporal_ratio)  # latents per encoded clip (5)
    pre_pad = (-clip_length) % temporal_ratio  # leading frames the causal encoder padded (3)
    overlap = (-token_drop) % chunk  # latents two windows share (2)
    fade = max(overlap * temporal_ratio - pre_pad, 0)  # frames cross-faded (5)
    if num_latents == 1:
        # One latent frame decodes badly alone; two copies decode cleanly and the first frame is the image.
        return TemporalPlan(1, 1, ((0, 2),), (pre_pad, pre_pad + 1), None, 0, 1)
    tokens = num_latents + token_drop
    pad = (-tokens) % chunk
    windows = (tokens + pad) // chunk - int(token_drop > 0)
    clip_frames = chunk * temporal_ratio
    if windows == 0:
        # Fewer latents than one window (5k + 2 with k = 0): one window whose frames after the pre-padding
        # are all output.
        frames = (num_latents + pad) * temporal_ratio - pre_pad
        return TemporalPlan(
            num_latents,
            pad,
            ((0, num_latents + pad),),
            (pre_pad, pre_pad + frames),
            None,
            0,
            _cut(num_latents, pad, frames, clip_length, temporal_ratio, chunk),
        )
    span = chunk + overlap
    tail = (clip_frames + pre_pad, span * temporal_ratio) if token_drop > 0 else None
    total = windows * (clip_frames - pre_pad) + ((tail[1] - tail[0]) if tail else 0)
    return TemporalPlan(
        num_latents,
        pad,
        tuple((i * chunk, i * chunk + span) for i in range(windows)),
        (pre_pad, clip_frames),
        tail,
        fade if windows > 1 or tail else 0,
        _cut(num_latents, pad, total, clip_length, temporal_ratio, chunk),
    )


def _cut(num_latents, pad, total, clip_length, temporal_ratio, chunk):
    """Frames left after dropping those the padding latents produced: a clip's last latent covers only
    ``clip_length % temporal_ratio`` frames, the others ``temporal_ratio``."""
    tail_frames = clip_length % temporal_ratio
    extra = sum(tail_frames if tail_frames and (num_latents + k) % chunk == 0 else temporal_ratio for k in range(pad))
    return total - extra


class DecodeOutOfMemory(RuntimeError):
    """Decoding ran out of device memory even at the lowest-memory setting."""


@dataclass(frozen=True)
class VAEGeometry:
    """The VAE's geometry (module docstring): pixels per latent across, frames per latent, frames per encoded clip
    and latents dropped from each clip. Default: H3's."""

    spatial_ratio: int = 16
    temporal_ratio: int = 4
    clip_length: int = 17
    token_drop: int = 3

    @classmethod
    def of(cls, cfg) -> VAEGeometry:
        """The geometry of a VAE's config (a ``VideoVAEConfig``, or anything with these attributes)."""
        return cls(cfg.spatial_ratio, cfg.temporal_ratio, cfg.clip_length, cfg.token_drop)


@dataclass(frozen=True)
class Tiling:
    """The spatial tiles: ``tile_px`` wide with at least ``overlap_px`` shared, ``tiles_per_batch`` per ``decode`` call
    (a tile row at most). Default: the trained 256 / 64; other sizes leave the regime the decoder was trained in
    (seams and a 16 px lattice appear)."""

    tile_px: int = TRAINED_TILE_PX
    overlap_px: int = TRAINED_OVERLAP_PX
    tiles_per_batch: int = 4

    def __post_init__(self):
        _check_tile(self.tile_px, self.overlap_px)
        if self.tiles_per_batch < 1:
            raise H3InputError(f"tiles_per_batch must be >= 1, got {self.tiles_per_batch}")

    @property
    def trained(self) -> bool:
        """Whether these are the tile and overlap the decoder was trained on."""
        return (self.tile_px, self.overlap_px) == (TRAINED_TILE_PX, TRAINED_OVERLAP_PX)


@dataclass(frozen=True)
class DecodeHooks:
    """The caller's side of a decode: what it is told and asked while the decode runs, and where the frames go.

    ``progress``: called with (tiles done, tiles total) after every tile.
    ``check_cancel``: called before every batch of tiles (every tile, with one tile per batch); it raises to stop,
    and nothing more is decoded. With a ``group``: before every window, on every rank.
    ``offload``: called once if a single tile still runs out of memory, to move weights off the device; returns what
    it did. Without it, or if it fails to help, ``DecodeOutOfMemory`` is raised.
    ``report``: receives a sentence whenever the decode changes its settings to fit.
    ``on_frames``: called after each window with ``(start, frames)``: ``frames`` is ``out[start:stop]``, final (copied
    off the device) and never written again; the calls cover every frame once, in order.
    ``uint8_frames``: ``on_frames`` receives those frames as the mp4's 8-bit values (``mp4.pixels_uint8``, computed on
    the decoder's device before the copy out, a quarter of the bytes) instead.
    ``out``: where to store the video, ``[F, H, W, 3]``. Default: a new fp32 CPU tensor (``host_frames``: on huge
    pages where the kernel offers them)."""

    progress: Callable[[int, int], None] | None = None
    check_cancel: Callable[[], None] | None = None
    offload: Callable[[], str] | None = None
    report: Callable[[str], None] | None = None
    on_frames: Callable[[int, torch.Tensor], None] | None = None
    uint8_frames: bool = False
    out: torch.Tensor | None = None


def decode_tiled(
    decode: Callable[[torch.Tensor], torch.Tensor],
    latents: torch.Tensor,
    *,
    geometry: VAEGeometry = VAEGeometry(),
    tiling: Tiling = Tiling(),
    hooks: DecodeHooks = DecodeHooks(),
    finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
    group=None,
) -> torch.Tensor | None:
    """Decode ``latents`` ``[C, T, h, w]`` window by window and tile by tile.

    Args:
        decode: latent tiles ``[N, C, t, th, tw]`` → pixels ``[N, 3, t·temporal_ratio, th·r, tw·r]``, the
            decoder's own output space (composition is linear, so it happens there).
        latents: one latent video on the decoder's device.
        geometry: the VAE's (``VAEGeometry``).
        tiling: the spatial tiles and tiles per batch (``Tiling``).
        hooks: progress, cancel, offload, reports and where the frames go (``DecodeHooks``).
        finish: applied to finished pixels ``[3, f, rows, W]`` (fp32) before they are stored, e.g. the
            de-normalisation and clamp. Default: none.
        group: a ``torch.distributed`` group whose ranks share each window's tile batches (every rank calls this
            with the same latents; each decodes every P-th batch whole, ``parallel.spread_in_order``); rank 0 blends
            and writes the frames exactly as one rank would, the others return None. Default: this process alone.
    Returns:
        The frames ``[F, H, W, 3]`` (in ``hooks.out`` where given), F from ``temporal_plan``; None on a rank other
        than 0 of ``group``.
    """
    if latents.dim() != 4:
        raise H3InputError(f"latents must be [C, T, h, w], got shape {tuple(latents.shape)}")
    C, T, h, w = latents.shape
    spatial_ratio, temporal_ratio = geometry.spatial_ratio, geometry.temporal_ratio
    plan = temporal_plan(T, geometry.clip_length, temporal_ratio, geometry.token_drop)
    H, W = h * spatial_ratio, w * spatial_ratio
    grid_y = split_tiles(H, tiling.tile_px, tiling.overlap_px, spatial_ratio)
    grid_x = split_tiles(W, tiling.tile_px, tiling.overlap_px, spatial_ratio)
    wy, wx = ramp_weights(grid_y), ramp_weights(grid_x)
    receiving = group is None or dist.get_rank(group) == 0  # the rank that blends and writes the frames
    out, on_frames, check_cancel, progress = hooks.out, hooks.on_frames, hooks.check_cancel, hooks.progress
    if out is None and receiving:
        out = empty_frames((plan.num_frames, H, W, 3), torch.float32)
    elif out is not None and tuple(out.shape) != (plan.num_frames, H, W, 3):
        raise H3InputError(f"out must have shape {(plan.num_frames, H, W, 3)}, got {tuple(out.shape)}")
    if plan.pad:
        latents = torch.cat([latents, latents[:, -1:].expand(C, plan.pad, h, w)], dim=1)
    state = _DecodeState(decode, tiling.tiles_per_batch, hooks.offload, hooks.report)
    if not tiling.trained:
        state.say(f"decoding with {tiling.tile_px} px tiles and {tiling.overlap_px} px overlap. {UNTRAINED_TILES_NOTE}")
    device = latents.device
    sink = None
    if receiving:
        pixels = None
        if on_frames is not None and hooks.uint8_frames:
            if out.device.type == "cpu" and out.is_pinned():
                pixels = torch.empty(out.shape, dtype=torch.uint8, pin_memory=True)
            else:
                pixels = empty_frames(tuple(out.shape), torch.uint8)
        sink = HostSink(out, device, pixels)
    weights = [
        [wy_t.to(device)[:, None] * wx_t.to(device)[None, :] for wx_t in wx] for wy_t in wy
    ]  # separable tile weights [th, tw]
    band_rows = max(grid_y.sizes)
    tiles_total = len(plan.windows) * len(grid_y.starts) * len(grid_x.starts)
    done = 0
    held_tail = None  # the previous window's tail, raw, [3, f, H, W] on the decoder's device
    announced = 0  # frames handed to on_frames
    try:
        for index, (z0, z1) in enumerate(plan.windows):
            window = latents[:, z0:z1]
            tile_rows = [
                [
                    window[
                        :,
                        :,
                        y0 // spatial_ratio : (y0 + th) // spatial_ratio,
                        x0 // spatial_ratio : (x0 + tw) // spatial_ratio,
                    ]
                    for x0, tw in zip(grid_x.starts, grid_x.sizes)
                ]
                for y0, th in zip(grid_y.starts, grid_y.sizes)
            ]
            decoded = None  # with ranks: this window's batches, decoded among them, by (tile row, first tile)
            if group is not None:
                decoded = _spread_window(tile_rows, state, check_cancel, device, group)
                if decoded is None:
                    continue  # not rank 0: its share is decoded and sent
            # The running weighted mean of rows [band_top, band_top + band_rows) and the weight it holds;
            # every tile row starts at band_top.
            band = torch.zeros(3, (z1 - z0) * temporal_ratio, band_rows, W, dtype=torch.float32, device=device)
            held = torch.zeros(band_rows, W, dtype=torch.float32, device=device)
            band_top = 0
            last = index == len(plan.windows) - 1
            new_tail = (
                None if plan.tail is None or last else torch.empty(3, plan.tail[1] - plan.tail[0], H, W, device=device)
            )
            for ty, (tiles, th) in enumerate(zip(tile_rows, grid_y.sizes)):
                tx = 0
                while tx < len(tiles):
                    if decoded is not None:
                        batch = decoded[(ty, tx)]
                    else:
                        if check_cancel is not None:
                            check_cancel()
                        batch = state.run(torch.stack(tiles[tx : tx + state.tiles_per_batch]))
                    for k, pixels in enumerate(batch):
                        x0, tw = grid_x.starts[tx + k], grid_x.sizes[tx + k]
                        _blend_into(band[:, :, :th, x0 : x0 + tw], held[:th, x0 : x0 + tw], pixels, weights[ty][tx + k])
                        done += 1
                        if progress is not None:
                            progress(done, tiles_total)
                    tx += batch.shape[0]
                # Rows above the next tile row's start can no longer change.
                final = (grid_y.starts[ty + 1] if ty + 1 < len(grid_y.starts) else H) - band_top
                _emit_rows(band[:, :, :final], band_top, plan, index, held_tail, new_tail, finish, sink)
                band = torch.cat([band[:, :, final:], torch.zeros_like(band[:, :, :final])], dim=2)
                held = torch.cat([held[final:], torch.zeros_like(held[:final])])
                band_top += final
            held_tail = new_tail
            # Frames before the next window's first kept frame are final: that one is cross-faded with this tail.
            ready = plan.num_frames if last else min(plan.num_frames, plan.output_start(index + 1))
            if on_frames is not None and ready > announced:
                # handed on once copied off the device (seen at a later row's copy): the device never waits for it
                frames = (sink.out if sink.pixels is None else sink.pixels)[announced:ready]
                sink.when_written(functools.partial(on_frames, announced, frames))
                announced = ready
    except BaseException:
        if sink is not None:
            sink.stop()  # its copier thread ends; the frames written so far are not handed on
        raise
    if sink is None:
        return None
    return sink.close()


def _spread_window(tile_rows, state, check_cancel, device, group) -> dict | None:
    """One window's tile batches (tiles per batch as one rank would make them) decoded among the ranks of
    ``group``: on rank 0 every batch by ``(tile row, first tile)``, None elsewhere. ``check_cancel`` is called once,
    first, on every rank alike (the ranks decode different numbers of batches: a cancel check they share, e.g.
    ``parallel.shared_cancel``, meets only at the window's start)."""
    if check_cancel is not None:
        check_cancel()
    count = state.tiles_per_batch
    batches = [(ty, tx) for ty, tiles in enumerate(tile_rows) for tx in range(0, len(tiles), count)]

    def work(batch):
        ty, tx = batch
        return state.run(torch.stack(tile_rows[ty][tx : tx + count]))

    results = spread_in_order(batches, work, device, group)
    return None if results is None else dict(zip(batches, results))


def _blend_into(mean, held, tile, weight):
    """Fold one tile into a running weighted mean: ``mean += w / (held + w) · (tile − mean)``.

    The result is the normalised overlap-add of every tile added so far, and a value every tile agrees
    on is kept exactly (the update is then zero), so constant tiles give an exactly constant canvas."""
    total = held + weight
    share = torch.where(total > 0, weight / total.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    mean += share * (tile.float() - mean)
    held.copy_(total)


def _emit_rows(pixels, top, plan, index, held_tail, new_tail, finish, sink):
    """Store finished rows ``[top, top + rows)`` of one window: its kept frames (cross-fading the first
    ones with the previous window's tail) and its tail (held raw for the next window)."""
    stop = top + pixels.shape[2]  # pixels: [3, frames, rows, W], on the decoder's device
    kept = pixels[:, plan.keep[0] : plan.keep[1]].clone()
    if index > 0 and plan.fade:
        fade = torch.arange(plan.fade, dtype=torch.float32, device=pixels.device) / plan.fade  # the new window's weight
        previous = held_tail[:, :, top:stop]
        kept[:, : plan.fade] = (
            previous * (1 - fade)[None, :, None, None] + kept[:, : plan.fade] * fade[None, :, None, None]
        )
    _store(kept, plan.output_start(index), top, stop, finish, sink)
    if plan.tail is not None:
        tail = pixels[:, plan.tail[0] : plan.tail[1]]
        if new_tail is not None:
            new_tail[:, :, top:stop] = tail
        else:
            _store(tail, plan.output_start(index + 1), top, stop, finish, sink)


def _store(pixels, frame0, top, stop, finish, sink):
    """Write ``pixels`` ``[3, f, rows, W]`` to ``out[frame0:, top:stop]``, dropping frames past the end;
    ``finish`` and the move to channels-last happen on the decoder's device, before the copy out."""
    count = max(0, min(pixels.shape[1], sink.out.shape[0] - frame0))
    if count == 0:
        return
    pixels = pixels[:, :count]
    if finish is not None:
        pixels = finish(pixels)
    sink.put(frame0, top, stop, pixels.permute(1, 2, 3, 0).to(sink.out.dtype).contiguous())


class _DecodeState:
    """Runs tile batches, stepping down to fewer tiles per batch and then to offloaded weights on OOM."""

    def __init__(self, decode, tiles_per_batch, offload, report):
        self.decode, self.tiles_per_batch, self.offload, self.report = decode, tiles_per_batch, offload, report
        self.offloaded = False

    def say(self, message):
        log.warning(message)
        if self.report is not None:
            self.report(message)

    def run(self, tiles: torch.Tensor) -> torch.Tensor:
        while True:
            try:
                return torch.cat([self.decode(part) for part in tiles.split(self.tiles_per_batch)])
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                if tiles.is_cuda:
                    torch.cuda.empty_cache()
                if self.tiles_per_batch > 1:
                    self.tiles_per_batch = max(1, self.tiles_per_batch // 2)
                    self.say(f"video decode ran out of memory; retrying with {self.tiles_per_batch} tile(s) per batch")
                elif self.offload is not None and not self.offloaded:
                    self.offloaded = True
                    self.say(f"video decode ran out of memory with 1 tile per batch; {self.offload()}")
                else:
                    raise DecodeOutOfMemory(
                        "video decode ran out of memory with 1 tile per batch"
                        + (" and the weights offloaded" if self.offloaded else "")
                        + "; free memory (unload other models) or decode on a larger card"
                    ) from None


def decode_video(
    vae,
    latents: torch.Tensor,
    *,
    normalized: bool = True,
    overrides=None,
    compile: str = "auto",
    tiling: Tiling = Tiling(),
    hooks: DecodeHooks = DecodeHooks(),
    group=None,
) -> torch.Tensor:
    """Latents of one video ``[24, T, h, w]`` → RGB frames ``[F, H, W, 3]`` in [0, 1] on the CPU.

    ``vae`` is a ``h3_core.models.video_vae.VideoVAE``; ``normalized`` latents are in model space (the
    sampler's output). ``overrides`` picks the decoder's attention backend (``h3_core.attention.vae``);
    ``compile`` (``"auto"`` / ``"off"``) whether the decoder blocks run compiled where CUDA and Triton are
    present (``compiled_decoder_blocks``; see ``_decoder``); ``tiling``, ``hooks`` and ``group`` as ``decode_tiled``
    takes them. If a single tile runs out of memory, the decoder's blocks are streamed from host memory (unless
    ``hooks.offload`` is given)."""
    from ..models.video_vae import IMAGENET_MEAN, IMAGENET_STD

    check_compile(compile)
    z = vae.denormalize_latents(latents) if normalized else latents
    mean = torch.tensor(IMAGENET_MEAN, device=z.device).view(3, 1, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=z.device).view(3, 1, 1, 1)
    if hooks.offload is None:
        hooks = dataclasses.replace(hooks, offload=vae.offload_decoder_blocks)
    with torch.inference_mode():
        return decode_tiled(
            _decoder(vae, overrides, compile == "auto" and compiles_on(z.device)),
            z,
            geometry=VAEGeometry.of(vae.cfg),
            tiling=tiling,
            hooks=hooks,
            finish=lambda pixels: (pixels * std + mean).clamp(0, 1),
            group=group,
        )


def _decoder(vae, overrides, compiled: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """``decode_tiled``'s ``decode``: ``vae.decode_tiles`` with the blocks compiled when ``compiled`` and they
    have not failed before, else eager with no Triton kernel (``triton_forms.plain_path``). A batch whose
    compiled blocks fail to compile or launch is decoded again eagerly (the decode writes nothing in place
    outside itself), one line naming the cause is logged, and every later batch and decode of ``vae`` runs
    eagerly (``vae.compiled_form``)."""

    def decode(tiles):
        if vae.compiled_form.tries(compiled):
            with vae.compiled_form.attempt():
                return vae.decode_tiles(tiles, overrides, compiled=True)
        with plain_path():
            return vae.decode_tiles(tiles, overrides)

    return decode


def _blend_edge(previous: torch.Tensor, tile: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``tile`` with its first ``width`` entries along ``dim`` faded in over ``previous``'s last ones
    (weight of ``tile`` p / width, p = 0..width-1), as the released stitch does."""
    width = min(previous.shape[dim], tile.shape[dim], width)
    if width == 0:
        return tile
    ramp = torch.arange(width, dtype=tile.dtype, device=tile.device) / width
    shape = [1] * tile.dim()
    shape[dim] = width
    ramp = ramp.view(shape)
    head = previous.narrow(dim, previous.shape[dim] - width, width) * (1 - ramp) + tile.narrow(dim, 0, width) * ramp
    return torch.cat([head, tile.narrow(dim, width, tile.shape[dim] - width)], dim=dim)


def _stitch_released(tiles: list[list[torch.Tensor]], overlaps_y, overlaps_x) -> torch.Tensor:
    """The released encoder's stitch of latent tiles: each tile faded over its raw upper and left
    neighbours, trailing overlaps cropped. Encoded conditioning must match what the model was trained on,
    so this keeps the released behaviour (the decoder side uses the full overlap-add instead)."""
    rows = []
    for i, row in enumerate(tiles):
        out_row = []
        for j, tile in enumerate(row):
            if i > 0:
                tile = _blend_edge(tiles[i - 1][j], tile, overlaps_y[i - 1], dim=-2)
            if j > 0:
                tile = _blend_edge(row[j - 1], tile, overlaps_x[j - 1], dim=-1)
            if i + 1 < len(tiles):
                tile = tile[..., : tile.shape[-2] - overlaps_y[i], :]
            if j + 1 < len(row):
                tile = tile[..., : tile.shape[-1] - overlaps_x[j]]
            out_row.append(tile)
        rows.append(torch.cat(out_row, dim=-1))
    return torch.cat(rows, dim=-2)


def encode_tiled(
    encode: Callable[[torch.Tensor], torch.Tensor],
    pixels: torch.Tensor,
    *,
    spatial_ratio: int = 16,
    temporal_ratio: int = 4,
    clip_length: int = 17,
    token_drop: int = 3,
    check_cancel: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Encode ``pixels`` ``[3, F, H, W]`` (the encoder's input space) to moments ``[2C, T, h, w]`` as
    released: clips of ``clip_length`` frames (the last padded by repeating its last frame), each in
    trained 256 px tiles stitched by the released blend, and the last ``token_drop`` latents dropped;
    a single frame is one image, encoded spatially only. ``encode`` maps ``[1, 3, f, th, tw]`` to
    ``[1, 2C, t, th/16, tw/16]``."""
    if pixels.dim() != 4 or pixels.shape[0] != 3:
        raise H3InputError(f"pixels must be [3, F, H, W], got shape {tuple(pixels.shape)}")
    _, F, H, W = pixels.shape
    if H % spatial_ratio or W % spatial_ratio:
        raise H3InputError(f"frame size {W}x{H} must be a multiple of {spatial_ratio} px on both sides")
    grid_y, grid_x = split_tiles(H), split_tiles(W)

    def encode_clip(clip):
        tiles = []
        for y0, th in zip(grid_y.starts, grid_y.sizes):
            row = []
            for x0, tw in zip(grid_x.starts, grid_x.sizes):
                if check_cancel is not None:
                    check_cancel()
                row.append(encode(clip[None, :, :, y0 : y0 + th, x0 : x0 + tw])[0])
            tiles.append(row)
        return _stitch_released(
            tiles, [o // spatial_ratio for o in grid_y.overlaps], [o // spatial_ratio for o in grid_x.overlaps]
        )

    if F == 1:
        return encode_clip(pixels)
    pad = -F % clip_length
    if pad:
        pixels = torch.cat([pixels, pixels[:, -1:].expand(3, pad, H, W)], dim=1)
    moments = torch.cat([encode_clip(pixels[:, i : i + clip_length]) for i in range(0, F + pad, clip_length)], dim=1)
    return moments[:, : moments.shape[1] - token_drop] if token_drop else moments


# The released conditioning encode: posterior sampled with this seed, rounded to fp16, then normalised.
CONDITION_SEED = 42


def encode_video(
    vae, frames: torch.Tensor, *, sample: bool = True, seed: int = CONDITION_SEED, **options
) -> torch.Tensor:
    """RGB frames ``[F, H, W, 3]`` in [0, 1] → latents in model space ``[24, T, h, w]`` (fp32).

    As H3 encodes keyframes and references: the posterior is sampled with ``seed`` (the mean with
    ``sample=False``) and rounded to fp16 before normalisation. 17k + 5 frames give 5k + 2 latents, one
    frame one latent."""
    from ..models.video_vae import IMAGENET_MEAN, IMAGENET_STD

    device = next(vae.parameters()).device
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(3, 1, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=device).view(3, 1, 1, 1)
    pixels = (frames.to(device=device, dtype=torch.float32).permute(3, 0, 1, 2) - mean) / std
    cfg = vae.cfg
    with torch.inference_mode():
        moments = encode_tiled(
            vae.encode_moments,
            pixels,
            spatial_ratio=cfg.spatial_ratio,
            temporal_ratio=cfg.temporal_ratio,
            clip_length=cfg.clip_length,
            token_drop=cfg.token_drop,
            **options,
        )
        z_mean, logvar = moments.chunk(2, dim=0)
        if sample:
            noise = torch.randn(z_mean.shape, generator=torch.Generator(device="cpu").manual_seed(seed))
            z = z_mean + torch.exp(0.5 * logvar) * noise.to(device)
        else:
            z = z_mean
        return vae.normalize_latents(z.half().float())
