"""The reference window softmax: one dense attention per video frame over its kept keys.

O(F) launches and a copy of the global keys per frame: slow on purpose, and the oracle every other
backend is tested against. Runs on any device and in any float dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F_

from .layout import SequenceLayout, WindowSpec, anchor_frames, clamped_window, window_bounds

__all__ = ["window_softmax_ref", "frame_keys"]


def _attend(q_rows, k_rows, v_rows, scale):
    """[Tq, H, D] queries over [Tk, H, D] keys through plain SDPA on head-major views."""
    out = F_.scaled_dot_product_attention(
        q_rows.transpose(0, 1), k_rows.transpose(0, 1), v_rows.transpose(0, 1), scale=scale
    )
    return out.transpose(0, 1)


def frame_keys(layout: SequenceLayout, window: WindowSpec, device):
    """The window rule spelled out per query span: ``(rows, keys)`` for the global rows and then every video frame,
    ``rows`` a slice of query rows and ``keys`` the index tensor of the key rows they keep (None: every row)."""
    num_frames = layout.num_frames
    for a, b in layout.global_ranges():
        yield slice(a, b), None
    global_rows = [torch.arange(a, b, device=device) for a, b in layout.global_ranges()]
    anchors = anchor_frames(num_frames)
    for frame, bounds in enumerate(window_bounds(num_frames, window.radius, window.chunk)):
        rows = slice(*layout.frame_rows(frame))
        if window.anchor_rows and frame in anchors:
            yield rows, None
            continue
        lo, hi = clamped_window(bounds, num_frames)
        frames = set(range(lo, hi + 1))
        if window.anchor_columns:
            frames.update(anchors)
        video_rows = [torch.arange(*layout.frame_rows(f), device=device) for f in sorted(frames)]
        yield rows, torch.cat(global_rows + video_rows)


def window_softmax_ref(q, k, v, layout: SequenceLayout, window: WindowSpec, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    for rows, keys in frame_keys(layout, window, q.device):
        if keys is None:
            out[rows] = _attend(q[rows], k, v, scale)
        else:
            out[rows] = _attend(q[rows], k[keys], v[keys], scale)
    return out
