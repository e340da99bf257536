"""Prompt embeddings from files and from ComfyUI CONDITIONING (h3_core.pipeline.prompt)."""

import pickle

import pytest
import torch

from h3_core.errors import H3InputError
from h3_core.pipeline.prompt import PromptEmbedding, from_conditioning, load_prompt_embedding, save_prompt_embedding


def cache(L=7, keyframes=("first", "last")):
    tags = torch.ones(L, dtype=torch.int64)
    tags[1:3] = 0
    return {
        "prompt": "A fox runs.",
        "prompt_embeds": torch.randn(L, 5120).to(torch.bfloat16),
        "text_token_tags": tags,
        "keyframe_anchors": list(keyframes),
        "keyframe_files": [f"{k}.png" for k in keyframes],
        "condition_latents": [torch.randn(1, 24, 1, 6, 8) for _ in keyframes],
        "height": 96,
        "width": 128,
    }


def test_reads_the_vdn_prompt_cache(tmp_path):
    data = cache()
    path = tmp_path / "fox.pt"
    torch.save(data, path)
    emb = load_prompt_embedding(path)
    assert torch.equal(emb.embeds, data["prompt_embeds"]) and emb.embeds.dtype == torch.bfloat16
    assert emb.tags.tolist() == [1, 0, 0, 1, 1, 1, 1]
    assert emb.keyframe_anchors == ("first", "last") and (emb.height, emb.width) == (96, 128)
    assert all(torch.equal(a, b) for a, b in zip(emb.condition_latents, data["condition_latents"]))


def test_the_cache_is_never_unpickled_as_code(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("this must never run",))

    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"prompt_embeds": Payload(), "text_token_tags": torch.ones(1)}, f)
    with pytest.raises(H3InputError, match=r"evil\.pt: not a prompt cache this pack reads"):
        load_prompt_embedding(path)


def test_safetensors_form_round_trips(tmp_path):
    data = cache(keyframes=("first",))
    original = PromptEmbedding(
        data["prompt_embeds"],
        data["text_token_tags"],
        data["prompt"],
        ("first",),
        ("first.png",),
        data["condition_latents"],
        96,
        128,
    )
    path = tmp_path / "fox.safetensors"
    save_prompt_embedding(path, original)
    assert not (tmp_path / "fox.safetensors.partial").exists()
    emb = load_prompt_embedding(path)
    assert torch.equal(emb.embeds, original.embeds) and torch.equal(emb.tags, original.tags)
    assert (emb.prompt, emb.keyframe_anchors, emb.keyframe_files, emb.height) == (
        "A fox runs.",
        ("first",),
        ("first.png",),
        96,
    )
    assert torch.equal(emb.condition_latents[0], original.condition_latents[0])


def test_conditioning_rows_are_text_unless_tagged():
    emb = from_conditioning(torch.randn(1, 4, 5120))
    assert emb.tags.tolist() == [1, 1, 1, 1]
    emb = from_conditioning(torch.randn(1, 3, 5120), tags=torch.tensor([[1, 0, 1]]))
    assert emb.tags.tolist() == [1, 0, 1]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: from_conditioning(torch.randn(1, 4, 4096)), r"must be \[tokens, 5120\].*got \(4, 4096\)"),
        (
            lambda: from_conditioning(torch.randn(2, 4, 5120)),
            r"conditioning must be one \[1, tokens, 5120\] tensor, got \(2, 4, 5120\)",
        ),
        (
            lambda: from_conditioning(torch.randn(1, 3, 5120), tags=torch.tensor([1, 2, 1])),
            r"must be 1 \(text\) or 0 .* found \[2\]",
        ),
        (
            lambda: from_conditioning(torch.randn(1, 3, 5120), tags=torch.tensor([1, 1])),
            r"one tag per token \(3\), got \(2,\)",
        ),
    ],
)
def test_bad_conditioning(make, message):
    with pytest.raises(H3InputError, match=message):
        make()


def test_bad_files(tmp_path):
    wrong = tmp_path / "x.pt"
    torch.save({"embeds": torch.zeros(1)}, wrong)
    with pytest.raises(H3InputError, match=r"needs 'prompt_embeds' and 'text_token_tags', found \['embeds'\]"):
        load_prompt_embedding(wrong)
    text = tmp_path / "x.txt"
    text.write_text("hello")
    with pytest.raises(H3InputError, match=r"come as \.pt \(prompt cache\) or \.safetensors, not '\.txt'"):
        load_prompt_embedding(text)
    mismatched = cache()
    mismatched["keyframe_anchors"] = ["first"]
    path = tmp_path / "m.pt"
    torch.save(mismatched, path)
    with pytest.raises(H3InputError, match="1 keyframe anchors but 2 condition latents"):
        load_prompt_embedding(path)


def test_an_embedding_of_another_width_round_trips_with_its_width(tmp_path):
    from h3_core.pipeline.prompt import PromptEmbedding, load_prompt_embedding, save_prompt_embedding

    narrow = PromptEmbedding(torch.randn(4, 32), torch.ones(4, dtype=torch.long), "a fox", features=32)
    save_prompt_embedding(tmp_path / "narrow.safetensors", narrow)
    back = load_prompt_embedding(tmp_path / "narrow.safetensors")
    assert back.features == 32 and torch.equal(back.embeds, narrow.embeds)
