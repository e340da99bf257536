"""Prompt encoding with a tiny random Qwen3-VL and a tiny tokenizer (h3_core.pipeline.text_encoder)."""

import pytest
import torch

from h3_core.errors import H3InputError

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from h3_core.pipeline.text_encoder import load_text_encoder  # noqa: E402

WORDS = ["a", "fox", "runs", "through", "snow", "<d>", "</d>", "[English]", "hello"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    vocab = {w: i for i, w in enumerate(["<unk>", "<|endoftext|>", "<|im_start|>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|im_start|>",
                                                eos_token="<|endoftext|>")
    (root / "tokenizer").mkdir()
    fast.save_pretrained(root / "tokenizer")
    cfg = transformers.Qwen3VLConfig(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=len(vocab),
                         rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0]),
    )
    torch.manual_seed(0)
    transformers.Qwen3VLForConditionalGeneration(cfg).save_pretrained(root / "text_encoder")
    return root


def test_layer_states_without_final_norm_and_without_special_tokens(folder):
    encoder = load_text_encoder(folder, dtype=torch.float32, layer=3)
    emb = encoder.encode("a fox runs through snow")
    ids = encoder.tokenizer("a fox runs through snow", add_special_tokens=False, return_tensors="pt").input_ids
    assert ids.shape[1] == 5 and emb.embeds.shape == (5, 32)
    with torch.no_grad():
        full = encoder.language_model(input_ids=ids, output_hidden_states=True)
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
    assert not resident.streamed and streamed.streamed
    a, b = resident.encode("a fox runs"), streamed.encode("a fox runs")
    assert torch.equal(a.embeds, b.embeds)
    assert streamed.layer_visits == 3  # layers past the conditioning layer never run
    # "auto" streams exactly when the device says the weights do not fit
    asked = []
    tight = load_text_encoder(folder, dtype=torch.float32, layer=3,
                              fits=lambda device, nbytes: asked.append(nbytes) or False)
    roomy = load_text_encoder(folder, dtype=torch.float32, layer=3, fits=lambda device, nbytes: True)
    assert tight.streamed and not roomy.streamed and asked and asked[0] > 0
    with pytest.raises(H3InputError, match=r"offload must be one of \['auto', 'none', 'layers'\], got 'disk'"):
        load_text_encoder(folder, dtype=torch.float32, layer=3, offload="disk")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_streamed_to_cuda_keeps_the_weights_at_home(folder):
    host = load_text_encoder(folder, dtype=torch.float32, layer=3, offload="none")
    streamed = load_text_encoder(folder, dtype=torch.float32, layer=3, device="cuda", offload="layers")
    got = streamed.encode("a fox runs through snow")
    want = host.encode("a fox runs through snow")
    assert torch.allclose(got.embeds, want.embeds, atol=1e-5, rtol=1e-4)
    assert all(p.device.type == "cpu" for p in streamed.language_model.layers.parameters())
