"""The DiT's checkpoint layouts (ComfyUI's single files, with or without their prefix; diffusers' folder; the
official shards, whose ``qkv_proj`` rows are interleaved per head) and the DiT read from one of them."""

from __future__ import annotations

import torch

from ..errors import H3InputError
from ..models.dit import DiTConfig, rope_inv_freq
from .files import CheckpointFiles
from .keymap import KeyMap, Rule, swap_halves

__all__ = ["layouts", "native_layout", "diffusers_layout", "official_layout", "curve_grid"]


def _stack_qkv(parts):
    return torch.cat(parts)


def diffusers_layout(cfg: DiTConfig) -> KeyMap:
    """diffusers ``MiniMaxH3Transformer3DModel`` names (its ``transformer/`` folder)."""
    rules = [
        Rule(r"video_patch_proj\.(?P<p>weight|bias)", ("proj_in.{p}",)),
        Rule(r"audio_patch_proj\.(?P<p>weight|bias)", ("audio_proj_in.{p}",)),
        Rule(r"condition_proj\.(?P<p>weight|bias)", ("context_embedder.{p}",)),
        Rule(r"time_embedder\.proj_in\.(?P<p>weight|bias)", ("time_embedder.linear_1.{p}",)),
        Rule(r"time_embedder\.proj_out\.(?P<p>weight|bias)", ("time_embedder.linear_2.{p}",)),
        Rule(r"rope\.inv_freq", (), lambda parts: rope_inv_freq(cfg)),
        Rule(r"final_layer\.norm\.weight", ("norm_out.norm.weight",)),
        Rule(r"final_layer\.adaln_proj\.linear\.(?P<p>weight|bias)", ("norm_out.linear.{p}",)),
        Rule(r"final_layer\.video_out\.(?P<p>weight|bias)", ("proj_out.{p}",)),
        Rule(r"final_layer\.audio_out\.(?P<p>weight|bias)", ("audio_proj_out.{p}",)),
    ]
    for stack_re, stack_src in (
        (r"blocks\.(?P<n>\d+)\.", "transformer_blocks.{n}."),
        (r"token_refiner\.blocks\.(?P<n>\d+)\.", "token_refiner.refiner_blocks.{n}."),
    ):
        rules += [
            Rule(
                stack_re + r"attn\.qkv_proj\.weight",
                tuple(stack_src + f"attn.to_{x}.weight" for x in "qkv"),
                _stack_qkv,
            ),
            Rule(stack_re + r"attn\.q_norm\.weight", (stack_src + "attn.norm_q.weight",)),
            Rule(stack_re + r"attn\.k_norm\.weight", (stack_src + "attn.norm_k.weight",)),
            Rule(stack_re + r"attn\.out_proj\.weight", (stack_src + "attn.to_out.0.weight",)),
            Rule(stack_re + r"mlp\.fc1\.weight", (stack_src + "ff.net.0.proj.weight",), swap_halves),
            Rule(stack_re + r"mlp\.fc2\.weight", (stack_src + "ff.net.2.weight",)),
            Rule(
                stack_re + r"(?P<rest>norm1\.weight|norm2\.weight|adaln_proj\.linear\.(weight|bias))",
                (stack_src + "{rest}",),
            ),
        ]
    return KeyMap("diffusers", tuple(rules))


def native_layout(prefix: str = "") -> KeyMap:
    """Native names with ``qkv_proj`` stacked [q; k; v]: ComfyUI's repackaged files (also with the
    ``model.diffusion_model.`` prefix)."""
    return KeyMap("ComfyUI", prefix=prefix)


def _deinterleave_qkv(heads: int, head_dim: int):
    """Rows ``[h: q, k, v]`` (the official shards) → stacked ``[q; k; v]``."""

    def combine(parts):
        w = parts[0]
        return w.view(heads, 3, head_dim, -1).transpose(0, 1).reshape(3 * heads * head_dim, -1)

    return combine


def official_layout(cfg: DiTConfig) -> KeyMap:
    """The official FL2VA / Ref2VA shards: native names, ``qkv_proj`` interleaved per head. Its keys are the
    same as ComfyUI's, so it is chosen by ``load_h3_model(..., qkv_interleaved=True)``, never guessed."""
    stack = r"(?P<s>(token_refiner\.)?blocks\.\d+)\."
    return KeyMap(
        "official",
        (
            Rule(
                stack + r"attn\.qkv_proj\.weight",
                ("{s}.attn.qkv_proj.weight",),
                _deinterleave_qkv(cfg.heads, cfg.head_dim),
            ),
        ),
    )


def curve_grid(files: CheckpointFiles) -> tuple[int, int] | None:
    """(grid, width) of a pruned checkpoint's ``adaln_t_table``, or None for the full form."""
    for key in ("adaln_t_table", "model.diffusion_model.adaln_t_table"):
        if key in files.keys:
            shape = files.shape(key)
            if len(shape) != 2 or shape[0] < 2:
                raise H3InputError(f"{files.path}: {key} must be [grid >= 2, width], got {list(shape)}")
            return shape[0], shape[1]
    return None


def layouts(cfg: DiTConfig, qkv_interleaved: bool = False) -> tuple[KeyMap, ...]:
    if qkv_interleaved:
        return (official_layout(cfg),)
    return (native_layout(), native_layout("model.diffusion_model."), diffusers_layout(cfg))
