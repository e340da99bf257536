"""User media → conditioning latents (h3_core.pipeline.conditioning) against diffusers 0.42.1's MiniMax-H3 blocks:
the FL2VA resize + keyframe encode steps and the Ref2VA setup + reference encode steps, run as diffusers
pipelines on tiny random VAEs that hold the same weights as ours. Pillow's LANCZOS and torchaudio's
resampler are checked on their own."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from h3_core.errors import H3InputError
from h3_core.formats.audio_vae import load_audio_vae
from h3_core.formats.video_vae import load_video_vae
from h3_core.models.audio_vae import AudioVAEConfig
from h3_core.models.video_vae import VideoVAEConfig
from h3_core.pipeline.conditioning import (
    NormalizedReference,
    encode_keyframe,
    encode_keyframes,
    encode_reference,
    fit_keyframe,
    fit_keyframes,
    keyframe_canvas,
    lanczos_resize,
    normalize_audio_reference,
    normalize_image_reference,
    normalize_video_reference,
    quantize_pixels,
    resample_audio,
)

diffusers = pytest.importorskip("diffusers")
from diffusers.modular_pipelines import SequentialPipelineBlocks
from diffusers.modular_pipelines.minimax_h3 import (
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3VideoReference,
)
from diffusers.modular_pipelines.minimax_h3.before_encoder import (
    MiniMaxH3Ref2VASetupStep,
    MiniMaxH3ResizeStep,
)
from diffusers.modular_pipelines.minimax_h3.encoders import (
    MiniMaxH3KeyframeVaeEncoderStep,
    MiniMaxH3Ref2VAReferenceEncoderStep,
)
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import resolve_canvas_size

VIDEO_STATS = dict(latents_mean=tuple(0.1 * i for i in range(24)), latents_std=tuple(1.0 + 0.05 * i for i in range(24)))
AUDIO_STATS = dict(
    latents_mean=tuple(0.02 * i - 0.3 for i in range(32)), latents_std=tuple(1.0 + 0.03 * i for i in range(32))
)
# Small canvases keep the tiny VAEs fast; the rules are the released ones at another scale.
SHORT_EDGE, MAX_PIXELS, IMAGE_SHORT_EDGE = 64, 64 * 112, 64
CLIP_FRAMES = 124  # diffusers' Ref2VA setup insists on 5-15 s


def rng(seed):
    return np.random.RandomState(seed)


def image(height, width, seed=0):
    """A ComfyUI IMAGE frame: smooth structure plus noise, floats in [0, 1]."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([np.sin(x / 5.0 + c) * np.cos(y / 7.0 - c) for c in range(3)], -1) * 0.35 + 0.5
    return torch.from_numpy((base + rng(seed).rand(height, width, 3) * 0.15).clip(0, 1).astype(np.float32))


def as_pil(pixels):
    """The PIL image diffusers is handed for our float pixels, through its own float → uint8 conversion."""
    return diffusers.image_processor.VaeImageProcessor.numpy_to_pil(pixels.numpy()[None])[0]


@pytest.fixture(scope="module")
def video_vaes(tmp_path_factory):
    torch.manual_seed(0)
    reference = diffusers.AutoencoderKLMiniMaxH3(
        decoder_num_layers=1,
        decoder_num_attention_heads=2,
        decoder_attention_head_dim=16,
        block_out_channels=(8,) * 6,
        norm_num_groups=4,
        **VIDEO_STATS,
    ).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.2)
    folder = tmp_path_factory.mktemp("video_vae")
    reference.save_pretrained(folder)
    cfg = VideoVAEConfig(
        decoder_layers=1, decoder_heads=2, decoder_head_dim=16, block_out_channels=(8,) * 6, norm_groups=4
    )
    return load_video_vae(folder, dtype=torch.float32, cfg=cfg), reference


@pytest.fixture(scope="module")
def audio_vaes(tmp_path_factory):
    torch.manual_seed(1)
    reference = diffusers.AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4,
        latent_dim=64,
        latent_channels=32,
        decoder_dim=256,
        num_attention_heads=2,
        **AUDIO_STATS,
    ).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path_factory.mktemp("audio_vae")
    reference.save_pretrained(folder)
    cfg = AudioVAEConfig(encoder_dim=4, latent_dim=64, latent_channels=32, decoder_dim=256, attention_heads=2)
    return load_audio_vae(folder, cfg=cfg), reference


def pipeline(steps, **components):
    pipe = SequentialPipelineBlocks.from_blocks_dict(steps).init_pipeline()
    pipe.register_to_config(
        canvas_short_edge=SHORT_EDGE, canvas_max_pixels=MAX_PIXELS, reference_image_short_edge=IMAGE_SHORT_EDGE
    )
    if components:
        pipe.update_components(**components)
    return pipe


def assert_same_condition(ours, theirs, vae):
    """Conditioning latents agree up to fp32 rounding, and up to one fp16 step where the released fp16
    rounding of the sampled posterior falls on the other side of a tie because of it."""
    assert ours.shape == theirs.shape
    raw_ours, raw_theirs = vae.denormalize_latents(ours), vae.denormalize_latents(theirs)
    fp16_step = torch.finfo(torch.float16).eps * raw_theirs.abs().clamp(min=2.0**-14)
    assert ((raw_ours - raw_theirs).abs() <= fp16_step + 1e-6).all()
    assert (ours - theirs).abs().max() <= 1e-3
    assert (raw_ours != raw_theirs).float().mean() <= 0.01  # ties are rare; the rest is bit-equal


# ---- keyframes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "first_size, last_size, canvas",
    [
        ((40, 70), (50, 30), (64, 96)),  # the last keyframe is portrait on a landscape canvas: cropped top and bottom
        ((90, 40), (33, 77), (96, 32)),
        ((64, 96), (64, 96), (64, 96)),  # already at the canvas: used as they are
    ],
    ids=["landscape", "portrait", "at-canvas"],
)
def test_keyframes_equal_the_released_fl2va_steps(video_vaes, first_size, last_size, canvas):
    ours_vae, their_vae = video_vaes
    first, last = image(*first_size, seed=1), image(*last_size, seed=2)
    height, width = canvas
    pipe = pipeline({"resize": MiniMaxH3ResizeStep(), "encode": MiniMaxH3KeyframeVaeEncoderStep()}, vae=their_vae)
    state = pipe(image=as_pil(first), last_image=as_pil(last), height=height, width=width)

    fitted = fit_keyframes([first, last], width, height)
    for ours, theirs in zip(fitted, state.get("keyframes")):
        assert torch.equal(ours, torch.from_numpy(np.asarray(theirs)))
    latents = encode_keyframes(ours_vae, (("first", first), ("last", last)), width, height)
    assert [anchor for anchor, _ in latents] == list(state.get("keyframe_anchors")) == ["first", "last"]
    for (_, ours), theirs in zip(latents, state.get("condition_latents")):
        assert ours.shape == (24, 1, height // 16, width // 16)
        assert_same_condition(ours, theirs[0], ours_vae)


def test_a_lone_last_keyframe_is_the_geometry_anchor_and_is_stretched(video_vaes):
    ours_vae, their_vae = video_vaes
    last = image(50, 30, seed=3)
    pipe = pipeline({"resize": MiniMaxH3ResizeStep(), "encode": MiniMaxH3KeyframeVaeEncoderStep()}, vae=their_vae)
    state = pipe(last_image=as_pil(last), height=64, width=96)
    ((anchor, ours),) = encode_keyframes(ours_vae, (("last", last),), 96, 64)
    assert anchor == "last" and state.get("keyframe_anchors") == ("last",)
    assert torch.equal(fit_keyframes([last], 96, 64)[0], torch.from_numpy(np.asarray(state.get("keyframes")[0])))
    assert_same_condition(ours, state.get("condition_latents")[0][0], ours_vae)


def test_cover_crop_arithmetic_over_many_aspect_ratios():
    """The follower's cover-crop rounds sizes and floors the offset as released, which diffusers keeps
    (its generic crop mode differs by a pixel on about half of all ratios)."""
    pipe = pipeline({"resize": MiniMaxH3ResizeStep()})
    anchor = image(64, 64, seed=4)
    generator = rng(5)
    for _ in range(24):
        follower = image(*generator.randint(9, 120, 2), seed=6)
        height, width = 32 * generator.randint(1, 4), 32 * generator.randint(1, 5)
        theirs = pipe(image=as_pil(anchor), last_image=as_pil(follower), height=height, width=width).get("keyframes")
        ours = fit_keyframe(follower, width, height, fit="cover")
        assert torch.equal(ours, torch.from_numpy(np.asarray(theirs[1]))), (tuple(follower.shape), height, width)


@pytest.mark.parametrize("size", [(40, 70), (70, 40), (100, 100), (30, 119), (480, 854)])
def test_default_canvas_follows_the_first_keyframe(size):
    assert keyframe_canvas(image(*size)) == resolve_canvas_size(size[1], size[0], 32, 768, 768 * 1344)


@pytest.mark.parametrize("height, width", [(32, 32), (64, 96), (96, 64), (32, 128)])
def test_keyframe_latent_shapes(video_vaes, height, width):
    ours_vae, _ = video_vaes
    (_, first), (_, last) = encode_keyframes(
        ours_vae, (("first", image(45, 45)), ("last", image(20, 80))), width, height
    )
    assert first.shape == last.shape == (24, 1, height // 16, width // 16)
    assert first.dtype == torch.float32 and first.device.type == "cpu" and torch.isfinite(first).all()


# ---- references --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ref2va(video_vaes, audio_vaes):
    """One diffusers Ref2VA run over an image, a 30 fps video with a mono soundtrack longer than the clip,
    and a stereo audio reference — all at 32 kHz, since diffusers resamples through torchaudio."""
    _, their_vae = video_vaes
    _, their_audio_vae = audio_vaes
    media = dict(
        image=image(50, 90, seed=7),
        video=torch.from_numpy(rng(8).rand(40, 36, 60, 3).astype(np.float32)),
        soundtrack=torch.randn(1, 176000, generator=torch.Generator().manual_seed(9)) * 0.2,  # 5.5 s
        audio=torch.randn(2, 9000, generator=torch.Generator().manual_seed(10)) * 0.2,
    )
    references = [
        MiniMaxH3ImageReference(image=media["image"].permute(2, 0, 1)),  # diffusers tensors are channels-first
        MiniMaxH3VideoReference(frames=media["video"].numpy(), fps=30.0, audio=media["soundtrack"], sample_rate=32000),
        MiniMaxH3AudioReference(audio=media["audio"], sample_rate=32000),
    ]
    pipe = pipeline(
        {"setup": MiniMaxH3Ref2VASetupStep(), "encode": MiniMaxH3Ref2VAReferenceEncoderStep()},
        vae=their_vae,
        audio_vae=their_audio_vae,
    )
    return media, pipe(references=references, num_frames=CLIP_FRAMES)


@pytest.fixture(scope="module")
def our_references(ref2va):
    media, _ = ref2va
    return [
        normalize_image_reference(media["image"], short_edge=IMAGE_SHORT_EDGE),
        normalize_video_reference(
            media["video"],
            30.0,
            frames=CLIP_FRAMES,
            audio=media["soundtrack"],
            sample_rate=32000,
            short_edge=SHORT_EDGE,
            max_pixels=MAX_PIXELS,
        ),
        normalize_audio_reference(media["audio"], 32000, frames=CLIP_FRAMES),
    ]


def test_normalized_references_equal_the_released_setup_step(ref2va, our_references):
    _, state = ref2va
    image_ref, video_ref, audio_ref = state.get("normalized_references")
    ours_image, ours_video, ours_audio = our_references
    assert torch.equal(ours_image.pixels, torch.from_numpy(np.asarray(image_ref.image)))
    assert ours_image.pixels.shape == (64, 128, 3)  # 50 x 90 → short edge 64, long side 115.2 → 128
    assert torch.equal(ours_video.pixels, torch.from_numpy(video_ref.frames))
    assert ours_video.pixels.shape == (32, 64, 96, 3)  # 40 frames at 30 fps are 32 at 24; 5:3 → 96 x 64
    assert torch.equal(ours_video.audio, video_ref.audio)
    assert ours_video.audio.shape == (2, int(CLIP_FRAMES / 24 * 32000))  # truncated to the clip, upmixed
    assert torch.equal(ours_audio.audio, audio_ref.audio)


def test_reference_latents_equal_the_released_encoder_step(ref2va, our_references, video_vaes, audio_vaes):
    _, state = ref2va
    ours_vae, _ = video_vaes
    ours_audio_vae, _ = audio_vaes
    latents = [encode_reference(reference, ours_vae, ours_audio_vae) for reference in our_references]
    image_latent, video_latent = state.get("condition_latents")
    soundtrack_rows, audio_rows = state.get("audio_condition_latents")

    assert latents[0].kind == "image" and latents[0].audio is None
    assert_same_condition(latents[0].video, image_latent[0], ours_vae)
    assert latents[1].video.shape == (24, 7, 4, 6)  # 32 frames → the 22-frame prefix → 7 latents
    assert_same_condition(latents[1].video, video_latent[0], ours_vae)
    for ours, theirs in ((latents[1], soundtrack_rows), (latents[2], audio_rows)):
        assert ours.audio_rows().shape == theirs.shape
        assert (ours.audio_rows() - theirs).abs().max() <= 1e-5
    assert latents[1].audio.shape == (2, 32, 207)  # ceil(165333 / 800)
    assert latents[2].kind == "audio" and latents[2].video is None and latents[2].audio.shape == (2, 32, 12)
    # The pipeline takes them as they are.
    assert [ref.geometry(i).kind for i, ref in enumerate(latents)] == ["image", "video", "audio"]


@pytest.mark.parametrize("fps", [12.0, 23.976, 25.0, 30.0, 59.94, 24.0])
def test_frame_rate_conversion_equals_the_released_one(fps):
    """Every frame carries its index, so the held and dropped frames are compared, not just the count."""
    count = 50
    frames = torch.arange(count, dtype=torch.uint8).view(count, 1, 1, 1).expand(count, 32, 64, 3).contiguous()
    theirs = MiniMaxH3Ref2VASetupStep._normalize_video_condition(
        frames.numpy(), fps, CLIP_FRAMES, 32, SHORT_EDGE, MAX_PIXELS, 24.0
    )
    ours = normalize_video_reference(frames, fps, frames=CLIP_FRAMES, short_edge=SHORT_EDGE, max_pixels=MAX_PIXELS)
    assert torch.equal(ours.pixels, torch.from_numpy(theirs))
    assert ours.pixels.shape[0] == min(CLIP_FRAMES, math.floor(count * 24 / fps + 0.5))


def test_a_video_reference_is_truncated_to_the_clip_on_the_frame_grid():
    frames = torch.zeros(100, 32, 32, 3)
    assert normalize_video_reference(frames, 24, frames=39).pixels.shape[0] == 39
    assert normalize_video_reference(frames, 24, frames=30).pixels.shape[0] == 39  # 30 is taken up to 17k + 5


@pytest.mark.parametrize("count, latent_frames", [(13, 2), (17, 2), (21, 7), (22, 7), (38, 7), (39, 12), (60, 17)])
def test_video_reference_latent_frames(video_vaes, count, latent_frames):
    """The largest 17k + 5 prefix is encoded; below 22 frames all of them are, the last clip padded by the
    encoder (13-17 frames are one clip, 2 latents; 18-21 two clips, 7 latents, as 22 frames)."""
    ours_vae, _ = video_vaes
    reference = normalize_video_reference(
        torch.rand(count, 32, 64, 3), 24, frames=124, short_edge=32, max_pixels=32 * 64
    )
    latents = encode_reference(reference, ours_vae)
    assert latents.video.shape == (24, latent_frames, 2, 4) and latents.audio is None


@pytest.mark.parametrize(
    "size, expected",
    [((50, 90), (64, 128)), ((90, 50), (128, 64)), ((64, 64), (64, 64)), ((20, 79), (64, 256)), ((300, 200), (96, 64))],
)
def test_image_reference_sizes(size, expected):
    assert normalize_image_reference(image(*size), short_edge=IMAGE_SHORT_EDGE).pixels.shape[:2] == expected


def test_image_reference_is_encoded_at_the_released_2048_short_edge():
    assert normalize_image_reference(image(9, 16)).pixels.shape == (2048, 3648, 3)


@pytest.mark.parametrize("samples, latents", [(1, 1), (800, 1), (801, 2), (32000, 40)])
def test_audio_reference_latent_lengths(audio_vaes, samples, latents):
    ours_audio_vae, _ = audio_vaes
    reference = normalize_audio_reference(torch.zeros(2, samples), 32000, frames=124)
    assert encode_reference(reference, audio_vae=ours_audio_vae).audio.shape == (2, 32, latents)


def test_audio_reference_encoding_follows_the_attention_overrides(audio_vaes):
    ours_audio_vae, _ = audio_vaes
    reference = normalize_audio_reference(
        torch.randn(2, 4000, generator=torch.Generator().manual_seed(4)) * 0.1, 32000, frames=124
    )
    default = encode_reference(reference, audio_vae=ours_audio_vae).audio
    math = encode_reference(reference, audio_vae=ours_audio_vae, audio_overrides={"audio_vae": "sdpa_math"}).audio
    assert (default - math).abs().max() <= 1e-5 * default.abs().max()
    with pytest.raises(H3InputError, match="unknown VAE attention backend 'warp' for audio_vae"):
        encode_reference(reference, audio_vae=ours_audio_vae, audio_overrides={"audio_vae": "warp"})


def test_audio_is_truncated_at_its_own_rate_before_resampling():
    clip = normalize_audio_reference(torch.zeros(1, 10 * 48000), 48000, frames=124).audio
    # 124 frames are 5.1667 s: 248000 samples at 48 kHz, i.e. 165333.3 at 32 kHz, taken up.
    assert clip.shape == (2, math.ceil(248000 * 2 / 3))


# ---- Pillow's LANCZOS and torchaudio's resampler -------------------------------------------------


def test_lanczos_resize_equals_pillow_bit_for_bit():
    generator = rng(11)
    for _ in range(60):
        (height, width), (new_height, new_width) = generator.randint(1, 70, 2), generator.randint(1, 70, 2)
        pixels = generator.randint(0, 256, (height, width, 3)).astype(np.uint8)
        expected = np.asarray(Image.fromarray(pixels).resize((int(new_width), int(new_height)), Image.LANCZOS))
        assert torch.equal(
            lanczos_resize(torch.from_numpy(pixels), int(new_width), int(new_height)), torch.from_numpy(expected)
        ), (height, width, new_height, new_width)


def test_lanczos_resize_of_frames_equals_each_frame_resized():
    frames = torch.from_numpy(rng(12).randint(0, 256, (3, 40, 30, 3)).astype(np.uint8))
    together = lanczos_resize(frames, 17, 64)
    assert torch.equal(together, torch.stack([lanczos_resize(frame, 17, 64) for frame in frames]))


def signal(length, rate):
    """Two tones and a chirp, deterministic and independent of any RNG."""
    t = torch.arange(length, dtype=torch.float64) / rate
    return (
        0.5 * torch.sin(2 * math.pi * 440 * t)
        + 0.3 * torch.sin(2 * math.pi * 9000 * t + 0.2)
        + 0.1 * torch.sin(2 * math.pi * (200 + 3000 * t) * t)
    ).to(torch.float32)[None]


# Outputs of torchaudio 2.11's transforms.Resample(rate, 32000) for signal(4410, rate) (computed once with it).
TORCHAUDIO_GOLDEN = {
    44100: (3200, {0: 0.0896284878, 1: 0.316736311, 37: 0.185954452, 1000: -0.115677804, 3199: -0.344852716}),
    48000: (2940, {0: 0.0928721428, 1: 0.316635519, 37: 0.185942635, 1000: -0.11565917, 2939: -0.0330115557}),
    22050: (6400, {0: 0.0643539727, 1: 0.23192133, 37: 0.171110809, 1000: -0.122996293, 6399: -0.317283839}),
}


@pytest.mark.parametrize("rate", sorted(TORCHAUDIO_GOLDEN))
def test_resampling_equals_torchaudio_golden_values(rate):
    length, samples = TORCHAUDIO_GOLDEN[rate]
    out = resample_audio(signal(4410, rate), rate, 32000)
    assert out.shape == (1, length)
    for index, value in samples.items():
        assert out[0, index].item() == pytest.approx(value, abs=1e-6), index


def test_resampling_equals_torchaudio_when_it_is_installed():
    torchaudio = pytest.importorskip("torchaudio")
    waveform = torch.randn(2, 30011, generator=torch.Generator().manual_seed(13)) * 0.3
    for rate in (8000, 16000, 22050, 24000, 44100, 48000, 96000):
        expected = torchaudio.transforms.Resample(rate, 32000)(waveform)
        assert torch.allclose(resample_audio(waveform, rate, 32000), expected, atol=1e-6, rtol=0), rate
    # and through diffusers' own normalisation, which resamples with torchaudio
    theirs = MiniMaxH3Ref2VASetupStep._normalize_audio_condition(waveform[:1], 44100, 32000, CLIP_FRAMES / 24)
    ours = normalize_audio_reference(waveform[:1], 44100, frames=CLIP_FRAMES).audio
    assert torch.allclose(ours, theirs, atol=1e-6, rtol=0)


def test_resampling_is_the_windowed_sinc_interpolation_it_claims():
    """An independent fp64 evaluation of y[j] = Σ x[i] · s · sinc(s(i − τ_j)) · hann, τ_j = j · from / to,
    s = 0.99 · min(from, to) / from (the window spans 6 zero crossings) — not the polyphase convolution."""
    rate, target = 44100, 32000
    x = signal(3000, rate)[0].double()
    out = resample_audio(x[None].float(), rate, target)[0]
    scale = 0.99 * min(rate, target) / rate
    for j in (0, 5, 777, 1500, out.shape[0] - 1):
        tau = j * rate / target
        t = ((torch.arange(x.shape[0], dtype=torch.float64) - tau) * scale).clamp(-6, 6)
        sinc = torch.where(t == 0, 1.0, torch.sin(math.pi * t) / (math.pi * t))
        weights = scale * sinc * torch.cos(math.pi * t / 12) ** 2
        assert out[j].item() == pytest.approx(float((x * weights).sum()), abs=2e-6), j


def test_resampled_length_keeps_torchaudios_fp32_rounding():
    # 320 · 500032 / 441 = 362835.0113, which fp32 holds as 362835.0: torchaudio 2.11 returns 362835 samples.
    assert resample_audio(torch.zeros(1, 500032), 44100, 32000).shape == (1, 362835)
    assert resample_audio(torch.zeros(1, 500033), 44100, 32000).shape == (1, math.ceil(320 * 500033 / 441))


# ---- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pixels, message",
    [
        (torch.rand(1, 32, 32, 3), r"the keyframe must be RGB pixels \[height, width, 3\], got shape \(1, 32, 32, 3\)"),
        (torch.rand(32, 32, 4), r"got shape \(32, 32, 4\)"),
        (
            torch.linspace(0.25, 1.75, 32 * 32 * 3).reshape(32, 32, 3),
            r"the keyframe must hold values in \[0, 1\], got values from 0\.25 to 1\.75",
        ),
        (torch.linspace(-0.5, 0.5, 32 * 32 * 3).reshape(32, 32, 3), r"got values from -0\.5 to 0\.5"),
        (torch.full((32, 32, 3), float("nan")), r"must hold values in \[0, 1\], got values from nan"),
        (torch.zeros(32, 32, 3, dtype=torch.int32), r"must be floats in \[0, 1\] or uint8, got torch.int32"),
        (np.zeros((32, 32, 3)), r"the keyframe must be a tensor \[height, width, 3\], got ndarray"),
    ],
)
def test_bad_keyframe_pixels_are_named(pixels, message):
    with pytest.raises(H3InputError, match=message):
        fit_keyframe(pixels, 32, 32)


def test_bad_keyframe_requests():
    with pytest.raises(H3InputError, match=r"keyframe fit must be one of \['stretch', 'cover'\], got 'crop'"):
        fit_keyframe(image(32, 32), 32, 32, fit="crop")
    with pytest.raises(H3InputError, match=r"width must be a multiple of 16 px .* got 40"):
        fit_keyframe(image(32, 32), 40, 32)
    with pytest.raises(H3InputError, match=r"keyframe anchor must be 'first' or 'last', got 'middle'"):
        encode_keyframes(None, (("middle", image(32, 32)),), 32, 32)
    with pytest.raises(H3InputError, match=r"each keyframe anchor may be used once, got \['first', 'first'\]"):
        encode_keyframes(None, (("first", image(32, 32)), ("first", image(32, 32))), 32, 32)


def test_bad_video_references():
    with pytest.raises(H3InputError, match=r"the video reference has no frames \(shape \(0, 32, 32, 3\)\)"):
        normalize_video_reference(torch.zeros(0, 32, 32, 3), 24, frames=124)
    with pytest.raises(
        H3InputError,
        match=r"the video reference must be RGB pixels \[frames, height, width, 3\], "
        r"got shape \(32, 32, 3\)",
    ):
        normalize_video_reference(torch.zeros(32, 32, 3), 24, frames=124)
    with pytest.raises(
        H3InputError,
        match=r"too short: 12 frames at 30 fps give 10 at 24 fps, and it needs at "
        r"least 13 \(0\.54 s\)",
    ):
        normalize_video_reference(torch.zeros(12, 32, 32, 3), 30, frames=124)
    for fps in (0, -24, float("nan"), float("inf"), "24"):
        with pytest.raises(H3InputError, match=r"the video reference's fps must be a positive number, got"):
            normalize_video_reference(torch.zeros(20, 32, 32, 3), fps, frames=124)
    with pytest.raises(H3InputError, match=r"aspect ratio from 1:4 to 4:1, got 200x40"):
        normalize_video_reference(torch.zeros(20, 40, 200, 3), 24, frames=124)
    with pytest.raises(H3InputError, match=r"soundtrack needs its sample rate; got sample_rate=None"):
        normalize_video_reference(torch.zeros(20, 32, 32, 3), 24, frames=124, audio=torch.zeros(2, 100))
    with pytest.raises(H3InputError, match=r"generated length must be a whole number of frames >= 1, got 0"):
        normalize_video_reference(torch.zeros(20, 32, 32, 3), 24, frames=0)


def test_bad_audio_references():
    with pytest.raises(H3InputError, match=r"the audio reference must be mono or stereo \(1 or 2 channels\), got 6"):
        normalize_audio_reference(torch.zeros(6, 100), 32000, frames=124)
    with pytest.raises(
        H3InputError,
        match=r"the audio reference must be a waveform \[channels, samples\], "
        r"got \(100,\)",
    ):
        normalize_audio_reference(torch.zeros(100), 32000, frames=124)
    with pytest.raises(H3InputError, match=r"the audio reference is empty \(0 samples\)"):
        normalize_audio_reference(torch.zeros(2, 0), 32000, frames=124)
    with pytest.raises(H3InputError, match=r"must be floating point samples in \[-1, 1\], got torch.int16"):
        normalize_audio_reference(torch.zeros(2, 10, dtype=torch.int16), 32000, frames=124)
    for rate in (0, -44100, 44100.5, None):
        with pytest.raises(
            H3InputError,
            match=r"the sample rate of the audio reference must be a positive whole "
            r"number of Hz, got",
        ):
            normalize_audio_reference(torch.zeros(2, 100), rate, frames=124)
    with pytest.raises(H3InputError, match=r"the sample rate of the video reference's soundtrack .* got -1"):
        normalize_video_reference(torch.zeros(20, 32, 32, 3), 24, frames=124, audio=torch.zeros(2, 10), sample_rate=-1)
    with pytest.raises(H3InputError, match=r"resampling 44101 Hz to 32000 Hz needs a 32000-phase filter"):
        resample_audio(torch.zeros(1, 10), 44101, 32000)


def test_bad_image_references_and_missing_models():
    with pytest.raises(H3InputError, match=r"the image reference must have an aspect ratio from 1:4 to 4:1, got 50x10"):
        normalize_image_reference(image(10, 50))
    with pytest.raises(H3InputError, match=r"an image reference needs the video VAE; none was given"):
        encode_reference(normalize_image_reference(image(32, 32), short_edge=32))
    with pytest.raises(H3InputError, match=r"an audio reference or a video soundtrack needs the audio VAE"):
        encode_reference(normalize_audio_reference(torch.zeros(2, 10), 32000, frames=124))


def test_quantize_rounds_like_diffusers():
    values = torch.tensor([0.0, 0.5 / 255, 1.5 / 255, 0.2, 0.5, 1.0]).view(1, 2, 3)
    expected = (values.numpy() * 255).round().astype(np.uint8)
    assert torch.equal(quantize_pixels(values, "x"), torch.from_numpy(expected))
    frames = torch.rand(5, 4, 4, 3)
    picked = quantize_pixels(frames, "x", frames=True, select=torch.tensor([4, 4, 0]))
    assert torch.equal(picked, quantize_pixels(frames, "x", frames=True)[[4, 4, 0]])


# ---- keyframes anywhere ------------------------------------------------------------------------


def test_a_still_keyframe_is_cover_cropped_and_encoded_as_a_released_follower(video_vaes):
    ours_vae, _ = video_vaes
    first, still = image(45, 45), image(20, 80, seed=3)
    (_, _), (_, released) = encode_keyframes(ours_vae, (("first", first), ("last", still)), 96, 64)
    keyframe = encode_keyframe(-1, 22, 96, 64, images=still[None], vae=ours_vae)
    assert keyframe.frame_index == 21 and keyframe.audio is None
    assert torch.equal(keyframe.video, released)


def test_a_clip_keyframe_keeps_its_17k_plus_5_first_frames(video_vaes):
    ours_vae, _ = video_vaes
    frames = torch.stack([image(40, 60, seed=s) for s in range(8)])
    keyframe = encode_keyframe(3, 22, 64, 32, images=frames, vae=ours_vae)
    cropped = torch.stack([fit_keyframe(f, 64, 32, fit="cover") for f in frames[:5]])
    expected = encode_reference(NormalizedReference("video", pixels=cropped), ours_vae).video
    assert keyframe.frame_index == 3 and keyframe.video.shape == (24, 2, 2, 4)
    assert torch.equal(keyframe.video, expected)


def test_keyframe_audio_is_encoded_whole_then_cut_to_the_room_after_its_frame(audio_vaes):
    ours_audio_vae, _ = audio_vaes
    waveform = torch.from_numpy(rng(4).uniform(-0.5, 0.5, (1, 48000)).astype(np.float32))
    keyframe = encode_keyframe(12, 22, 64, 32, waveform=waveform, sample_rate=48000, audio_vae=ours_audio_vae)
    whole = encode_reference(normalize_audio_reference(waveform, 48000, frames=39), audio_vae=ours_audio_vae).audio
    room = math.floor(37 - 5 / 3 * 12)  # the clip's 37 audio latents less the 20 before frame 12
    assert keyframe.video is None and keyframe.audio.shape == (2, 32, room)
    assert torch.equal(keyframe.audio, whole[..., :room])


def test_keyframe_encode_errors(video_vaes, audio_vaes):
    ours_vae, _ = video_vaes
    ours_audio_vae, _ = audio_vaes
    still = torch.rand(1, 32, 32, 3)
    with pytest.raises(H3InputError, match="needs images, audio or both"):
        encode_keyframe(0, 22, 64, 32)
    with pytest.raises(H3InputError, match="need the video VAE"):
        encode_keyframe(0, 22, 64, 32, images=still)
    with pytest.raises(H3InputError, match=r"frame_idx: 22 does not place a still keyframe .* nearest: 21"):
        encode_keyframe(22, 22, 64, 32, images=still, vae=ours_vae)
    with pytest.raises(H3InputError, match="audio needs the audio VAE"):
        encode_keyframe(-1, 22, 64, 32, waveform=torch.zeros(1, 800), sample_rate=32000)
    last = encode_keyframe(-1, 22, 64, 32, waveform=torch.zeros(1, 800), sample_rate=32000, audio_vae=ours_audio_vae)
    assert last.frame_index == 21 and last.audio.shape == (2, 32, 1)  # 800 samples: one latent, within the room
