"""Dense attention with log-sum-exp (h3_core.attention.kernels): the math kernel, the probe, and the
flash-attn legs driven through injected fake modules on CPU."""

import re
import sys

import pytest
import torch
from fake_flash import LEGS, LOG2_E, FakeFlash, install_fa3, install_fa4, pretend_gpu

from h3_core.attention import kernels
from h3_core.attention.kernels import KERNELS, dense_attention, force_kernel, probed_kernels
from h3_core.errors import H3BackendUnavailable, H3InputError


@pytest.fixture(autouse=True)
def _fresh_probe(monkeypatch):
    """Every test starts from an empty probe and leaves the process-wide caches as it found them."""
    monkeypatch.setattr(kernels, "_probed", {})
    monkeypatch.setattr(kernels, "_verified", set())


def randn(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def direct_attention(q, k, v, scale):
    """softmax(q k^T * scale) v and the natural-log log-sum-exp, token-major [B, T, H, D], float64."""
    q, k, v = (x.double() for x in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    peak = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - peak)
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.einsum("bhqk,bkhd->bqhd", weights / total, v)
    lse = (peak + torch.log(total)).squeeze(-1).transpose(1, 2)  # [B, Tq, H]
    return out, lse


def assert_close64(got, want, tol=1e-12):
    assert got.shape == want.shape
    err = (got.double() - want.double()).abs().max().item()
    assert err <= tol, f"max abs err {err:.3e} > {tol:.1e}"


# --- math kernel against a direct computation -----------------------------------------------------


@pytest.mark.parametrize("explicit", [False, True], ids=["probed", "kernel-math"])
def test_token_major_unbatched(explicit):
    H, D = 3, 8
    q, k, v = randn(13, H, D, seed=1), randn(29, H, D, seed=2), randn(29, H, D, seed=3)
    res = dense_attention(q, k, v, kernel="math" if explicit else None)
    want_out, want_lse = direct_attention(q[None], k[None], v[None], D**-0.5)
    assert res.out.shape == (13, H, D) and res.out.dtype == torch.float64
    assert res.lse.shape == (13, H) and res.lse.dtype == torch.float64
    assert_close64(res.out, want_out[0])
    assert_close64(res.lse, want_lse[0])


def test_token_major_batched():
    B, H, D = 2, 2, 16
    q, k, v = randn(B, 11, H, D, seed=4), randn(B, 17, H, D, seed=5), randn(B, 17, H, D, seed=6)
    res = dense_attention(q, k, v, kernel="math")
    want_out, want_lse = direct_attention(q, k, v, D**-0.5)
    assert res.out.shape == (B, 11, H, D)
    assert res.lse.shape == (B, 11, H) and res.lse.dtype == torch.float64
    assert_close64(res.out, want_out)
    assert_close64(res.lse, want_lse)


def test_head_major_unbatched():
    H, D = 3, 8
    q, k, v = randn(H, 10, D, seed=7), randn(H, 21, D, seed=8), randn(H, 21, D, seed=9)
    res = dense_attention(q, k, v, head_major=True, kernel="math")
    tm = [x.transpose(0, 1)[None] for x in (q, k, v)]
    want_out, want_lse = direct_attention(*tm, D**-0.5)
    assert res.out.shape == (H, 10, D)
    assert res.lse.shape == (H, 10)
    assert_close64(res.out, want_out[0].transpose(0, 1))
    assert_close64(res.lse, want_lse[0].transpose(0, 1))


def test_head_major_batched():
    B, H, D = 3, 2, 8
    q, k, v = randn(B, H, 9, D, seed=10), randn(B, H, 14, D, seed=11), randn(B, H, 14, D, seed=12)
    res = dense_attention(q, k, v, head_major=True, kernel="math")
    want_out, want_lse = direct_attention(*(x.transpose(1, 2) for x in (q, k, v)), D**-0.5)
    assert res.out.shape == (B, H, 9, D)
    assert res.lse.shape == (B, H, 9)
    assert_close64(res.out, want_out.transpose(1, 2))
    assert_close64(res.lse, want_lse.transpose(1, 2))


def test_scale_is_honoured():
    H, D = 2, 8
    q, k, v = randn(7, H, D, seed=13), randn(12, H, D, seed=14), randn(12, H, D, seed=15)
    res = dense_attention(q, k, v, scale=0.77, kernel="math")
    want_out, want_lse = direct_attention(q[None], k[None], v[None], 0.77)
    assert_close64(res.out, want_out[0])
    assert_close64(res.lse, want_lse[0])
    default = dense_attention(q, k, v, kernel="math")
    assert (default.lse - res.lse).abs().max() > 1e-3


def test_overlapping_strided_key_views():
    """Batch stride (in rows) smaller than the rows per batch: the views share rows of one buffer."""
    B, H, D, Tk, step = 3, 2, 8, 20, 7
    buf_k = randn(Tk + step * (B - 1), H, D, seed=16)
    buf_v = randn(Tk + step * (B - 1), H, D, seed=17)
    strides = (step * H * D, H * D, D, 1)
    k = buf_k.as_strided((B, Tk, H, D), strides)
    v = buf_v.as_strided((B, Tk, H, D), strides)
    assert k.stride(0) < k.shape[1] * k.stride(1)  # overlapping
    # q as a strided slice of a fused buffer as well
    q = randn(B, 9, 3, H, D, seed=18)[:, :, 1]
    res = dense_attention(q, k, v, kernel="math")
    want_out, want_lse = direct_attention(q.contiguous(), k.contiguous(), v.contiguous(), D**-0.5)
    assert_close64(res.out, want_out)
    assert_close64(res.lse, want_lse)
    # the inputs are untouched
    assert torch.equal(buf_k, randn(Tk + step * (B - 1), H, D, seed=16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_low_precision_dtypes(dtype):
    H, D = 2, 16
    q, k, v = (randn(12, H, D, dtype=dtype, seed=s) for s in (19, 20, 21))
    res = dense_attention(q, k, v)
    assert res.out.dtype == dtype
    assert res.lse.dtype == torch.float32
    assert res.lse.shape == (12, H)
    want_out, want_lse = direct_attention(q[None], k[None], v[None], D**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (res.out[None].double() - want_out).abs().max() < tol
    assert (res.lse[None].double() - want_lse).abs().max() < 1e-5


def test_head_major_lse_dtype_and_shape_bf16():
    q = randn(2, 3, 5, 8, dtype=torch.bfloat16, seed=22)
    res = dense_attention(q, q, q, head_major=True)
    assert res.out.shape == (2, 3, 5, 8) and res.out.dtype == torch.bfloat16
    assert res.lse.shape == (2, 3, 5) and res.lse.dtype == torch.float32


def test_zero_query_rows():
    q = randn(0, 2, 8, seed=23)
    k = randn(5, 2, 8, seed=24)
    res = dense_attention(q, k, k)
    assert res.out.shape == (0, 2, 8)
    assert res.lse.shape == (0, 2)


# --- refusals -------------------------------------------------------------------------------------


def test_unknown_kernel_lists_valid_names():
    q = randn(4, 2, 8)
    valid = re.escape(str(list(KERNELS)))
    with pytest.raises(ValueError, match=r"unknown attention kernel 'turbo'; valid kernels: " + valid):
        dense_attention(q, q, q, kernel="turbo")
    with pytest.raises(ValueError, match=r"unknown attention kernel 'turbo'.*" + valid):
        with force_kernel("turbo"):
            pass


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((4, 2, 8), (4, 2, 8), (5, 2, 8)), "k.shape == v.shape"),
        (((4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8)), "equal rank 3 or 4"),
        (((4, 8), (4, 8), (4, 8)), "equal rank 3 or 4"),
        (((4, 2, 8), (4, 3, 8), (4, 3, 8)), "must share batch, heads and head dim"),
        (((4, 2, 8), (4, 2, 16), (4, 2, 16)), "must share batch, heads and head dim"),
        (((4, 2, 8), (0, 2, 8), (0, 2, 8)), "k needs at least one row"),
    ],
    ids=["kv-shape", "rank-mix", "rank-2", "heads", "head-dim", "no-keys"],
)
def test_dense_attention_refuses_shapes(shapes, message):
    q, k, v = (randn(*s) for s in shapes)
    with pytest.raises(H3InputError, match=re.escape(message)):
        dense_attention(q, k, v)


def test_dense_attention_refuses_mixed_dtypes():
    q = randn(4, 2, 8)
    with pytest.raises(H3InputError, match="dtypes differ"):
        dense_attention(q, q.float(), q.float())


def test_forcing_cudnn_on_cpu_names_the_reason():
    q = randn(4, 2, 8, dtype=torch.bfloat16)
    with force_kernel("cudnn"):
        with pytest.raises(H3BackendUnavailable, match=r"'cudnn' cannot run on cpu.*needs a CUDA device"):
            dense_attention(q, q, q)


@pytest.mark.parametrize("name", ["fa4", "fa3", "fa2", "flash", "efficient"])
def test_explicit_gpu_kernel_on_cpu_is_unavailable(name):
    q = randn(4, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(H3BackendUnavailable, match=rf"'{name}' cannot run on cpu.*needs a CUDA device"):
        dense_attention(q, q, q, kernel=name)


def test_probe_on_cpu_picks_math():
    q = randn(6, 2, 16, dtype=torch.float32)
    dense_attention(q, q, q)
    choice = probed_kernels()[("cpu", torch.float32, 16)]
    assert choice.name == "math"
    assert [name for name, _ in choice.rejected] == [n for n in KERNELS if n != "math"]
    assert all("needs a CUDA device" in reason for _, reason in choice.rejected)
    assert kernels.resolve_kernel(torch.device("cpu"), torch.float32, 16) == "math"


# --- flash-attn legs through injected fake modules -------------------------------------------------


@pytest.mark.parametrize("leg", list(LEGS))
def test_probe_picks_injected_flash_kernel(monkeypatch, leg):
    capability, install = LEGS[leg]
    fake = FakeFlash()
    install(monkeypatch, fake)
    pretend_gpu(monkeypatch, capability)

    assert kernels.resolve_kernel(torch.device("cpu"), torch.bfloat16, 16) == leg
    choice = probed_kernels()[("cpu", torch.bfloat16, 16)]
    assert choice.name == leg
    assert [name for name, _ in choice.rejected] == list(KERNELS[: KERNELS.index(leg)])
    # the trial ran through the fake with the overlapping strided key view
    assert fake.calls, "the probe's trial never called the kernel"
    trial = fake.calls[0]
    assert trial["q"][0] == 2 and len(trial["q"]) == 4
    assert trial["k_stride"][0] < trial["k"][1] * trial["k_stride"][1]
    assert not fake.problems, fake.problems


def _through_kernel_and_math(q, k, v, **kw):
    fast = dense_attention(q, k, v, **kw)
    ref = dense_attention(q, k, v, kernel="math", **kw)
    return fast, ref


def _assert_same_attention(fast, ref):
    assert fast.out.shape == ref.out.shape and fast.out.dtype == ref.out.dtype
    assert fast.lse.shape == ref.lse.shape and fast.lse.dtype == ref.lse.dtype == torch.float32
    torch.testing.assert_close(fast.out.float(), ref.out.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(fast.lse, ref.lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
@pytest.mark.parametrize("batched", [False, True], ids=["unbatched", "batched"])
@pytest.mark.parametrize("leg", list(LEGS))
def test_dense_attention_through_injected_kernel(monkeypatch, leg, batched, head_major):
    capability, install = LEGS[leg]
    fake = FakeFlash()
    install(monkeypatch, fake)
    pretend_gpu(monkeypatch, capability)
    H, D, Tq, Tk, B = 3, 16, 11, 19, 2

    def make(rows, seed):
        shape = (H, rows, D) if head_major else (rows, H, D)
        return randn(*(((B,) + shape) if batched else shape), dtype=torch.bfloat16, seed=seed)

    q, k, v = make(Tq, 30), make(Tk, 31), make(Tk, 32)
    fast, ref = _through_kernel_and_math(q, k, v, head_major=head_major)
    assert probed_kernels()[("cpu", torch.bfloat16, D)].name == leg
    _assert_same_attention(fast, ref)
    expect_lse = (H, Tq) if head_major else (Tq, H)
    assert tuple(fast.lse.shape) == (((B,) + expect_lse) if batched else expect_lse)
    # the fake saw token-major [B, S, H, D] with a contiguous last dim
    assert fake.calls[-1]["q"] == ((B if batched else 1), Tq, H, D)
    assert fake.calls[-1]["k"] == ((B if batched else 1), Tk, H, D)
    assert not fake.problems, fake.problems


@pytest.mark.parametrize("leg", list(LEGS))
def test_injected_kernel_with_overlapping_views_and_scale(monkeypatch, leg):
    capability, install = LEGS[leg]
    fake = FakeFlash()
    install(monkeypatch, fake)
    pretend_gpu(monkeypatch, capability)
    B, H, D, Tk, step = 3, 2, 16, 24, 8
    buf = randn(Tk + step * (B - 1), H, D, dtype=torch.bfloat16, seed=33)
    kv = buf.as_strided((B, Tk, H, D), (step * H * D, H * D, D, 1))
    q = randn(B, 10, H, D, dtype=torch.bfloat16, seed=34)
    fast, ref = _through_kernel_and_math(q, kv, kv, scale=0.3)
    _assert_same_attention(fast, ref)
    assert fake.calls[-1]["scale"] == pytest.approx(0.3)
    assert not fake.problems, fake.problems


@pytest.mark.parametrize(
    "fake, reason",
    [
        (FakeFlash(lse_factor=LOG2_E), "trial disagrees with math"),
        (
            FakeFlash(fail=RuntimeError("no kernel image for this arch")),
            "trial call failed: RuntimeError: no kernel image for this arch",
        ),
    ],
    ids=["lse-in-log2", "raises"],
)
def test_probe_rejects_a_bad_kernel_and_falls_back(monkeypatch, fake, reason):
    install_fa3(monkeypatch, fake)
    pretend_gpu(monkeypatch, (9, 0))
    q, k, v = (randn(9, 2, 16, dtype=torch.bfloat16, seed=s) for s in (40, 41, 42))
    fast, ref = _through_kernel_and_math(q, k, v)
    choice = probed_kernels()[("cpu", torch.bfloat16, 16)]
    assert choice.name != "fa3"
    rejected = dict(choice.rejected)
    assert "fa3" in rejected and rejected["fa3"].startswith(reason), rejected
    if reason.startswith("trial disagrees"):
        assert "lse abs err" in rejected["fa3"]
    assert fake.calls, "the trial never ran the fake"
    # on a CPU stand-in the fused SDPA ops cannot run either, so math serves
    assert choice.name == "math"
    _assert_same_attention(fast, ref)
    with pytest.raises(H3BackendUnavailable, match=re.escape(reason)):
        dense_attention(q, k, v, kernel="fa3")


def test_missing_flash_module_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    pretend_gpu(monkeypatch, (9, 0))
    kernels.resolve_kernel(torch.device("cpu"), torch.bfloat16, 16)
    rejected = dict(probed_kernels()[("cpu", torch.bfloat16, 16)].rejected)
    assert "'flash_attn_interface' is not importable" in rejected["fa3"]
    assert "'flash_attn.cute' is not importable" in rejected["fa4"]
    assert "'flash_attn' is not importable" in rejected["fa2"]


def test_flash_legs_refuse_float32_and_old_devices(monkeypatch):
    fake = FakeFlash()
    install_fa3(monkeypatch, fake)
    pretend_gpu(monkeypatch, (9, 0))
    with pytest.raises(H3BackendUnavailable, match=r"does not take torch\.float32"):
        kernels.resolve_kernel(torch.device("cpu"), torch.float32, 16, kernel="fa3")
    pretend_gpu(monkeypatch, (8, 6))
    with pytest.raises(H3BackendUnavailable, match=r"needs compute capability >= 9\.0"):
        kernels.resolve_kernel(torch.device("cpu"), torch.bfloat16, 16, kernel="fa3")
    pretend_gpu(monkeypatch, (9, 0))
    with pytest.raises(H3BackendUnavailable, match=r"head_dim 12 must be a multiple of 8"):
        kernels.resolve_kernel(torch.device("cpu"), torch.bfloat16, 12, kernel="fa3")
    assert not fake.calls


def test_out_is_written_in_place_by_a_kernel_that_can(monkeypatch):
    fake = FakeFlash()
    install_fa4(monkeypatch, fake)
    pretend_gpu(monkeypatch, (9, 0))
    q, k, v = (randn(9, 3, 16, dtype=torch.bfloat16, seed=s) for s in (1, 2, 3))
    buffer = torch.full((12, 5, 16), float("nan"), dtype=torch.bfloat16)
    target = buffer[2:11, 1:4]  # strided rows and heads of a larger tensor
    res = dense_attention(q, k, v, out=target)
    assert res.out is target
    assert fake.calls[-1]["out"][0] == target.data_ptr()
    expected = dense_attention(q, k, v, kernel="math").out
    assert torch.equal(target, expected)
    assert buffer[:2].isnan().all() and buffer[11:].isnan().all() and buffer[:, 0].isnan().all()


def test_out_is_only_a_hint_for_kernels_that_cannot():
    q, k, v = (randn(9, 3, 16, seed=s) for s in (1, 2, 3))
    target = torch.full((9, 3, 16), -7.0, dtype=torch.float64)
    res = dense_attention(q, k, v, out=target, kernel="math")
    assert res.out is not target and (target == -7.0).all()
    assert torch.equal(res.out, dense_attention(q, k, v, kernel="math").out)


def direct_causal(q, k, v, scale):
    scores = torch.einsum("...qhd,...khd->...hqk", q, k) * scale
    scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("...hqk,...khd->...qhd", torch.softmax(scores, dim=-1), v), torch.logsumexp(scores, -1)


@pytest.mark.parametrize("batched", [False, True])
def test_math_causal_equals_masked_softmax(batched):
    shape = (2, 11, 3, 8) if batched else (11, 3, 8)
    q, k, v = (randn(*shape, seed=s) for s in (1, 2, 3))
    res = dense_attention(q, k, v, causal=True, kernel="math")
    out, lse = direct_causal(q, k, v, 8**-0.5)
    assert (res.out - out).abs().max() <= 1e-12
    assert (res.lse - lse.transpose(-1, -2)).abs().max() <= 1e-12
    # the first query sees only the first key
    assert torch.allclose(res.out[..., 0, :, :], v[..., 0, :, :])


def test_causal_needs_square_attention():
    q, k = randn(4, 2, 8), randn(6, 2, 8)
    with pytest.raises(H3InputError, match="causal attention needs as many queries as keys, got 4 and 6"):
        dense_attention(q, k, k, causal=True)


@pytest.mark.parametrize("leg", list(LEGS))
def test_injected_kernels_receive_causal(monkeypatch, leg):
    capability, install = LEGS[leg]
    fake = FakeFlash()
    install(monkeypatch, fake)
    pretend_gpu(monkeypatch, capability)
    q, k, v = (randn(2, 9, 3, 16, dtype=torch.bfloat16, seed=s) for s in (4, 5, 6))
    res = dense_attention(q, k, v, causal=True)
    assert fake.calls[-1]["causal"] is True and not fake.problems
    expected = dense_attention(q, k, v, causal=True, kernel="math")
    assert torch.equal(res.out, expected.out)
