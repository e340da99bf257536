"""The VDN-H3 hybrid attention (h3_core.models.hybrid) inside the DiT."""

import pytest
import torch

from h3_core.attention import WindowSpec, dense_attention
from h3_core.models.block_ops import rotate_half
from h3_core.models.dit import DiTConfig, H3DiT, rope_cos_sin
from h3_core.models.hybrid import HybridContext
from h3_core.pipeline.packing import pack_sequence

CFG = DiTConfig(
    hidden=24,
    layers=1,
    heads=2,
    head_dim=16,
    ffn=32,
    text_dim=20,
    freq_dim=8,
    time_hidden=12,
    time_embed=10,
    rope_freqs=2,
    hybrid=True,
)


def model(dtype=torch.float64):
    torch.manual_seed(0)
    m = H3DiT(CFG).to(dtype).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
        m.rope.inv_freq.copy_(1 / (10000 ** (torch.arange(0, 4, 2, dtype=dtype) / 4)))
    return m


def sequence(frames, text=4, audio=3, seed=0):
    packed = pack_sequence(torch.ones(text, dtype=torch.long), frames, 2, 4, audio)
    g = torch.Generator().manual_seed(seed)
    T = packed.positions.shape[0]
    x = torch.randn(T, 24, generator=g, dtype=torch.float64)
    return packed, x


def attention(m):
    return m.blocks[0].attn


def test_full_cover_is_dense_attention_gated_and_without_the_branch():
    m = model()
    packed, x = sequence(frames=4)  # chunk 5 radius 1 covers 4 frames: full cover
    rope = rope_cos_sin(packed.positions, m.rope.inv_freq)
    ctx = HybridContext(packed.layout, WindowSpec(1, 5, "both"), "ref", (0, 4))
    attn = attention(m)
    with torch.no_grad():
        got = attn(x, rope, ctx)
        T = x.shape[0]
        q, k, v = attn.qkv_proj(x).view(T, 3, 2, 16).unbind(1)
        q, k = rotate_half(attn.q_norm(q), *rope), rotate_half(attn.k_norm(k), *rope)
        dense = dense_attention(q, k, v).out * attn.softmax_gate(x)[..., None]
        want = attn.out_proj(dense.reshape(T, -1))
    assert (got - want).abs().max() <= 1e-12


def test_branch_adds_to_inner_video_rows_only():
    m = model()
    packed, x = sequence(frames=12)
    rope = rope_cos_sin(packed.positions, m.rope.inv_freq)
    ctx = HybridContext(packed.layout, WindowSpec(1, 3, "both"), "ref", (0, 4))
    attn = attention(m)
    with torch.no_grad():
        with_branch = attn(x, rope, ctx)
        saved = attn.to_out_linear.weight.clone()
        attn.to_out_linear.weight.zero_()
        without = attn(x, rope, ctx)
        attn.to_out_linear.weight.copy_(saved)
    changed = (with_branch - without).abs().amax(dim=1) > 0
    layout = packed.layout
    S = layout.tokens_per_frame
    expected = torch.zeros(x.shape[0], dtype=torch.bool)
    expected[layout.video_start + S : layout.video_stop - S] = True  # frames 1..F-2
    assert torch.equal(changed, expected)


@pytest.mark.parametrize("window", [WindowSpec(1, 3, "both"), WindowSpec(1, 0, "none"), WindowSpec(2, 2, "columns")])
def test_backends_agree_through_the_whole_model(window):
    m = model()
    packed, _ = sequence(frames=10)
    g = torch.Generator().manual_seed(1)
    args = (
        torch.randn(packed.video_index.numel(), 96, generator=g, dtype=torch.float64),
        torch.randn(packed.audio_index.numel(), 32, generator=g, dtype=torch.float64),
        torch.randn(4, 20, generator=g, dtype=torch.float64),
        torch.tensor([0.4], dtype=torch.float64),
        torch.zeros(packed.positions.shape[0], dtype=torch.long),
        packed.tags,
        packed.positions,
        packed.video_index,
        packed.audio_index,
        packed.text_index,
    )
    outs = {}
    with torch.no_grad():
        for backend in ("ref", "decomposed", "flex"):
            outs[backend] = m(*args, hybrid=HybridContext(packed.layout, window, backend, (0, 4)))
        dense = m(*args)  # no context: plain H3 attention
    for backend in ("decomposed", "flex"):
        for a, b in zip(outs[backend], outs["ref"]):
            assert (a - b).abs().max() <= 1e-10 * b.abs().max()
    assert not torch.allclose(outs["ref"][0], dense[0])


def test_generate_runs_the_hybrid_window_a_user_picks():
    from test_generate import prompt as tiny_prompt
    from test_generate import tiny_dit

    from h3_core.pipeline.generate import generate
    from h3_core.pipeline.request import ClipRequest

    m = tiny_dit(hybrid=True)
    prompt = tiny_prompt()
    narrow = WindowSpec(1, 2, "both")  # 7 latent frames: the window leaves pairs out, the branch runs
    run = dict(frames=22, width=64, height=32, steps=2, seed=5)
    with torch.no_grad():
        ref, ref_audio = generate(m, prompt, ClipRequest(**run, window=narrow, backend="ref"))
        fast, fast_audio = generate(m, prompt, ClipRequest(**run, window=narrow, backend="decomposed"))
        released, _ = generate(m, prompt, ClipRequest(**run))  # chunk 5: every frame sees every frame
    assert (fast - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert (fast_audio - ref_audio).abs().max() <= 1e-4 * ref_audio.abs().max()
    assert not torch.allclose(ref, released, atol=1e-5)
