"""A tiny DiT in fp64 and one packed request for it: the model the exactness tests of the lower-memory and
fused paths compare against itself."""

import torch

from h3_core.attention import WindowSpec
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.models.fp8_linear import quantize_linears
from h3_core.models.hybrid import HybridContext
from h3_core.pipeline.packing import pack_sequence

CFG = DiTConfig(
    hidden=24,
    layers=2,
    heads=3,
    head_dim=16,
    ffn=40,
    text_dim=20,
    freq_dim=8,
    time_hidden=12,
    time_embed=10,
    rope_freqs=2,
)


def model(hybrid: bool):
    torch.manual_seed(0)
    m = H3DiT(DiTConfig(**{**CFG.__dict__, "hybrid": hybrid})).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
        m.rope.inv_freq.copy_(1 / (10000 ** (torch.arange(0, 4, 2, dtype=torch.float64) / 4)))
    return m


def request(frames=12, text=4, audio=5):
    packed = pack_sequence(torch.ones(text, dtype=torch.long), frames, 2, 4, audio)
    g = torch.Generator().manual_seed(1)
    args = (
        torch.randn(packed.video_index.numel(), 96, generator=g, dtype=torch.float64),
        torch.randn(packed.audio_index.numel(), 32, generator=g, dtype=torch.float64),
        torch.randn(text, 20, generator=g, dtype=torch.float64),
        torch.tensor([0.3, 0.999], dtype=torch.float64),
        (torch.arange(packed.positions.shape[0]) % 2),
        packed.tags,
        packed.positions,
        packed.video_index,
        packed.audio_index,
        packed.text_index,
    )
    return packed, args


def fp32_case(hybrid: bool, fp8: bool = True):
    """The tiny model in fp32 (with fp8 linears when ``fp8``), the request's inputs in fp32, and (hybrid) its
    window context."""
    m = model(hybrid).float()
    if fp8:
        quantize_linears(m, compute_dtype=torch.float32)
    packed, args = request()
    args = tuple(a.float() if a.is_floating_point() else a for a in args)
    ctx = HybridContext(packed.layout, WindowSpec(1, 3, "both"), "ref", (0, 4)) if hybrid else None
    return m, args, ctx


def ranks_model():
    """A tiny VDN-H3 model in fp32 with 4 heads (enough for 4 ranks), seeded: the clip the tests across ranks
    sample."""
    from h3_core.models.dit import DiTConfig, H3DiT

    cfg = DiTConfig(
        hidden=32, layers=2, heads=4, head_dim=16, ffn=48, text_dim=20, freq_dim=8, time_hidden=12, time_embed=10,
        rope_freqs=2, hybrid=True,
    )  # fmt: skip
    torch.manual_seed(9)
    m = H3DiT(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    return m


def ranks_clip(model=None, steps=2, **options):
    """``ranks_model``'s clip (22 frames at 64×32, a window that leaves frames to the linear branch) through
    ``generate`` with ``options`` (``ranks``, ``check_cancel``)."""
    from h3_core.pipeline.generate import generate
    from h3_core.pipeline.prompt import PromptEmbedding
    from h3_core.pipeline.request import ClipRequest, Runner

    g = torch.Generator().manual_seed(10)
    prompt = PromptEmbedding(torch.randn(4, 20, generator=g), torch.ones(4, dtype=torch.long), features=20)
    request = ClipRequest(
        frames=22, width=64, height=32, steps=steps, seed=3, window=WindowSpec(1, 1, "both"), compile="off"
    )
    return generate(ranks_model() if model is None else model, prompt, request, Runner(**options))
