"""VDN-H3 as a patch on the host's native H3 model: the re-derived native protocol (``native_h3_protocol``) with the
pack's block patches equals the pack's own VDN-H3 DiT with the same weights, in fp64 on the CPU, for T2VA, FL2VA
with keyframes at several frames, Ref2VA with image / video / audio references, a masked extension and an odd
latent grid."""

from dataclasses import replace

import pytest
import tiny_dit
import torch
from native_h3_protocol import (
    audio_to_rows,
    from_rows,
    native_for,
    pad_circular,
    row_mask,
    shifted_sigma,
    split_pack_state,
    to_rows,
)

from h3_core.attention import WindowSpec
from h3_core.errors import H3InputError
from h3_core.formats.vdn import BranchWeights
from h3_core.models.dit import H3DiT
from h3_core.models.hybrid import HybridContext
from h3_core.models.native_hybrid import (
    NativeHybridSettings,
    NativeVDN,
    published_layout,
    split_half_norm_rope,
)
from h3_core.pipeline.noise import row_timesteps
from h3_core.pipeline.packing import KeyframeSlot, Reference, pack_ref2va, pack_sequence

CFG = replace(tiny_dit.CFG, hybrid=True)
WINDOW = WindowSpec(1, 2, "both")
TEXT = 5
SHIFTS = (12.0, 3.0)


def native_pair(pack: H3DiT):
    """The native model holding the pack model's weights, and the branch file's tensors (as the file names them)."""
    native, branch = native_for(CFG).double(), BranchWeights(CFG).double()
    native_state, branch_state = split_pack_state(pack.state_dict())
    native.load_state_dict(native_state)
    branch.load_state_dict(branch_state)
    return native, branch


def patched_options(native, branch, backend="ref"):
    vdn = NativeVDN(native, branch, NativeHybridSettings(WINDOW, backend))
    return {"patches_replace": {"dit": {("double_block", i): vdn.block_patch(i) for i in range(CFG.layers)}}}


def compare(pack, native, branch, video, audio, text, sigma, packed, payload=None, masks=(None, None), tags=None):
    """Native model + patch against the pack's DiT: the velocities of the target video and audio."""
    payload = dict(payload or {})
    if tags is not None:
        payload["text_token_tags"] = tags
    options = patched_options(native, branch)
    timestep = torch.tensor([sigma * 1000.0], dtype=torch.float32)
    with torch.no_grad():
        out_video, out_audio = native([video, audio], timestep, text, options, payload, *masks)
    layout = options["minimax_h3_layout"]
    # within a float64 rounding: native steps its spatial axes as i · (ρ / n), the pack as numpy's linspace does
    assert (layout.position_ids - packed.positions).abs().max() <= 1e-12, "the layouts place rows differently"
    read = published_layout(layout.segments, layout.signature, (1, 2, 2)).layout
    mine = packed.layout
    assert (read.video, read.num_frames, read.frame_h, read.frame_w) == (
        mine.video,
        mine.num_frames,
        mine.frame_h,
        mine.frame_w,
    )
    assert read.global_ranges() == mine.global_ranges()

    padded = pad_circular(video)
    cond_video = native.condition_rows(
        payload, "cond_video_latents", lambda z: to_rows(z.double()), "visual_cond_noise_aug", 0.999, 0
    )
    cond_audio = native.condition_rows(
        payload, "cond_audio_latents", lambda z: audio_to_rows(z.double()), "audio_cond_noise_aug", 1.0, 1
    )
    video_rows = torch.cat([r for r in (cond_video, to_rows(padded)) if r is not None])
    audio_rows = torch.cat([r for r in (cond_audio, audio_to_rows(audio)) if r is not None])
    video_rows_t = audio_rows_t = None
    sigma_v = float(timestep[0] / 1000.0)
    t_v, t_a = 1.0 - sigma_v, 1.0 - shifted_sigma(sigma_v, *SHIFTS)
    if masks[0] is not None:
        m = row_mask(masks[0][0, 0].float(), *padded.shape[2:])
        if m is not None:
            video_rows_t = (1.0 - m * torch.tensor(1.0 - t_v, dtype=torch.float32)).clamp(max=max(t_v, 0.999))
    if masks[1] is not None:
        m = masks[1][0, 0].float().reshape(-1)
        if not bool((m >= 0.999).all()):
            audio_rows_t = (1.0 - m * (1.0 - t_a)).clamp(max=max(t_a, 1.0))
    # the pack's per-row timesteps, condition and reference rows pinned at the payload's noise augmentation
    n_cond_v, n_cond_a = video_rows.shape[0] - to_rows(padded).shape[0], audio_rows.shape[0] - audio.shape[-1] * 2
    timesteps, index = row_timesteps(
        packed, t_v, t_a, condition_audio_rows=n_cond_a, video_rows_t=video_rows_t, audio_rows_t=audio_rows_t,
        condition_video_t=max(t_v, payload.get("visual_cond_noise_aug", 0.999)),
        condition_audio_t=max(t_a, payload.get("audio_cond_noise_aug", 1.0)),
    )  # fmt: skip
    args = (video_rows, audio_rows, text[0], timesteps, index, *packed.model_inputs("cpu"))
    ctx = HybridContext(packed.layout, WINDOW, "ref", (0, text.shape[1]))
    with torch.no_grad():
        v_rows, a_rows = pack(*args, hybrid=ctx)
    want_video = to_rows(pad_circular(-out_video)) if video.shape == padded.shape else None
    if want_video is not None:
        assert (v_rows[n_cond_v:] - want_video).abs().max() <= 1e-12
    else:  # an odd grid: the native output is cropped; compare the rows of the kept latents
        full = from_rows(v_rows[n_cond_v:], *[s // p for s, p in zip(padded.shape[2:], (1, 2, 2))], 24)
        kept = full[:, :, : video.shape[2], : video.shape[3], : video.shape[4]]
        assert (kept + out_video).abs().max() <= 1e-12
    assert (a_rows[n_cond_a:] - audio_to_rows(-out_audio)).abs().max() <= 1e-12
    # the branch changed the result: the same model without the patch differs
    with torch.no_grad():
        plain_video, _ = native([video, audio], timestep, text, {}, payload, *masks)
    assert (plain_video - out_video).abs().max() > 1e-3


def latents(frames, h, w, audio_t, seed=1):
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(1, 24, frames, h, w, generator=g, dtype=torch.float64)
    audio = torch.randn(1, 32, 2, audio_t, generator=g, dtype=torch.float64)
    text = torch.randn(1, TEXT, CFG.text_dim, generator=g, dtype=torch.float64)
    return video, audio, text


@pytest.fixture(scope="module")
def models():
    pack = tiny_dit.model(hybrid=True)
    native, branch = native_pair(pack)
    return pack, native, branch


def test_t2va_equals_the_packs_own_vdn_dit(models):
    video, audio, text = latents(12, 2, 4, 7)
    packed = pack_sequence(torch.ones(TEXT, dtype=torch.long), 12, 2, 4, 7)
    compare(*models, video, audio, text, 0.6, packed)


def test_text_tag_runs_follow_the_prompts_tags(models):
    tags = torch.tensor([1, 0, 0, 1, 1])
    video, audio, text = latents(12, 2, 4, 7, seed=2)
    packed = pack_sequence(tags, 12, 2, 4, 7)
    compare(*models, video, audio, text, 0.4, packed, tags=tags)


def fl2va_request(frames_at, seed=3):
    """FL2VA with keyframes at ``frames_at`` (the second with 2 latent frames and its sound): the native latents,
    text, payload and the pack's packed sequence, fp64."""
    video, audio, text = latents(12, 2, 4, 7, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    keyframes, slots = [], []
    for n, at in enumerate(frames_at):
        vt, rt = (2, 3) if n == 1 else (1, 0)
        kf = {"resolved_frame_index": at, "latent": torch.randn(1, 24, vt, 2, 4, generator=g, dtype=torch.float64)}
        kf["audio_latent"] = torch.randn(1, 32, 2, rt, generator=g, dtype=torch.float64) if rt else None
        keyframes.append(kf)
        slots.append(KeyframeSlot(at, vt, rt))
    payload = {
        "keyframes": keyframes,
        "cond_video_latents": [k["latent"] for k in keyframes],
        "cond_audio_latents": [k["audio_latent"] for k in keyframes if k["audio_latent"] is not None],
        "seed": 5,
    }
    packed = pack_sequence(torch.ones(TEXT, dtype=torch.long), 12, 2, 4, 7, keyframes=tuple(slots))
    return video, audio, text, payload, packed


def ref2va_request(seed=6):
    """Ref2VA with an image, a video-with-sound and a sound reference, as ``fl2va_request`` gives FL2VA."""
    video, audio, text = latents(12, 2, 4, 7, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    image = torch.randn(1, 24, 1, 4, 2, generator=g, dtype=torch.float64)
    clip = torch.randn(1, 24, 3, 2, 6, generator=g, dtype=torch.float64)
    clip_sound = torch.randn(1, 32, 2, 5, generator=g, dtype=torch.float64)
    sound = torch.randn(1, 32, 2, 4, generator=g, dtype=torch.float64)
    payload = {
        "refs": [
            {"kind": "image", "latent_h": 4, "latent_w": 2, "latent_t": 1, "ref_audio_t": 0},
            {"kind": "video_audio", "latent_h": 2, "latent_w": 6, "latent_t": 3, "ref_audio_t": 5},
            {"kind": "audio", "ref_audio_t": 4},
        ],
        "cond_video_latents": [image, clip],
        "cond_audio_latents": [clip_sound, sound],
        "visual_cond_noise_aug": 1.0,
    }
    refs = [Reference("image", 1, 4, 2), Reference("video", 3, 2, 6, 5), Reference("audio", audio_latents=4)]
    packed = pack_ref2va(torch.ones(TEXT, dtype=torch.long), refs, 12, 2, 4, 7)
    return video, audio, text, payload, packed


@pytest.mark.parametrize("frames_at", [(0,), (0, 44), (9, 30, 44)], ids=["first", "first-last", "three"])
def test_fl2va_with_keyframes_at_several_frames(models, frames_at):
    video, audio, text, payload, packed = fl2va_request(frames_at)
    compare(*models, video, audio, text, 0.7, packed, payload)


def test_ref2va_with_image_video_and_audio_references(models):
    video, audio, text, payload, packed = ref2va_request()
    compare(*models, video, audio, text, 0.5, packed, payload)


def test_a_masked_extension_holds_its_rows_at_their_timesteps(models):
    video, audio, text = latents(12, 2, 4, 7, seed=8)
    mask = torch.ones(1, 1, 12, 2, 4, dtype=torch.float64)
    mask[:, :, :5] = 0.0
    mask[:, :, 5, :, :2] = 0.5
    audio_mask = torch.ones(1, 1, 2, 7, dtype=torch.float64)
    audio_mask[..., :3] = 0.0
    packed = pack_sequence(torch.ones(TEXT, dtype=torch.long), 12, 2, 4, 7)
    compare(*models, video, audio, text, 0.6, packed, masks=(mask, audio_mask))


def test_an_odd_latent_grid_under_a_mask(models):
    video, audio, text = latents(12, 3, 5, 7, seed=9)
    mask = torch.ones(1, 1, 12, 3, 5, dtype=torch.float64)
    mask[:, :, :, 2, :] = 0.0  # the last latent row held: its patch row pads by replication
    packed = pack_sequence(torch.ones(TEXT, dtype=torch.long), 12, 4, 6, 7)
    compare(*models, video, audio, text, 0.6, packed, masks=(mask, None))


def test_the_norm_and_rotation_match_the_packs_own():
    """The split-half form (native) against the pack's RMSNorm + rotate-half on the same angles, fp64."""
    from h3_core.models.block_ops import rotate_half

    g = torch.Generator().manual_seed(11)
    q, k = (torch.randn(7, 3, 16, generator=g, dtype=torch.float64) for _ in range(2))
    qw, kw = (torch.randn(16, generator=g, dtype=torch.float64) for _ in range(2))
    angles = torch.randn(7, 6, generator=g)
    full = torch.cat([angles, angles], dim=-1)
    half = 6
    c, s = torch.cos(angles), torch.sin(angles)
    table = torch.stack([c, -s, s, c], dim=-1).reshape(1, 7, 1, half, 2, 2).double()
    got_q, got_k = split_half_norm_rope(q, k, table, qw, kw, 1e-5, 12)
    for got, x, w in ((got_q, q, qw), (got_k, k, kw)):
        normed = torch.nn.functional.rms_norm(x, (16,), w, 1e-5)
        want = rotate_half(normed, full.cos().double(), full.sin().double())
        assert (got - want).abs().max() <= 1e-13


def test_a_layout_the_window_rule_cannot_place_is_refused():
    with pytest.raises(H3InputError, match="segments of kind \\['mystery'\\]"):
        published_layout([(0, 4, "text"), (4, 6, "mystery"), (6, 14, "video")], (4, 2, 2, 4, 1), (1, 2, 2))
    with pytest.raises(H3InputError, match="video segment has 6 rows"):
        published_layout([(0, 4, "text"), (4, 10, "video")], (4, 2, 2, 4, 1), (1, 2, 2))


def test_another_packs_replacement_on_the_same_blocks_keeps_running(models):
    """A replacement already on a block (another pack's) is called in turn, with the block's own arguments; the block
    it calls runs the hybrid attention, so an identity replacement leaves the result as it was, and one that changes
    the block's input changes it."""
    _, native, branch = models
    video, audio, text = latents(12, 2, 4, 7, seed=10)
    timestep = torch.tensor([600.0])
    vdn = NativeVDN(native, branch, NativeHybridSettings(WINDOW, "ref"))
    calls = []

    def passing(args, extra):
        calls.append(sorted(args))
        return extra["original_block"](args)

    def scaling(args, extra):
        return extra["original_block"]({**args, "img": args["img"] * 1.5})

    def evaluate(previous):
        replaced = {("double_block", i): vdn.block_patch(i, previous) for i in range(CFG.layers)}
        with torch.no_grad():
            return native([video, audio], timestep, text, {"patches_replace": {"dit": replaced}})

    alone, passed, scaled = evaluate(None), evaluate(passing), evaluate(scaling)
    assert len(calls) == CFG.layers and all("attention" not in names and "img" in names for names in calls)
    assert all(torch.equal(a, b) for a, b in zip(passed, alone, strict=True))
    assert (scaled[0] - alone[0]).abs().max() > 1e-3
