"""Prompt encoding with a tiny random Qwen3-VL and a tiny tokenizer (h3_core.pipeline.text_encoder)."""

import pytest
import torch

from h3_core.errors import H3InputError

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, models, pre_tokenizers

from h3_core.pipeline.text_encoder import load_text_encoder, move_module

WORDS = [
    "a",
    "fox",
    "runs",
    "through",
    "snow",
    "<d>",
    "</d>",
    "[English]",
    "hello",
    "<Picture",
    "<Audio",
    "<Video",
    "1>:",
    "2>:",
    "3>:",
    "seconds>",
    "<0.2",
    "<1.0",
]
VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    vocab = {w: i for i, w in enumerate(["<unk>", "<|endoftext|>", "<|im_start|>"] + WORDS + VISION)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<|im_start|>", eos_token="<|endoftext|>"
    )
    (root / "tokenizer").mkdir()
    fast.save_pretrained(root / "tokenizer")
    processor = dict(
        patch_size=4, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 64, "longest_edge": 4096}
    )
    transformers.Qwen2VLImageProcessor(**processor).save_pretrained(root / "processor")
    transformers.Qwen3VLVideoProcessor(**processor).save_pretrained(root / "processor")
    cfg = transformers.Qwen3VLConfig(
        text_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=len(vocab),
            rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=32,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            deepstack_visual_indexes=[0],
        ),
        image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
    )
    torch.manual_seed(0)
    transformers.Qwen3VLForConditionalGeneration(cfg).save_pretrained(root / "text_encoder")
    return root


def test_layer_states_without_final_norm_and_without_special_tokens(folder):
    encoder = load_text_encoder(folder, dtype=torch.float32, layer=3)
    emb = encoder.encode("a fox runs through snow")
    ids = encoder.tokenizer("a fox runs through snow", add_special_tokens=False, return_tensors="pt").input_ids
    assert ids.shape[1] == 5 and emb.embeds.shape == (5, 32)
    assert len(encoder.language_model.layers) == 3  # the layer after the conditioning layer is not held
    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(folder / "text_encoder", dtype=torch.float32)
    with torch.no_grad():
        full = model.eval().model.language_model(input_ids=ids, output_hidden_states=True)
    assert torch.equal(emb.embeds, full.hidden_states[3][0])
    assert not torch.allclose(emb.embeds, full.last_hidden_state[0])  # the final norm is not applied
    assert emb.tags.tolist() == [1] * 5 and emb.prompt == "a fox runs through snow"


def test_bad_requests(folder, tmp_path):
    with pytest.raises(H3InputError, match="conditioning layer 50 is outside the text model's 4 layers"):
        load_text_encoder(folder, dtype=torch.float32)
    encoder = load_text_encoder(folder, dtype=torch.float32, layer=2)
    with pytest.raises(H3InputError, match="the prompt is empty"):
        encoder.encode("   ")
    with pytest.raises(H3InputError, match="no config.json"):
        load_text_encoder(tmp_path)


def test_streamed_layers_give_the_same_states(folder):
    resident = load_text_encoder(folder, dtype=torch.float32, layer=3, offload="none")
    streamed = load_text_encoder(folder, dtype=torch.float32, layer=3, offload="layers")
    a, b = resident.encode("a fox runs"), streamed.encode("a fox runs")
    assert not resident.streamed and streamed.streamed
    assert torch.equal(a.embeds, b.embeds)
    assert streamed.layer_visits == 3  # layers past the conditioning layer never run
    # "auto" decides at the first encode, streaming exactly when the device says the weights do not fit
    asked = []
    tight = load_text_encoder(
        folder, dtype=torch.float32, layer=3, fits=lambda device, nbytes: asked.append(nbytes) or False
    )
    roomy = load_text_encoder(folder, dtype=torch.float32, layer=3, fits=lambda device, nbytes: True)
    assert tight.streamed is None and not asked
    tight.encode("a fox runs"), roomy.encode("a fox runs")
    assert tight.streamed and not roomy.streamed and asked == [tight.resident_bytes] and asked[0] > 0
    with pytest.raises(H3InputError, match=r"offload must be one of \['auto', 'none', 'layers'\], got 'disk'"):
        load_text_encoder(folder, dtype=torch.float32, layer=3, offload="disk")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_streamed_to_cuda_keeps_the_weights_at_home(folder):
    host = load_text_encoder(folder, dtype=torch.float32, layer=3, offload="none")
    streamed = load_text_encoder(folder, dtype=torch.float32, layer=3, device="cuda", offload="layers")
    got = streamed.encode("a fox runs through snow")
    want = host.encode("a fox runs through snow")
    assert torch.allclose(got.embeds, want.embeds, atol=1e-5, rtol=1e-4)
    layers = list(streamed.language_model.layers.parameters())
    assert all(p.device.type == "cpu" and p.is_pinned() for p in layers)  # copied from page-locked memory
    homes = [p.data_ptr() for p in layers]
    again = streamed.encode("a fox runs through snow")
    assert torch.equal(again.embeds, got.embeds)
    assert [p.data_ptr() for p in layers] == homes  # pointed back home after each visit, never copied back


def test_weights_moved_in_inference_mode_become_ordinary_tensors_again():
    """The host moves models while it runs a node, in inference mode, which leaves their weights inference tensors;
    the encoder's own moves (outside inference mode) must give ordinary tensors with a version counter, or the
    next forward fails ("Inference tensors do not track version counter")."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    module[1].weight.requires_grad_(False)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with torch.inference_mode():
        for param in module.parameters():
            param.data = param.data.clone()  # what such a move leaves
    assert all(p.is_inference() for p in module.parameters())
    move_module(module, "cpu")
    for name, param in module.named_parameters():
        assert not param.is_inference() and param._version >= 0, name
        assert torch.equal(param, before[name]), name
    assert [p.requires_grad for p in module.parameters()] == [True, True, False, True]
    with torch.inference_mode():
        assert torch.isfinite(module(torch.randn(2, 4))).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_streamed_after_the_host_moved_the_weights_in_inference_mode(folder):
    host = load_text_encoder(folder, dtype=torch.float32, layer=3, offload="none")
    streamed = load_text_encoder(folder, dtype=torch.float32, layer=3, device="cuda", offload="none")
    streamed.encode("a fox runs")
    with torch.inference_mode():  # the host unloading it while it runs a node
        streamed.model.to("cpu")
    assert all(p.is_inference() for p in streamed.model.parameters())
    streamed.place("cuda", stream=True)
    got = streamed.encode("a fox runs through snow")
    want = host.encode("a fox runs through snow")
    assert streamed.layer_visits == 3
    assert torch.allclose(got.embeds, want.embeds, atol=1e-5, rtol=1e-4)


def pixels(*shape, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


def oracle(folder, prompt, references, layer=3):
    """diffusers 0.42.1's Ref2VA presentation and conditioner call on the same model and media."""
    import types

    from diffusers.modular_pipelines.minimax_h3.encoders import (
        MiniMaxH3Ref2VATextEncoderStep,
        get_qwen3vl_prompt_embeds,
    )

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder / "tokenizer")
    processor = transformers.Qwen3VLProcessor(
        image_processor=transformers.AutoImageProcessor.from_pretrained(folder / "processor"),
        tokenizer=tokenizer,
        video_processor=transformers.AutoVideoProcessor.from_pretrained(folder / "processor"),
    )
    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
        folder / "text_encoder", dtype=torch.float32
    ).eval()

    def as_uint8(t):
        return (t.clamp(0, 1) * 255).round().to(torch.uint8).numpy()

    refs = [
        types.SimpleNamespace(
            kind=r.kind,
            has_audio=r.has_audio or r.kind == "audio",
            image=as_uint8(r.media) if r.kind == "image" else None,
            frames=as_uint8(r.media) if r.kind == "video" else None,
        )
        for r in references
    ]
    step = MiniMaxH3Ref2VATextEncoderStep()
    vision, image_tokens, video_tokens, video_times = step._gather_vision_features(processor, refs, 24.0)
    ids, tags = step._build_presentation(tokenizer, prompt, refs, image_tokens, video_tokens, video_times)
    with torch.no_grad():
        embeds = get_qwen3vl_prompt_embeds(model, processor, ids, vision, text_encoder_layer=layer, dtype=torch.float32)
    return ids, tags, embeds[0]


def test_keyframes_are_pictures_with_vision_blocks_as_released(folder):
    from h3_core.pipeline.presentation import PresentedReference

    encoder = load_text_encoder(folder, dtype=torch.float32, layer=3)
    first, last = pixels(24, 40, 3, seed=1), pixels(24, 40, 3, seed=2)
    emb = encoder.encode("a fox runs", keyframes=[first, last])
    ids, tags, embeds = oracle(
        folder, "a fox runs", [PresentedReference("image", first), PresentedReference("image", last)]
    )
    assert emb.tags.tolist() == tags
    assert torch.equal(emb.embeds, embeds)
    words = encoder.tokenizer.convert_ids_to_tokens(ids)
    assert words[:3] == ["<Picture", "1>:", "<|vision_start|>"] and words[-3:] == ["a", "fox", "runs"]
    assert tags[:2] == [1, 1] and tags[2] == 0 and tags[-3:] == [1, 1, 1]
    # The vision rows change the states of the prompt rows after them (the model attends to the pictures).
    plain = encoder.encode("a fox runs")
    assert not torch.allclose(emb.embeds[-3:], plain.embeds)


def test_references_in_packed_order_with_labels_per_modality(folder):
    from h3_core.pipeline.presentation import PresentedReference

    encoder = load_text_encoder(folder, dtype=torch.float32, layer=3)
    refs = [
        PresentedReference("video", pixels(30, 16, 24, 3, seed=3), has_audio=True),  # 1.25 s at 24 fps
        PresentedReference("image", pixels(16, 32, 3, seed=4)),
        PresentedReference("audio"),
        PresentedReference("video", pixels(13, 24, 16, 3, seed=5)),
    ]
    emb = encoder.encode("hello", references=refs)
    ids, tags, embeds = oracle(folder, "hello", refs)
    assert emb.tags.tolist() == tags
    assert torch.equal(emb.embeds, embeds)
    text = [w for w, t in zip(encoder.tokenizer.convert_ids_to_tokens(ids), tags) if t == 1]
    assert text == [
        "<Audio",
        "1>:",
        "<Video",
        "1>:",
        "<0.2",
        "seconds>",
        "<1.0",
        "seconds>",
        "<Picture",
        "1>:",
        "<Audio",
        "2>:",
        "<Video",
        "2>:",
        "<0.2",
        "seconds>",
        "hello",
    ]


def test_video_blocks_follow_the_two_fps_reading():
    from h3_core.pipeline.presentation import video_blocks

    # 24 fps read at 2 fps: every 12th frame; pairs merged (the last frame repeated to fill one); a block
    # is labelled with its pair's mean time
    assert video_blocks(30, 24.0, 2) == ([0, 12, 24], [0.25, 1.0])
    assert video_blocks(13, 24.0, 2) == ([0, 12], [0.25])
    assert video_blocks(10, 5.0, 2) == ([0, 2, 5, 8], [0.25, 1.25])  # 2.5-frame steps rounded half to even
    with pytest.raises(H3InputError, match="at least 13 frames at 24 fps"):
        video_blocks(12, 24.0, 2)


def test_bad_vision_requests(folder, tmp_path):
    from h3_core.pipeline.presentation import PresentedReference

    encoder = load_text_encoder(folder, dtype=torch.float32, layer=3)
    with pytest.raises(H3InputError, match="keyframes .FL2VA. or references .Ref2VA., not both"):
        encoder.encode("a fox", keyframes=[pixels(8, 8, 3)], references=[PresentedReference("audio")])
    with pytest.raises(H3InputError, match=r"reference 0: image pixels must be \[H, W, 3\], got \(3, 8, 8\)"):
        encoder.encode("a fox", keyframes=[pixels(3, 8, 8)])
    with pytest.raises(H3InputError, match="reference 0: kind must be one of"):
        encoder.encode("a fox", references=[PresentedReference("sketch")])
    with pytest.raises(H3InputError, match="an audio reference shows Qwen no pixels"):
        encoder.encode("a fox", references=[PresentedReference("audio", pixels(8, 8, 3))])
    bare = load_text_encoder(folder / "text_encoder", dtype=torch.float32, layer=3)
    bare.tokenizer = encoder.tokenizer
    with pytest.raises(H3InputError, match="no preprocessor_config.json"):
        bare.encode("a fox", keyframes=[pixels(8, 8, 3)])


def test_encoding_runs_whatever_the_callers_grad_state(folder):
    """Weights that require grad, grad enabled: the encoder runs under inference mode itself and gives the states it
    gives under no_grad, as inference tensors."""
    encoder = load_text_encoder(folder, dtype=torch.float32, layer=3)
    for parameter in encoder.language_model.parameters():
        parameter.requires_grad_(True)
    with torch.enable_grad():
        tracked = encoder.encode("a fox runs through snow")
    with torch.no_grad():
        plain = encoder.encode("a fox runs through snow")
    assert torch.equal(tracked.embeds, plain.embeds) and tracked.embeds.is_inference()
