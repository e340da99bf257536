"""The video decoder's blocks as hand-written Triton passes (h3_core.models.decoder_triton) under Triton's CPU
interpreter, against the eager halves they replace (``video_vae.EAGER_BLOCKS``): each half in fp32 and in fp16 on
random weights of a small decoder, the residual-norm pass alone, and whole tiles through ``decode_tiles``."""

import textwrap

from triton_interpreter import run_interpreted

CHECK = textwrap.dedent(
    """
    import torch
    from h3_core.models import decoder_triton as tri
    from h3_core.models.video_vae import EAGER_BLOCKS, VideoVAE, VideoVAEConfig, rope_angles, triton_decoder_blocks

    g = torch.Generator().manual_seed(0)
    cfg = VideoVAEConfig(decoder_layers=2, decoder_heads=4, decoder_head_dim=32, block_out_channels=(8,) * 6,
                         norm_groups=4)
    width = cfg.decoder_dim

    # the residual stream and its norm
    x, y = torch.randn(13, width, generator=g), torch.randn(13, width, generator=g).half()
    scale, weight = torch.randn(width, generator=g), torch.randn(width, generator=g)
    stream, normed = tri.residual_norm_triton(x, y, scale, weight, 1e-5)
    want = x + y.float() * scale
    assert (stream - want).abs().max() <= 1e-6 * want.abs().max()
    want_h = torch.nn.functional.rms_norm(want, (width,), weight, 1e-5)
    assert (normed.float() - want_h).abs().max() <= 2e-3 * want_h.abs().max() and normed.dtype == torch.float16

    block = VideoVAE(cfg).decoder.transformer_blocks[0]
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1, generator=g)
    t, h, w, suffix = 2, 4, 6, cfg.register_tokens + 1
    angles = rope_angles(t, h, w, suffix, cfg, "cpu")
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-2)):
        b = block.to(dtype)  # the released fp32 islands kept in fp32:
        b.scale1.data, b.scale2.data = b.scale1.data.float(), b.scale2.data.float()
        b.norm1.weight.data, b.norm2.weight.data = b.norm1.weight.data.float(), b.norm2.weight.data.float()
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        xs = torch.randn(2, t * h * w + suffix, width, generator=g)
        outs = []
        for blocks in (EAGER_BLOCKS, triton_decoder_blocks("cpu")):
            with torch.no_grad():
                outs.append(b(xs, cos, sin, None, blocks))
        want, got = outs
        assert got.dtype == torch.float32 and got.shape == want.shape
        err = ((got - want).abs().max() / (want - xs).abs().max()).item()  # of the block's update
        assert err <= tol, (dtype, err)

    # the blocks of a batch share one widening of its cos and sin, made by the first; another batch makes its own
    cos, sin = angles.cos(), angles.sin()
    first = tri._rope_tables(cos, sin, 2)
    assert all(a is b for a, b in zip(tri._rope_tables(cos, sin, 2), first))
    assert torch.equal(first[0], torch.cat([cos, cos], dim=-1).repeat(2, 1))
    assert torch.equal(first[1], torch.cat([sin, sin], dim=-1).repeat(2, 1))
    assert tri._rope_tables(cos, sin, 3)[0].shape[0] == 3 * cos.shape[0]
    other = angles.sin() * 2
    assert torch.equal(tri._rope_tables(cos, other, 2)[1], torch.cat([other, other], dim=-1).repeat(2, 1))
    count = len(tri._tables_of)
    del cos, first
    assert len(tri._tables_of) == count - 1  # gone with its cos tensor
    print("OK")
    """
)


def test_triton_decoder_blocks_under_interpreter_match_the_eager_blocks():
    assert run_interpreted(CHECK).split()[-1] == "OK"
