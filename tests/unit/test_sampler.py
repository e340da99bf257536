"""The denoising loop (h3_core.pipeline.sampler): conditioning rows held, both schedules stepped as the
released loop steps them, and a closed-form trajectory."""

import pytest
import torch

from h3_core.pipeline.packing import pack_sequence
from h3_core.pipeline.request import ClipRequest, Runner
from h3_core.pipeline.sampler import SequenceRows, denoise

diffusers = pytest.importorskip("diffusers")


def setup(keyframes=("first",)):
    packed = pack_sequence(torch.ones(4, dtype=torch.long), 7, 4, 4, 9, keyframes=keyframes)
    g = torch.Generator().manual_seed(0)
    video = torch.randn(packed.video_index.numel(), 96, generator=g)
    audio = torch.randn(packed.audio_index.numel(), 32, generator=g)
    return packed, video, audio


def clip(steps):
    """A request of ``steps`` steps (its geometry is not what the loop reads: the packed sequence is)."""
    return ClipRequest(frames=124, width=64, height=64, steps=steps, seed=0)


def test_exact_velocity_lands_on_the_targets_and_keeps_the_anchor():
    packed, video, audio = setup()
    g = torch.Generator().manual_seed(1)
    video_target, audio_target = torch.randn(video.shape, generator=g), torch.randn(audio.shape, generator=g)
    seen = []

    def model(v, a, text, timesteps, index, tags, positions, vi, ai, ti):
        t_video = timesteps[index[vi]][:, None]
        t_audio = timesteps[index[ai]][:, None]
        seen.append(sorted(set(timesteps.tolist())))
        return (video_target - v) / (1 - t_video).clamp(min=1e-6), (audio_target - a) / (1 - t_audio)

    rows = SequenceRows(torch.zeros(4, 40), video.double(), audio.double())
    out_video, out_audio = denoise(model, packed, rows, clip(8))
    cond = packed.condition_rows
    assert torch.equal(out_video[:cond], video[:cond].double())  # the keyframe rows never move
    assert torch.allclose(out_video[cond:], video_target[cond:].double(), atol=1e-5)
    assert torch.allclose(out_audio, audio_target.double(), atol=1e-5)
    assert len(seen) == 8 and all(0.999 <= max(s) <= 1.0 for s in seen)


def test_steps_match_the_released_loop():
    packed, video, audio = setup()
    velocities = [(torch.randn(video.shape), torch.randn(audio.shape)) for _ in range(6)]
    calls = []

    def model(v, a, *rest):
        calls.append(len(calls))
        return velocities[len(calls) - 1]

    ours = denoise(model, packed, SequenceRows(torch.zeros(4, 40), video, audio), clip(6))
    sv, sa = diffusers.MiniMaxH3Scheduler(12.0), diffusers.MiniMaxH3Scheduler(3.0)
    sv.set_timesteps(7), sa.set_timesteps(7)
    v, a = video.clone(), audio.clone()
    cond = packed.condition_rows
    for i, t in enumerate(sv.timesteps):
        v[cond:] = sv.step(velocities[i][0][cond:].float(), t, v[cond:], return_dict=False)[0]
        a[:] = sa.step(velocities[i][1].float(), sa.timesteps[i], a, return_dict=False)[0]
    assert torch.equal(ours[0], v) and torch.equal(ours[1], a)


def test_progress_and_cancel():
    packed, video, audio = setup(())
    zero = lambda v, a, *rest: (torch.zeros_like(v), torch.zeros_like(a))  # noqa: E731
    steps = []
    rows = SequenceRows(torch.zeros(4, 40), video, audio)
    denoise(zero, packed, rows, clip(4), Runner(progress=lambda i, n: steps.append((i, n))))
    assert steps == [(1, 4), (2, 4), (3, 4), (4, 4)]
    count = []

    def cancel():
        if len(count) == 2:
            raise KeyboardInterrupt

    def counting(v, a, *rest):
        count.append(1)
        return zero(v, a)

    with pytest.raises(KeyboardInterrupt):
        denoise(counting, packed, rows, clip(4), Runner(check_cancel=cancel))
    assert len(count) == 2
