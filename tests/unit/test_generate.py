"""One generation through the real modules on a tiny random DiT (h3_core.pipeline.generate)."""

import pytest
import torch

from h3_core.errors import H3InputError
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.pipeline.generate import generate
from h3_core.pipeline.prompt import from_conditioning


@pytest.fixture(scope="module")
def dit():
    torch.manual_seed(0)
    model = H3DiT(DiTConfig(hidden=48, layers=2, heads=2, head_dim=32, ffn=64, text_dim=5120, freq_dim=16,
                            time_hidden=24, time_embed=20, rope_freqs=4)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def prompt():
    return from_conditioning(torch.randn(1, 6, 5120, generator=torch.Generator().manual_seed(3)))


def test_t2va_shapes_and_seed(dit):
    with torch.no_grad():
        video, audio = generate(dit, prompt(), frames=22, width=64, height=32, steps=3, seed=7)
        again, _ = generate(dit, prompt(), frames=22, width=64, height=32, steps=3, seed=7)
        other, _ = generate(dit, prompt(), frames=22, width=64, height=32, steps=3, seed=8)
    assert video.shape == (24, 7, 2, 4) and audio.shape == (2, 32, 37)  # 22 frames at 24 fps = 36.7 audio latents
    assert torch.equal(video, again) and not torch.equal(video, other)
    assert torch.isfinite(video).all() and torch.isfinite(audio).all()


def test_fl2va_takes_both_keyframes(dit):
    first, last = torch.randn(24, 1, 2, 4), torch.randn(24, 1, 2, 4)
    steps = []
    with torch.no_grad():
        video, _ = generate(dit, prompt(), frames=22, width=64, height=32, steps=2, seed=1,
                            keyframes=(("first", first), ("last", last)), progress=lambda i, n: steps.append(i))
        plain, _ = generate(dit, prompt(), frames=22, width=64, height=32, steps=2, seed=1)
    assert steps == [1, 2] and video.shape == plain.shape and not torch.equal(video, plain)


def test_bad_requests(dit):
    with pytest.raises(H3InputError, match="length must be 17k"):
        generate(dit, prompt(), frames=20, width=64, height=32, steps=2, seed=0)
    with pytest.raises(H3InputError, match="width must be a multiple of 32"):
        generate(dit, prompt(), frames=22, width=60, height=32, steps=2, seed=0)
    with pytest.raises(H3InputError, match=r"the first keyframe latent must be \[24, 1, 2, 4\].*got \(24, 1, 4, 4\)"):
        generate(dit, prompt(), frames=22, width=64, height=32, steps=2, seed=0,
                 keyframes=(("first", torch.zeros(24, 1, 4, 4)),))
