"""The device memory a tiled video decode works in beside the decoder's weights: what a caller asks a memory
manager to make room for before decoding (``h3_core.media.tiling.decode_tiled`` retries with fewer tiles per batch,
then streamed decoder blocks, when the room turns out short, so this is an estimate of the largest transients,
not a bound).

One batch of ``tiles_per_batch`` tiles of a 7-latent temporal window runs through the decoder at once. Per tile
(``t·h·w`` tokens plus the register tokens), the largest live tensors are the gated FFN's hidden pair (two
``ffn_mult · dim`` rows per token in the blocks' dtype) beside the block's input and the fp32 output projection
rows (``3 · temporal_ratio · spatial_ratio²`` per token), and the tile's fp32 pixels. Outside the batch the
composition keeps a band one tile high of the whole frame width: a running weighted mean and its weights, fp32.
"""

from __future__ import annotations

import torch

__all__ = ["decode_working_bytes"]

_WINDOW_LATENTS = 7  # latents per temporal window (h3_core.media.tiling's module docstring)


def decode_working_bytes(
    cfg, frame_width_px: int, *, tile_px: int = 256, tiles_per_batch: int = 4, dtype: torch.dtype = torch.float16
) -> int:
    """Estimated bytes above the weights of decoding one latent video with ``cfg`` (a ``VideoVAEConfig``) at
    ``frame_width_px`` pixels wide, tiles of ``tile_px`` and ``tiles_per_batch`` tiles a batch, the decoder's
    blocks in ``dtype``."""
    side = max(tile_px // cfg.spatial_ratio, 1)
    tokens = _WINDOW_LATENTS * side * side + cfg.register_tokens + 1
    item = torch.finfo(dtype).bits // 8
    dim = cfg.decoder_dim
    ffn = 2 * cfg.ffn_mult * dim * item  # the gated pair
    residual = 2 * dim * item  # the block's input and output
    projected = 3 * cfg.temporal_ratio * cfg.spatial_ratio**2 * 4  # fp32 rows before the unpatchify
    per_tile = tokens * (ffn + residual + projected)
    pixels = 3 * _WINDOW_LATENTS * cfg.temporal_ratio * tile_px * tile_px * 4
    band = 2 * 3 * _WINDOW_LATENTS * cfg.temporal_ratio * tile_px * frame_width_px * 4
    return int(tiles_per_batch * (per_tile + pixels) + band)
