"""The VAE attention contract (h3_core.attention.vae): per-component backends and overrides, causality,
precision rules per device and dtype, and the cast-for-the-kernel-only path of the audio VAE."""

import pytest
import torch
from fake_flash import FakeFlash, install_fa2, install_fa3, pretend_gpu

from h3_core.attention import kernels
from h3_core.attention.vae import (
    VAE_BACKENDS,
    VAE_COMPONENTS,
    check_vae_overrides,
    resolve_vae_attention,
    vae_attention,
)
from h3_core.errors import H3BackendUnavailable, H3InputError


@pytest.fixture(autouse=True)
def _fresh_probe(monkeypatch):
    monkeypatch.setattr(kernels, "_probed", {})
    monkeypatch.setattr(kernels, "_verified", set())


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def direct(q, k, v, causal):
    """Head-major [B, H, T, D] softmax attention in float64."""
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(scores, -1), v.double())


def qkv(dtype=torch.float32, B=2, H=4, T=11, D=16):
    return tuple(randn(B, H, T, D, dtype=dtype, seed=s) for s in (1, 2, 3))


def test_names():
    assert VAE_COMPONENTS == ("video_vae", "audio_vae")
    assert {"auto", "sdpa", "sdpa_math", "flash_attn", "cudnn", "math"} <= set(VAE_BACKENDS)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"vae": "sdpa"}, r"unknown VAE attention component 'vae'; valid components: \['video_vae', 'audio_vae'\]"),
        ({"video_vae": "sage"}, r"unknown VAE attention backend 'sage' for video_vae; valid backends: \['auto'"),
    ],
)
def test_unknown_names_list_the_valid_ones(overrides, message):
    with pytest.raises(H3InputError, match=message):
        check_vae_overrides(overrides)
    q, k, v = qkv()
    with pytest.raises(H3InputError, match=message):
        vae_attention(q, k, v, component="video_vae", overrides=overrides)


def test_unknown_component_argument():
    q, k, v = qkv()
    with pytest.raises(H3InputError, match="unknown VAE attention component 'text'"):
        vae_attention(q, k, v, component="text")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_video_is_non_causal_sdpa_on_cpu(dtype):
    q, k, v = qkv(dtype)
    out = vae_attention(q, k, v, component="video_vae")
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - direct(q, k, v, causal=False)).abs().max() < tol
    assert resolve_vae_attention("video_vae", "cpu", dtype, 16).backend == "sdpa"


@pytest.mark.parametrize("backend", ["auto", "sdpa", "sdpa_math", "math"])
def test_audio_is_causal_and_keeps_fp32(backend):
    q, k, v = qkv(torch.float32)
    out = vae_attention(q, k, v, component="audio_vae", overrides={"audio_vae": backend})
    assert out.dtype == torch.float32
    assert (out.double() - direct(q, k, v, causal=True)).abs().max() < 1e-5
    assert not torch.allclose(out, vae_attention(q, k, v, component="video_vae"))


def test_audio_default_is_sdpa_in_its_own_dtype():
    choice = resolve_vae_attention("audio_vae", "cuda", torch.float32, 256)
    assert (choice.backend, choice.compute_dtype) == ("sdpa", None)


def test_overrides_are_per_component():
    q, k, v = qkv()
    overrides = {"video_vae": "math", "audio_vae": "sdpa_math"}
    video = vae_attention(q, k, v, component="video_vae", overrides=overrides)
    audio = vae_attention(q, k, v, component="audio_vae", overrides=overrides)
    assert (video.double() - direct(q, k, v, False)).abs().max() < 1e-5
    assert (audio.double() - direct(q, k, v, True)).abs().max() < 1e-5


# --- device rules, with the GPU facts injected ------------------------------------------------------


def test_video_half_precision_on_cuda_uses_the_probed_kernel(monkeypatch):
    fake = FakeFlash()
    install_fa3(monkeypatch, fake)
    pretend_gpu(monkeypatch, (9, 0))
    q, k, v = qkv(torch.bfloat16)
    choice = resolve_vae_attention("video_vae", "cpu", torch.bfloat16, 16)
    assert choice.backend == "fa3" and choice.compute_dtype is None
    out = vae_attention(q, k, v, component="video_vae")
    assert fake.calls[-1]["causal"] is False and not fake.problems
    # the kernel got token-major views of the head-major tensors
    assert fake.calls[-1]["q"] == (2, 11, 4, 16)
    assert out.dtype == torch.bfloat16
    assert (out.double() - direct(q, k, v, False)).abs().max() < 2e-2


def test_video_fp32_stays_on_sdpa_even_when_a_fused_backend_is_chosen(monkeypatch):
    install_fa3(monkeypatch, FakeFlash())
    pretend_gpu(monkeypatch, (9, 0))
    choice = resolve_vae_attention("video_vae", "cpu", torch.float32, 64, "flash_attn")
    assert choice.backend == "sdpa" and "precision" in choice.reason


@pytest.mark.parametrize("arch, expected", [("gfx950", "sdpa_math"), ("gfx942", "math")])
def test_rocm_gfx95_uses_sdpa_math(monkeypatch, arch, expected):
    pretend_gpu(monkeypatch, (9, 5), rocm=True, arch=arch)
    choice = resolve_vae_attention("video_vae", "cpu", torch.bfloat16, 64)
    # gfx942 is not special-cased: it gets the probed kernel (math here, as no fused kernel claims ROCm)
    assert choice.backend == expected


def test_mps_uses_sdpa(monkeypatch):
    monkeypatch.setattr("h3_core.attention.vae.device_facts", lambda device: kernels.DeviceFacts("mps"))
    assert resolve_vae_attention("video_vae", "cpu", torch.float16, 64, "flash_attn").backend == "sdpa"


def test_audio_fused_backend_casts_for_the_kernel_only(monkeypatch):
    fake = FakeFlash()
    install_fa2(monkeypatch, fake)
    pretend_gpu(monkeypatch, (8, 0))
    q, k, v = qkv(torch.float32)
    choice = resolve_vae_attention("audio_vae", "cpu", torch.float32, 16, "flash_attn")
    assert (choice.backend, choice.compute_dtype) == ("fa2", torch.float16)
    seen = []
    compute = fake.compute
    fake.compute = lambda q_, k_, v_, *a: (seen.append((q_.dtype, k_.dtype, v_.dtype)), compute(q_, k_, v_, *a))[1]
    out = vae_attention(q, k, v, component="audio_vae", overrides={"audio_vae": "flash_attn"})
    assert seen[-1] == (torch.float16,) * 3
    assert fake.calls[-1]["causal"] is True
    assert out.dtype == torch.float32
    assert (out.double() - direct(q, k, v, causal=True)).abs().max() < 5e-3


def test_explicit_flash_attn_without_flash_attn_says_what_is_missing(monkeypatch):
    pretend_gpu(monkeypatch, (9, 0))
    for name in ("flash_attn", "flash_attn.cute", "flash_attn_interface"):
        monkeypatch.setitem(__import__("sys").modules, name, None)
    with pytest.raises(H3BackendUnavailable, match="'flash_attn' needs flash-attn 4, 3 or 2.*not importable"):
        resolve_vae_attention("video_vae", "cpu", torch.bfloat16, 64, "flash_attn")
    with pytest.raises(H3BackendUnavailable, match="'flash_attn' needs flash-attn 4, 3 or 2"):
        resolve_vae_attention("audio_vae", "cpu", torch.float32, 64, "flash_attn")
