"""The tiny random checkpoints (tests/tiny_checkpoints.py) load through the same loaders as real files, take
their sizes from their metadata (h3_core.formats.sizes), and run a whole generation to a soundtrack."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_checkpoints import TINY_DIT, TINY_PREFIX, write_tiny_checkpoints

from h3_core.errors import H3InputError
from h3_core.formats.audio_vae import load_audio_vae
from h3_core.formats.checkpoints import describe_dit_checkpoint, load_h3_model
from h3_core.formats.sizes import NOTE_KEY, SIZES_KEY, sizes_from_metadata, sizes_metadata
from h3_core.formats.video_vae import load_video_vae
from h3_core.media.tiling import decode_video
from h3_core.models.dit import DiTConfig
from h3_core.pipeline.generate import generate
from h3_core.pipeline.request import ClipRequest
from h3_core.pipeline.soundtrack import clip_samples, decode_soundtrack
from h3_core.pipeline.text_encoder import load_text_encoder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoints(tmp_path_factory.mktemp("models"))


def test_files_are_where_comfyui_looks_and_say_what_they_are(tiny):
    assert tiny.dit.parent.name == "diffusion_models" and tiny.video_vae.parent.name == "vae"
    assert tiny.text_encoder.parent.name == "text_encoders"
    for path in (tiny.dit, tiny.linear_branch, tiny.video_vae, tiny.audio_vae):
        assert path.name.startswith(TINY_PREFIX)
        header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
        assert "RANDOM" in header["__metadata__"][NOTE_KEY]
    assert "RANDOM" in json.loads((tiny.text_encoder / "h3_hybrid.json").read_text())[NOTE_KEY]


def test_writing_again_gives_the_same_weights(tiny, tmp_path):
    again = write_tiny_checkpoints(tmp_path)
    for a, b in ((tiny.dit, again.dit), (tiny.video_vae, again.video_vae), (tiny.audio_vae, again.audio_vae)):
        first, second = load_file(str(a)), load_file(str(b))
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_a_whole_generation_on_the_tiny_checkpoints(tiny):
    model = load_h3_model(tiny.dit, branch=tiny.linear_branch, dtype=torch.float32)
    assert model.cfg == DiTConfig(**{**TINY_DIT.__dict__, "hybrid": True})
    encoder = load_text_encoder(tiny.text_encoder, dtype=torch.float32)
    prompt = encoder.encode("a fox runs through snow")
    video_vae = load_video_vae(tiny.video_vae, dtype=torch.float32)
    audio_vae = load_audio_vae(tiny.audio_vae)
    with torch.no_grad():
        video, audio = generate(model, prompt, ClipRequest(frames=56, width=64, height=32, steps=2, seed=1))
    frames = decode_video(video_vae, video)
    waveform = decode_soundtrack(audio_vae, audio, frames=56)
    assert frames.shape == (56, 32, 64, 3) and 0 <= frames.min() and frames.max() <= 1
    # 93 audio latents of 800 samples: 8 ms short of the 56 frames, so nothing is cut
    assert clip_samples(56) == 74667 and waveform.shape == (2, 93 * 800) and waveform.abs().max() <= 1
    assert torch.isfinite(waveform).all() and waveform.std() > 0


def test_sizes_round_trip_and_bad_sizes_are_named(tmp_path):
    assert sizes_from_metadata(sizes_metadata(TINY_DIT), DiTConfig, "x") == TINY_DIT
    assert sizes_from_metadata({}, DiTConfig, "x") is None
    state = load_file(str(write_tiny_checkpoints(tmp_path).dit))
    bad = tmp_path / "bad.safetensors"
    save_file(state, str(bad), metadata={SIZES_KEY: json.dumps({"hidden": 48, "wings": 2})})
    with pytest.raises(
        H3InputError,
        match=r"bad\.safetensors: the sizes in its metadata \(h3_hybrid\.sizes\) do not "
        r"describe a DiTConfig: unknown fields \['wings'\]",
    ):
        describe_dit_checkpoint(bad)


def test_without_sizes_a_tiny_file_is_checked_against_the_released_model(tmp_path):
    state = load_file(str(write_tiny_checkpoints(tmp_path).dit))
    plain = tmp_path / "plain.safetensors"
    save_file(state, str(plain))
    with pytest.raises(H3InputError, match=r"plain\.safetensors: not a MiniMax H3 DiT checkpoint"):
        describe_dit_checkpoint(plain)


def test_a_soundtrack_longer_than_the_video_is_cut_and_bad_latents_are_named(tiny):
    audio_vae = load_audio_vae(tiny.audio_vae)
    latents = torch.randn(2, 32, 37, generator=torch.Generator().manual_seed(0))  # 22 frames: 37 latents, 29600 samples
    assert decode_soundtrack(audio_vae, latents, frames=22).shape == (2, clip_samples(22)) == (2, 29333)
    assert decode_soundtrack(audio_vae, latents).shape == (2, 29600)
    with pytest.raises(
        H3InputError, match=r"audio latents must be \[2, 32, frames\] \(left, right\), got \(1, 32, 37\)"
    ):
        decode_soundtrack(audio_vae, latents[:1])


def test_sizes_of_another_kind_of_model_are_not_taken(tiny):
    from h3_core.formats.video_vae import load_video_vae as load_video

    with pytest.raises(
        H3InputError, match=r"h3_tiny_random_audio_vae\.safetensors: not a MiniMax H3 video VAE checkpoint"
    ):
        load_video(tiny.audio_vae)
