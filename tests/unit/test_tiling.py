"""Tiled video decode (h3_core.media.tiling) against the released geometry, as diffusers 0.42.1's
AutoencoderKLMiniMaxH3 implements it, and against a direct normalised overlap-add."""

import os

import pytest
import torch

from h3_core.errors import H3InputError
from h3_core.media.tiling import (
    DecodeHooks,
    DecodeOutOfMemory,
    Tiling,
    decode_tiled,
    ramp_weights,
    split_tiles,
    temporal_plan,
)

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def vae():
    """A tiny random AutoencoderKLMiniMaxH3: the released geometry (16× spatial, 4× temporal, 24
    latent channels, 17-frame clips) with a one-block decoder."""
    torch.manual_seed(0)
    model = diffusers.AutoencoderKLMiniMaxH3(
        block_out_channels=(8,) * 6,
        norm_num_groups=4,
        decoder_num_layers=1,
        decoder_num_attention_heads=2,
        decoder_attention_head_dim=8,
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def decoder_of(vae):
    def decode(z):
        with torch.no_grad():
            return vae.decoder(vae.post_quant_conv(z))

    return decode


def reference_decode(vae, z):
    with torch.no_grad():
        return vae._decode(z[None])[0].permute(1, 2, 3, 0)  # [F, H, W, 3]


def latents(T, h, w, seed=0):
    return torch.randn(24, T, h, w, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tile, overlap", [(256, 64), (320, 64), (128, 32)])
def test_split_tiles_matches_the_released_plan(vae, tile, overlap):
    for length in list(range(16, 2400, 16)) + [300, 777, 1000]:
        grid = split_tiles(length, tile, overlap)
        starts, sizes, overlaps = vae._split_tiles(length, tile, overlap)
        assert (list(grid.starts), list(grid.sizes), list(grid.overlaps)) == (starts, sizes, overlaps), length
        assert grid.starts[-1] + grid.sizes[-1] >= length


def test_split_tiles_at_the_release_canvas():
    assert split_tiles(1344).starts == (0, 176, 352, 528, 704, 896, 1088)
    assert split_tiles(768).overlaps == (96, 80, 80)
    assert split_tiles(200).sizes == (200,)


def test_split_tiles_refuses_an_overlap_as_large_as_the_tile():
    with pytest.raises(H3InputError, match="tile size 64 and overlap 64"):
        split_tiles(500, 64, 64)


def test_ramps_sum_to_one_across_two_tiles():
    grid = split_tiles(448)
    w = ramp_weights(grid)
    total = torch.zeros(448)
    for start, weight in zip(grid.starts, w):
        total[start : start + 256] += weight
    assert torch.equal(total, torch.ones(448))


@pytest.mark.parametrize("T", range(1, 31))
def test_temporal_plan_frame_counts(vae, T):
    plan = temporal_plan(T)
    if T == 1:
        assert plan.num_frames == 1 and plan.windows == ((0, 2),)
    elif T == 2:
        assert plan.num_frames == 5
    else:
        assert plan.num_frames == reference_decode(vae, latents(T, 1, 1)).shape[0]
    if T % 5 == 2:
        assert plan.num_frames == 17 * (T // 5) + 5


@pytest.mark.parametrize("T, h, w", [(7, 2, 40), (12, 3, 3), (3, 2, 20), (17, 20, 2), (8, 1, 23)], ids=lambda v: str(v))
def test_one_row_or_column_of_tiles_equals_the_released_decode(vae, T, h, w):
    z = latents(T, h, w, seed=T)
    ours = decode_tiled(decoder_of(vae), z, tiling=Tiling(tiles_per_batch=3))
    ref = reference_decode(vae, z)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max() <= 1e-5


def brute_overlap_add(decode, window, grid_y, grid_x, r=16):
    """Normalised overlap-add of every tile of one window, written directly."""
    num = den = 0
    for y0, th, wy in zip(grid_y.starts, grid_y.sizes, ramp_weights(grid_y)):
        for x0, tw, wx in zip(grid_x.starts, grid_x.sizes, ramp_weights(grid_x)):
            tile = decode(window[None, :, :, y0 // r : (y0 + th) // r, x0 // r : (x0 + tw) // r])[0]
            weight = torch.zeros(grid_y.length, grid_x.length)
            weight[y0 : y0 + th, x0 : x0 + tw] = wy[:, None] * wx[None, :]
            placed = torch.zeros(3, tile.shape[1], grid_y.length, grid_x.length)
            placed[:, :, y0 : y0 + th, x0 : x0 + tw] = tile
            num = num + placed * weight
            den = den + weight
    return num / den


def test_two_dimensional_grid_is_a_normalised_overlap_add_over_every_tile(vae):
    z = latents(7, 22, 21, seed=3)  # 352 × 336 px: 2 × 2 tiles meeting in a corner region
    decode = decoder_of(vae)
    ours = decode_tiled(decode, z)
    grid_y, grid_x = split_tiles(352), split_tiles(336)
    brute = brute_overlap_add(decode, z, grid_y, grid_x)  # [3, 28, H, W]
    expected = torch.cat([brute[:, 3:20], brute[:, 23:28]], dim=1).permute(1, 2, 3, 0)
    assert (ours - expected).abs().max() <= 1e-5
    # Away from the corner it is the released blend; in the corner the released stitch drops the
    # diagonal tile, which the overlap-add keeps.
    ref = reference_decode(vae, z)
    y_overlap = slice(grid_y.starts[1], grid_y.sizes[0])
    x_overlap = slice(grid_x.starts[1], grid_x.sizes[0])
    outside = torch.ones(352, 336, dtype=torch.bool)
    outside[y_overlap, x_overlap] = False
    assert (ours[:, outside] - ref[:, outside]).abs().max() <= 1e-5
    assert (ours[:, y_overlap, x_overlap] - ref[:, y_overlap, x_overlap]).abs().max() > 1e-4


def local_decode(z):
    """A decoder with no spatial context: every latent voxel becomes its own 4×16×16 block."""
    weight = torch.linspace(-1, 1, 24 * 3).view(3, 24)
    pixels = torch.einsum("oc,nct...->not...", weight, z)
    return pixels.repeat_interleave(4, 2).repeat_interleave(16, 3).repeat_interleave(16, 4)


def test_a_context_free_decoder_tiles_seamlessly():
    z = latents(12, 37, 45, seed=4)
    ours = decode_tiled(local_decode, z, tiling=Tiling(tiles_per_batch=5))
    whole = decode_tiled(local_decode, z, tiling=Tiling(tile_px=37 * 16 + 16, overlap_px=64))  # one tile
    assert (ours - whole).abs().max() <= 1e-5


@pytest.mark.parametrize("h, w", [(30, 50), (16, 16), (17, 83), (48, 84), (5, 41)])
@pytest.mark.parametrize("tile, overlap", [(256, 64), (320, 64), (192, 96)])
def test_constant_tiles_compose_to_an_exactly_constant_canvas(h, w, tile, overlap):
    z = latents(2, h, w)
    value = 0.3  # not a short binary fraction: any rounding in the composition would show
    out = decode_tiled(
        lambda t: torch.full((t.shape[0], 3, t.shape[2] * 4, t.shape[3] * 16, t.shape[4] * 16), value),
        z,
        tiling=Tiling(tile_px=tile, overlap_px=overlap),
    )
    assert torch.equal(out, torch.full_like(out, value))


def test_ramp_weights_are_a_partition_of_unity_on_every_canvas():
    for length in range(16, 1600, 16):  # decoded canvases are whole latents
        grid = split_tiles(length)
        covered = torch.zeros(length)
        for start, weight in zip(grid.starts, ramp_weights(grid)):
            covered[start : start + weight.numel()] += weight
        # every pixel has weight (no hole), and with two tiles per overlap the ramps sum to exactly one
        assert (covered > 0).all(), length
        assert torch.equal(covered, torch.ones(length)) or any(o > t / 2 for o, t in zip(grid.overlaps, grid.sizes))


def test_finish_progress_and_output_buffer():
    z = latents(7, 20, 33)
    calls = []
    out = torch.full((22, 320, 528, 3), float("nan"))
    got = decode_tiled(
        local_decode,
        z,
        tiling=Tiling(tiles_per_batch=2),
        hooks=DecodeHooks(out=out, progress=lambda done, total: calls.append((done, total))),
        finish=lambda p: p.clamp(0, 0.5),
    )
    assert got is out and not out.isnan().any()
    assert out.min() >= 0 and out.max() <= 0.5
    tiles = 2 * 3  # 2 tile rows × 3 tile columns, one window
    assert calls == [(done, tiles) for done in range(1, tiles + 1)]


def test_untrained_tile_sizes_are_allowed_and_said():
    z = latents(7, 20, 33)
    said = []
    decode_tiled(local_decode, z, tiling=Tiling(tile_px=192, overlap_px=48), hooks=DecodeHooks(report=said.append))
    assert len(said) == 1 and "192 px tiles and 48 px overlap" in said[0] and "trained regime" in said[0]
    said.clear()
    decode_tiled(local_decode, z, hooks=DecodeHooks(report=said.append))
    assert said == []


def test_cancel_stops_before_the_next_batch():
    z = latents(12, 20, 20)
    decoded = []

    def decode(t):
        decoded.append(t.shape[0])
        return local_decode(t)

    def cancel():
        if len(decoded) >= 2:
            raise KeyboardInterrupt("cancelled")

    with pytest.raises(KeyboardInterrupt):
        decode_tiled(decode, z, tiling=Tiling(tiles_per_batch=1), hooks=DecodeHooks(check_cancel=cancel))
    assert len(decoded) == 2


@pytest.mark.parametrize(
    "shortage",
    [lambda: torch.OutOfMemoryError("fake"), lambda: torch.AcceleratorError("CUDA error: out of memory")],
    ids=["out-of-memory", "cuda-error-out-of-memory"],
)
def test_out_of_memory_halves_the_batch_then_offloads_then_says_so(shortage):
    z = latents(7, 20, 40)
    said, offloaded = [], []

    def decode(t):
        if t.shape[0] > 1 and not offloaded:
            raise shortage()
        return local_decode(t)

    out = decode_tiled(decode, z, tiling=Tiling(tiles_per_batch=4), hooks=DecodeHooks(report=said.append))
    assert (out - decode_tiled(local_decode, z)).abs().max() == 0
    assert said == [
        "video decode ran out of memory; retrying with 2 tile(s) per batch",
        "video decode ran out of memory; retrying with 1 tile(s) per batch",
    ]

    def always_oom(t):
        raise shortage()

    with pytest.raises(DecodeOutOfMemory, match="1 tile per batch and the weights offloaded"):
        decode_tiled(
            always_oom,
            z,
            tiling=Tiling(tiles_per_batch=1),
            hooks=DecodeHooks(offload=lambda: offloaded.append(1) or "weights moved to CPU", report=said.append),
        )
    assert offloaded == [1] and said[-1].endswith("weights moved to CPU")


def test_bad_inputs():
    with pytest.raises(H3InputError, match=r"latents must be \[C, T, h, w\]"):
        decode_tiled(local_decode, torch.zeros(1, 24, 7, 2, 2))
    with pytest.raises(H3InputError, match=r"out must have shape \(22, 32, 32, 3\)"):
        decode_tiled(local_decode, latents(7, 2, 2), hooks=DecodeHooks(out=torch.zeros(21, 32, 32, 3)))


@pytest.mark.parametrize("T", [7, 12])
def test_a_canvas_of_one_tile_decodes_exactly_as_the_direct_decode(vae, T):
    z = latents(T, 16, 11, seed=T)  # 256 × 176 px: one tile
    ours = decode_tiled(decoder_of(vae), z)
    vae.use_tiling = False
    try:
        direct = reference_decode(vae, z)
    finally:
        vae.use_tiling = True
    assert torch.equal(ours, direct)


MEMORY_PROBE = """
import resource, sys, torch
sys.path.insert(0, {root!r})
from h3_core.media.tiling import Tiling, decode_tiled

def decode(z):
    weight = torch.linspace(-1, 1, 24 * 3).view(3, 24)
    pixels = torch.einsum("oc,nct...->not...", weight, z)
    return pixels.repeat_interleave(4, 2).repeat_interleave(16, 3).repeat_interleave(16, 4)

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

torch.set_num_threads(1)
decode_tiled(decode, torch.randn(24, 7, 2, 2))  # load everything once
latents = torch.randn(24, {T}, 32, 64)
before = rss_kib()
out = decode_tiled(decode, latents, tiling=Tiling(tiles_per_batch=2))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print("WORKING_KIB", peak - before - out.numel() * out.element_size() // 1024)
"""


def working_memory_kib(T):
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    # Large blocks straight from mmap, so freed memory leaves the resident set at once and the high-water
    # mark is the peak of live tensors rather than of the allocator's caches.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_ARENA_MAX="1")
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE.format(root=root, T=T)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.split("WORKING_KIB")[-1])


def test_working_memory_does_not_grow_with_the_clip():
    # 512 × 1024 px: a 2-window clip (12 latents, 39 frames) and a 6-window clip (32 latents, 107 frames).
    two, six = working_memory_kib(12), working_memory_kib(32)
    # Holding one more window's frames would add 28 × 3 × 512 × 1024 × 4 B = 168 MiB.
    assert six <= two * 1.01, (two, six)


@pytest.mark.parametrize("T", [4, 7, 12, 23])
def test_frames_are_announced_once_in_order_and_final_when_announced(vae, T):
    """Every frame is handed to ``on_frames`` once, in order, window by window, already equal to what the decode
    returns (the released decode's frames): nothing written after it was announced."""
    z = latents(T, 2, 3, seed=T)
    announced = []
    hooks = DecodeHooks(on_frames=lambda start, frames: announced.append((start, frames.clone())))
    got = decode_tiled(decoder_of(vae), z, hooks=hooks)
    starts = [start for start, _ in announced]
    assert starts[0] == 0 and torch.equal(torch.cat([f for _, f in announced]), got)
    assert all(b == a + len(f) for (a, f), b in zip(announced, starts[1:]))
    assert len(announced) <= len(temporal_plan(T).windows)
    if len(temporal_plan(T).windows) > 1:
        assert len(announced) > 1  # handed over window by window, not at the end
    torch.testing.assert_close(got, reference_decode(vae, z), atol=2e-5, rtol=1e-4)


def test_frames_announced_as_8_bit_values_are_the_mp4s_values_of_the_frames(vae):
    """With ``uint8_frames`` each window's frames are handed over as ``mp4.pixels_uint8`` of the frames the
    decode returns (made before the copy out), covering the clip once, in order; the float frames are unchanged."""
    from h3_core.media.mp4 import pixels_uint8

    z = latents(12, 2, 3, seed=5)
    plain = decode_tiled(decoder_of(vae), z)
    announced = []
    hooks = DecodeHooks(on_frames=lambda start, frames: announced.append((start, frames.clone())), uint8_frames=True)
    got = decode_tiled(decoder_of(vae), z, hooks=hooks)
    assert torch.equal(got, plain) and len(announced) > 1
    assert all(frames.dtype == torch.uint8 for _, frames in announced)
    assert torch.equal(torch.cat([f for _, f in announced]), pixels_uint8(plain))
