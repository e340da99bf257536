"""Canvases whose sides are an odd number of latents (multiples of 16 px, not of 32): the latent is padded to whole
2×2 patches for the model and cropped after, as ComfyUI's native H3 does — ``pad_to_patch_size`` in
comfy/ldm/common_dit.py (pads each axis at its end, ``mode="circular"``: the first rows and columns again), called on
the video latent by comfy/ldm/minimax/model.py ``_forward`` at Comfy-Org/ComfyUI 2c64d4aa, whose output is cropped
back to the latent's own size."""

import torch
from test_generate import prompt, tiny_dit

from h3_core.pipeline.generate import generate
from h3_core.pipeline.packing import pad_to_patch, padded_size, patchify, repad_rows, unpatchify
from h3_core.pipeline.request import ClipRequest

COMMON = dict(steps=3, seed=4)


def test_padding_repeats_the_first_rows_and_columns_at_the_end():
    x = torch.randn(24, 7, 3, 5)
    padded = pad_to_patch(x)
    assert padded.shape == (24, 7, 4, 6) and padded_size(3, 5) == (4, 6)
    assert torch.equal(padded[:, :, :3, :5], x)
    assert torch.equal(padded[:, :, 3, :5], x[:, :, 0, :])  # the row after the last is the first
    assert torch.equal(padded[:, :, :3, 5], x[:, :, :, 0])  # the column after the last is the first
    assert torch.equal(padded[:, :, 3, 5], x[:, :, 0, 0])
    even = torch.randn(24, 7, 2, 4)
    assert pad_to_patch(even) is even


def test_rows_get_their_padding_made_again_from_the_latent_they_hold():
    x = torch.randn(24, 2, 3, 5)
    drifted = patchify(pad_to_patch(x)) + 0.0
    drifted_latent = unpatchify(drifted, 24, 2, 4, 6)
    drifted_latent[:, :, 3, :] += 1.0  # the padding moved away from the latent
    repadded = unpatchify(repad_rows(patchify(drifted_latent), 2, 3, 5), 24, 2, 4, 6)
    assert torch.equal(repadded, pad_to_patch(x))


def test_an_odd_canvas_runs_with_the_padding_made_from_the_state_at_every_evaluation():
    dit = tiny_dit()
    seen = []
    real = dit.forward

    def watching(video_rows, *args, **kwargs):
        seen.append(video_rows.detach().float().clone())
        return real(video_rows, *args, **kwargs)

    dit.forward = watching
    try:
        video, audio = generate(dit, prompt(), ClipRequest(frames=22, width=48, height=48, **COMMON))  # 3 x 3 latents
    finally:
        del dit.forward
    assert video.shape == (24, 7, 3, 3) and torch.isfinite(video).all() and torch.isfinite(audio).all()
    assert len(seen) == COMMON["steps"]
    for rows in seen:  # T2VA: every video row is the target's, on the 4 x 4 padded grid
        latent = unpatchify(rows, 24, 7, 4, 4)
        assert torch.equal(latent[:, :, 3, :], latent[:, :, 0, :]) and torch.equal(
            latent[:, :, :, 3], latent[:, :, :, 0]
        )
