"""Which of the DiT's weights the released recipe keeps in fp32, whatever the model's dtype."""

from __future__ import annotations

import re

__all__ = ["keeps_fp32"]

_FP32 = re.compile(r"(video_patch_proj|audio_patch_proj|time_embedder|final_layer\.(video_out|audio_out)|rope)\.")
_CURVE_FP32 = re.compile(r"adaln_t_table|(.*\.)?adaln_proj\.linear\.(weight|bias)")


def keeps_fp32(key: str, curve: bool = False) -> bool:
    """The released fp32 islands: patch projections, timestep MLP, output heads, RoPE frequencies; in the curve
    form also the table and the (rank-r) AdaLN linears."""
    return _FP32.match(key) is not None or (curve and _CURVE_FP32.fullmatch(key) is not None)
