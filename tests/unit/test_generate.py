"""One generation through the real modules on a tiny random DiT (h3_core.pipeline.generate)."""

import pytest
import torch

from h3_core.errors import H3InputError
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.pipeline.generate import generate, generate_ref2va
from h3_core.pipeline.prompt import from_conditioning
from h3_core.pipeline.request import ClipRequest, Runner


def tiny_dit(hybrid: bool = False) -> H3DiT:
    """The tiny random DiT these tests run (seeded), VDN-H3's hybrid form when ``hybrid``."""
    torch.manual_seed(0)
    model = H3DiT(
        DiTConfig(
            hidden=48,
            layers=2,
            heads=2,
            head_dim=32,
            ffn=64,
            text_dim=5120,
            freq_dim=16,
            time_hidden=24,
            time_embed=20,
            rope_freqs=4,
            hybrid=hybrid,
        )
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


@pytest.fixture(scope="module")
def dit():
    return tiny_dit()


def prompt():
    return from_conditioning(torch.randn(1, 6, 5120, generator=torch.Generator().manual_seed(3)))


def test_t2va_shapes_and_seed(dit):
    with torch.no_grad():
        video, audio = generate(dit, prompt(), ClipRequest(frames=22, width=64, height=32, steps=3, seed=7))
        again, _ = generate(dit, prompt(), ClipRequest(frames=22, width=64, height=32, steps=3, seed=7))
        other, _ = generate(dit, prompt(), ClipRequest(frames=22, width=64, height=32, steps=3, seed=8))
    assert video.shape == (24, 7, 2, 4) and audio.shape == (2, 32, 37)  # 22 frames at 24 fps = 36.7 audio latents
    assert torch.equal(video, again) and not torch.equal(video, other)
    assert torch.isfinite(video).all() and torch.isfinite(audio).all()


def test_fl2va_takes_both_keyframes(dit):
    first, last = torch.randn(24, 1, 2, 4), torch.randn(24, 1, 2, 4)
    steps = []
    with torch.no_grad():
        video, _ = generate(
            dit,
            prompt(),
            ClipRequest(frames=22, width=64, height=32, steps=2, seed=1, keyframes=(("first", first), ("last", last))),
            Runner(progress=lambda i, n: steps.append(i)),
        )
        plain, _ = generate(dit, prompt(), ClipRequest(frames=22, width=64, height=32, steps=2, seed=1))
    assert steps == [1, 2] and video.shape == plain.shape and not torch.equal(video, plain)


def test_bad_requests(dit):
    with pytest.raises(H3InputError, match="length must be 17k"):
        generate(dit, prompt(), ClipRequest(frames=20, width=64, height=32, steps=2, seed=0))
    with pytest.raises(H3InputError, match="width must be a multiple of 16"):
        generate(dit, prompt(), ClipRequest(frames=22, width=60, height=32, steps=2, seed=0))
    with pytest.raises(H3InputError, match=r"the first keyframe latent must be \[24, 1, 2, 4\].*got \(24, 1, 4, 4\)"):
        generate(
            dit,
            prompt(),
            ClipRequest(
                frames=22, width=64, height=32, steps=2, seed=0, keyframes=(("first", torch.zeros(24, 1, 4, 4)),)
            ),
        )


def test_a_request_is_checked_as_it_is_made_naming_the_choice():
    """Every choice of a ``ClipRequest`` is checked when it is made, before any model runs, each error naming the
    input, what was given and what is allowed."""
    clip = dict(frames=22, width=64, height=32, steps=2, seed=0)
    ClipRequest(**clip, compile="off", noise="comfyui", backend="decomposed", attention_precision="fp8")
    for choice, match in (
        (dict(compile="fast"), r"compile must be one of \['auto', 'off'\], got 'fast'"),
        (dict(noise="gaussian"), r"noise must be one of .*got 'gaussian'"),
        (dict(attention_precision="fp4"), r"fp4"),
        (dict(reference_audio_t=1.5), r"reference_audio_t must be in \(0, 1\].*got 1.5"),
        (dict(frames=20), r"length must be 17k \+ 5 frames"),
        (dict(height=40), r"height must be a multiple of 16"),
    ):
        with pytest.raises(H3InputError, match=match):
            ClipRequest(**{**clip, **choice})


def test_a_ref2va_request_takes_no_keyframes_or_masked_start(dit):
    latent = torch.zeros(24, 1, 2, 4)
    request = ClipRequest(frames=22, width=64, height=32, steps=1, seed=0, keyframes=(("first", latent),))
    with pytest.raises(H3InputError, match="a Ref2VA request takes no keyframes and no masked start"):
        generate_ref2va(dit, prompt(), references(), request)


def test_a_runner_changes_where_and_how_not_what(dit):
    """The same request run with and without a runner's hooks gives the same latents; the hooks see every step."""
    request = ClipRequest(frames=22, width=64, height=32, steps=2, seed=3)
    steps, packed_rows = [], []

    def before_sampling(packed):
        packed_rows.append(int(packed.positions.shape[0]))

    runner = Runner(progress=lambda step, total: steps.append((step, total)), before_sampling=before_sampling)
    with torch.no_grad():
        plain, plain_audio = generate(dit, prompt(), request)
        hooked, hooked_audio = generate(dit, prompt(), request, runner)
    assert torch.equal(plain, hooked) and torch.equal(plain_audio, hooked_audio)
    assert steps == [(1, 2), (2, 2)] and len(packed_rows) == 1 and packed_rows[0] > 0


def references(g=None):
    from h3_core.pipeline.generate import ReferenceLatents

    g = g or torch.Generator().manual_seed(11)
    return [
        ReferenceLatents("image", video=torch.randn(24, 1, 2, 2, generator=g)),
        ReferenceLatents(
            "video", video=torch.randn(24, 2, 2, 4, generator=g), audio=torch.randn(2, 32, 5, generator=g)
        ),
        ReferenceLatents("audio", audio=torch.randn(2, 32, 3, generator=g)),
    ]


def test_ref2va_without_references_is_t2va(dit):
    from h3_core.pipeline.generate import generate_ref2va

    with torch.no_grad():
        plain = generate(dit, prompt(), ClipRequest(frames=22, width=64, height=32, steps=2, seed=4))
        ref = generate_ref2va(dit, prompt(), [], ClipRequest(frames=22, width=64, height=32, steps=2, seed=4))
    assert torch.equal(plain[0], ref[0]) and torch.equal(plain[1], ref[1])


def test_ref2va_references_condition_the_clip(dit):
    from h3_core.pipeline.generate import generate_ref2va

    refs = references()
    steps = []
    with torch.no_grad():
        video, audio = generate_ref2va(
            dit,
            prompt(),
            refs,
            ClipRequest(frames=22, width=64, height=32, steps=2, seed=4),
            Runner(progress=lambda i, n: steps.append(i)),
        )
        again = generate_ref2va(dit, prompt(), refs, ClipRequest(frames=22, width=64, height=32, steps=2, seed=4))
        no_audio_ref = generate_ref2va(
            dit, prompt(), refs[:2], ClipRequest(frames=22, width=64, height=32, steps=2, seed=4)
        )
    assert steps == [1, 2] and video.shape == (24, 7, 2, 4) and audio.shape == (2, 32, 37)
    assert torch.equal(video, again[0]) and torch.equal(audio, again[1])
    # the audio reference is a clean conditioning block: it draws no noise, so only its influence differs
    assert not torch.allclose(video, no_audio_ref[0]) and torch.isfinite(video).all()


def native_audio_condition_rows(audio: torch.Tensor, aug: float, seed: int) -> torch.Tensor:
    """ComfyUI's native H3 audio condition (comfy/ldm/minimax/model.py at Comfy-Org/ComfyUI 01a56b76,
    ``pack_audio`` and ``_cond_audio_rows``), re-derived here: the latent ``[1, 32, 2, T]`` packed channel-major
    into rows ``[2 · T, 32]``, then, for a noise augmentation below 1, ``aug · rows + (1 − aug) · noise`` with the
    noise drawn in fp32 from a new CPU generator seeded ``seed + 1``."""
    latent = audio.float().unsqueeze(0)  # ours is [2, 32, T]: native's [1, 32, 2, T] is its transpose
    rows = latent.permute(0, 2, 1, 3)[0].permute(1, 2, 0).reshape(-1, 32)
    if aug < 1.0:
        generator = torch.Generator("cpu").manual_seed(seed + 1)
        rows = aug * rows + (1.0 - aug) * torch.randn(rows.shape, generator=generator, dtype=torch.float32)
    return rows


def recorded(dit, calls):
    """``dit`` recording, per evaluation, the audio rows, the timesteps and each audio row's timestep."""

    def model(*args, **kwargs):
        audio_rows, timesteps, index, audio_index = args[1], args[3], args[4], args[8]
        calls.append((audio_rows.clone(), timesteps[index[audio_index]].clone()))
        return dit(*args, **kwargs)

    return model


def test_reference_audio_is_held_clean_unless_mixed_as_native_does(dit):
    refs = references()
    run = dict(frames=22, width=64, height=32, steps=2, seed=4)
    audio_refs = [ref.audio for ref in refs if ref.audio is not None]
    n_ref = sum(2 * a.shape[-1] for a in audio_refs)
    clean_calls, mixed_calls = [], []
    with torch.no_grad():
        default = generate_ref2va(dit, prompt(), refs, ClipRequest(**run))
        clean = generate_ref2va(recorded(dit, clean_calls), prompt(), refs, ClipRequest(reference_audio_t=1.0, **run))
        mixed = generate_ref2va(recorded(dit, mixed_calls), prompt(), refs, ClipRequest(reference_audio_t=0.97, **run))
    assert torch.equal(default[0], clean[0]) and torch.equal(default[1], clean[1])
    want_clean = torch.cat([native_audio_condition_rows(a, 1.0, 4) for a in audio_refs])
    want_mixed = torch.cat([native_audio_condition_rows(a, 0.97, 4) for a in audio_refs])
    for (clean_rows, clean_t), (mixed_rows, mixed_t) in zip(clean_calls, mixed_calls):
        assert torch.equal(clean_rows[:n_ref], want_clean) and (clean_t[:n_ref] == 1.0).all()
        torch.testing.assert_close(mixed_rows[:n_ref], want_mixed, rtol=0, atol=1e-6)
        target_t = mixed_t[n_ref:]  # the generated audio rows share one timestep per evaluation
        assert (mixed_t[:n_ref] == torch.clamp(target_t[:1], min=0.97)).all()
    assert len(mixed_calls) == 2 and not torch.equal(mixed[1], clean[1])
    with pytest.raises(H3InputError, match=r"reference_audio_t must be in \(0, 1\] .*got 1\.5"):
        generate_ref2va(dit, prompt(), refs, ClipRequest(reference_audio_t=1.5, **run))


def test_ref2va_bad_references_name_the_reference(dit):
    from h3_core.pipeline.generate import ReferenceLatents, generate_ref2va

    run = dict(frames=22, width=64, height=32, steps=1, seed=0)
    with pytest.raises(H3InputError, match=r"reference 0 \(image\): an image latent has 1 frame, got 2"):
        generate_ref2va(dit, prompt(), [ReferenceLatents("image", video=torch.zeros(24, 2, 2, 2))], ClipRequest(**run))
    with pytest.raises(H3InputError, match=r"reference 1 \(audio\): an audio reference needs its audio latent"):
        generate_ref2va(dit, prompt(), [references()[0], ReferenceLatents("audio")], ClipRequest(**run))
    with pytest.raises(
        H3InputError, match=r"reference 0 \(video\): the audio latent must be \[2, 32, Ta\], got \(1, 32, 4\)"
    ):
        generate_ref2va(
            dit,
            prompt(),
            [ReferenceLatents("video", video=torch.zeros(24, 1, 2, 2), audio=torch.zeros(1, 32, 4))],
            ClipRequest(**run),
        )
    with pytest.raises(H3InputError, match=r"reference 0: kind must be 'image', 'video' or 'audio', got 'text'"):
        generate_ref2va(dit, prompt(), [ReferenceLatents("text")], ClipRequest(**run))


def test_cancel_is_checked_before_every_block_and_stops_within_an_evaluation(dit):
    calls = []

    class Cancelled(Exception):
        pass

    def check_cancel():
        calls.append(1)
        if len(calls) == 2:  # before each of the first evaluation's 2 blocks: it stops between them
            raise Cancelled

    with torch.no_grad(), pytest.raises(Cancelled):
        generate(
            dit,
            prompt(),
            ClipRequest(frames=22, width=64, height=32, steps=3, seed=7),
            Runner(check_cancel=check_cancel),
        )
    assert len(calls) == 2 and not hasattr(dit, "check_cancel")  # given with the call, never left on the model


def test_a_prompt_of_the_wrong_width_is_named(dit):
    from h3_core.pipeline.prompt import PromptEmbedding

    narrow = PromptEmbedding(torch.randn(4, 32), torch.ones(4, dtype=torch.long), features=32)
    with pytest.raises(H3InputError, match="the prompt embedding is 32 wide but this DiT reads 5120-wide text states"):
        generate(dit, narrow, ClipRequest(frames=22, width=64, height=32, steps=1, seed=0))


def test_generation_runs_whatever_the_callers_grad_state(dit):
    """A model fresh from its constructor (parameters requiring grad), called with grad enabled: the library runs
    under inference mode itself and gives the same clip as under no_grad, tracking nothing."""
    assert all(p.requires_grad for p in dit.parameters())
    with torch.enable_grad():
        video, audio = generate(dit, prompt(), ClipRequest(frames=22, width=64, height=32, steps=2, seed=7))
        ref_video, _ = generate_ref2va(
            dit, prompt(), references(), ClipRequest(frames=22, width=64, height=32, steps=2, seed=7)
        )
    with torch.no_grad():
        want, _ = generate(dit, prompt(), ClipRequest(frames=22, width=64, height=32, steps=2, seed=7))
    assert torch.equal(video, want) and not video.requires_grad and not audio.requires_grad
    assert not ref_video.requires_grad


def test_previews_are_the_middle_frames_clean_estimate(dit):
    """One preview per step, the middle latent frame's x0 estimate; the last step lands on x0, so the last preview
    is the generated latent's middle frame."""
    frames = []
    with torch.no_grad():
        video, _ = generate(
            dit,
            prompt(),
            ClipRequest(frames=22, width=64, height=32, steps=3, seed=2),
            Runner(preview=lambda step, total, frame: frames.append((step, total, frame))),
        )
        again, _ = generate(dit, prompt(), ClipRequest(frames=22, width=64, height=32, steps=3, seed=2))
    assert [(s, t) for s, t, _ in frames] == [(1, 3), (2, 3), (3, 3)]
    assert all(f.shape == (24, 1, 2, 4) and f.dtype == torch.float32 for _, _, f in frames)
    assert torch.equal(frames[-1][2], video[:, 3:4]) and torch.equal(video, again)
    assert not torch.equal(frames[0][2], frames[-1][2])
