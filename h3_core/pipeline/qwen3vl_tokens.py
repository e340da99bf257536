"""Qwen3-VL's tokenizer and image/video processors for a text encoder that ships neither (a single file).

Tokenizer: Qwen's byte-level BPE (``vocab.json``, 151,643 tokens, and ``merges.txt``) read from a folder the
caller names (the ComfyUI node passes the host's ``comfy/text_encoders/qwen25_tokenizer``, which its
Qwen3-VL and MiniMax text encoders use), then the added tokens with their ids:

  * 151643-151668, Qwen3's (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ... ``<|vision_start|>``,
    ``<|vision_end|>``, ``<|vision_pad|>``, ``<|image_pad|>``, ``<|video_pad|>``, ``<tool_call>``, ...,
    ``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>``), as Qwen3's published
    tokenizer_config.json lists them. The folder's own tokenizer_config.json is not read: ComfyUI 0.3.75's
    lists Qwen2.5-VL's ``<|img|>``, ``<|endofimg|>``, ``<|meta|>``, ``<|endofmeta|>`` at 151665-151668 where
    Qwen3 has ``<tool_response>`` ... ``</think>`` (later hosts list Qwen3's);
  * 151669-151675, the seven H3 adds to its tokenizer_config.json's ``additional_special_tokens`` (``<d>``
    and ``</d>`` mark dialogue in H3 prompts), as ComfyUI's ``MINIMAX_EXTRA_TOKENS`` does
    (``comfy/text_encoders/minimax.py`` at 0e74ae10c7fa683df0b28980e0b0f04f380b3dae).

Processors: transformers' ``Qwen2VLImageProcessor`` and ``Qwen3VLVideoProcessor`` with Qwen3-VL's published
preprocessor_config.json / video_preprocessor_config.json values (``PREPROCESSOR``, ``VIDEO_PREPROCESSOR``:
patch 16, temporal patch 2, merge 2, mean and std 0.5, images 65,536-16,777,216 pixels, videos
4,096-25,165,824; the H3 release's ``processor/`` carries the same).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import H3InputError

__all__ = [
    "QWEN3_ADDED_TOKENS",
    "H3_ADDED_TOKENS",
    "FIRST_ADDED_ID",
    "BPE_TOKENS",
    "PREPROCESSOR",
    "VIDEO_PREPROCESSOR",
    "qwen3vl_tokenizer",
    "published_processors",
    "folder_processors",
]

BPE_TOKENS = FIRST_ADDED_ID = 151643
# (content, special) in id order from FIRST_ADDED_ID.
QWEN3_ADDED_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
H3_ADDED_TOKENS = (
    "<d>",
    "</d>",
    "<|cutoff|>",
    "<|lyrics_start|>",
    "<|lyrics_end|>",
    "<|caption_start|>",
    "<|caption_end|>",
)
_PIXELS = dict(
    patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
)
PREPROCESSOR = dict(size={"shortest_edge": 65536, "longest_edge": 16777216}, **_PIXELS)
VIDEO_PREPROCESSOR = dict(
    size={"shortest_edge": 4096, "longest_edge": 25165824}, fps=2, min_frames=4, max_frames=768, **_PIXELS
)


def _bpe(folder: Path) -> tuple[dict[str, int], list[tuple[str, str]]]:
    vocab_file, merges_file = folder / "vocab.json", folder / "merges.txt"
    if not (vocab_file.is_file() and merges_file.is_file()):
        raise H3InputError(
            f"{folder}: no vocab.json and merges.txt; name Qwen's tokenizer folder (ComfyUI ships "
            "it as comfy/text_encoders/qwen25_tokenizer)"
        )
    try:
        vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise H3InputError(f"{vocab_file}: not valid JSON ({exc})") from None
    if not isinstance(vocab, dict) or sorted(vocab.values()) != list(range(BPE_TOKENS)):
        size = len(vocab) if isinstance(vocab, dict) else type(vocab).__name__
        raise H3InputError(f"{vocab_file}: not Qwen's BPE vocabulary (ids 0-{BPE_TOKENS - 1}); it holds {size} entries")
    merges = []
    for line in merges_file.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#version"):
            pair = tuple(line.split(" "))
            if len(pair) != 2:
                raise H3InputError(f"{merges_file}: line {line!r} is not a merge of two pieces")
            merges.append(pair)
    return vocab, merges


def qwen3vl_tokenizer(folder: str | Path):
    """H3's Qwen3-VL tokenizer from the BPE files in ``folder`` (module docstring): a transformers
    ``Qwen2Tokenizer`` whose added tokens have Qwen3-VL's and H3's ids."""
    import inspect

    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    folder = Path(folder)
    vocab, merges = _bpe(folder)
    plain = dict(unk_token=None, bos_token=None, eos_token=None, pad_token=None, clean_up_tokenization_spaces=False)
    if "vocab" in inspect.signature(Qwen2Tokenizer.__init__).parameters:  # transformers 5: takes the tables
        tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, **plain)
    else:  # transformers 4.57: the fast class builds the same tables from the files
        from transformers import Qwen2TokenizerFast

        tokenizer = Qwen2TokenizerFast(
            vocab_file=str(folder / "vocab.json"), merges_file=str(folder / "merges.txt"), **plain
        )
    added = [*QWEN3_ADDED_TOKENS, *((token, True) for token in H3_ADDED_TOKENS)]
    tokenizer.add_tokens([AddedToken(token, special=special, normalized=False) for token, special in added])
    ids = tokenizer.convert_tokens_to_ids([token for token, _ in added])
    if ids != list(range(FIRST_ADDED_ID, FIRST_ADDED_ID + len(added))):
        raise H3InputError(
            f"{folder}: its vocabulary already holds some of Qwen3-VL's added tokens; it is not "
            "Qwen's plain BPE vocabulary"
        )
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    return tokenizer


def published_processors():
    """``(image processor, video processor)`` with Qwen3-VL's published settings."""
    import transformers

    # the class Qwen3-VL's preprocessor_config.json names (image_processor_type), where this transformers has it
    image_cls = getattr(transformers, "Qwen2VLImageProcessorFast", None) or transformers.Qwen2VLImageProcessor
    return image_cls(**PREPROCESSOR), transformers.Qwen3VLVideoProcessor(**VIDEO_PREPROCESSOR)


def folder_processors(folders) -> tuple | None:
    """``(image processor, video processor)`` from the first of ``folders`` holding a preprocessor_config.json,
    or None."""
    from transformers import AutoImageProcessor, AutoVideoProcessor

    found = next((Path(d) for d in folders if (Path(d) / "preprocessor_config.json").is_file()), None)
    if found is None:
        return None
    return (
        AutoImageProcessor.from_pretrained(found, local_files_only=True),
        AutoVideoProcessor.from_pretrained(found, local_files_only=True),
    )
