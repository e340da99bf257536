"""Ulysses sequence parallelism on the CPU (h3_core.parallel): ranks spawned here, joined by torch.distributed's gloo
backend. The row↔head all-to-all against slicing one tensor all ranks build alike — uneven rows (a remainder, an
empty last shard) and uneven heads included —, an H3 attention, a whole dense DiT block and a whole dense DiT
evaluation (T2VA, FL2VA and Ref2VA layouts) run on row shards against the single process's forward of the same
module in fp64 — dense H3 and VDN-H3 (its window softmax and linear branch on whole sequences of a rank's heads, or
split between softmax ranks and branch ranks) — and the sampler's loop across the ranks,
and the video decoder's tile batches shared among the ranks against the one-rank decode."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rank_checks import decode_check

from h3_core.errors import H3InputError
from h3_core.parallel import (
    SequenceShards,
    balanced_splits,
    head_ranges,
    heads_to_rows,
    row_shards,
    rows_to_heads,
    ulysses_attention,
)


def test_rows_and_heads_are_shared_as_the_published_split_shares_them():
    assert balanced_splits(56, 6) == [10, 10, 9, 9, 9, 9] and balanced_splits(56, 2) == [28, 28]
    assert balanced_splits(56, 3) == [19, 19, 18]
    assert head_ranges([3, 2]) == [slice(0, 3), slice(3, 5)]
    assert row_shards(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert row_shards(9, 4) == [(0, 3), (3, 6), (6, 9), (9, 9)]  # the last shard empty
    with pytest.raises(H3InputError, match="2 heads cannot be shared by 3 ranks"):
        balanced_splits(2, 3)


def _join(rank, world, store):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _worker(rank, world, store, rows_total, heads_total):
    _join(rank, world, store)
    try:
        _exchange_check(rank, world, rows_total, heads_total)
        _attention_check(rank, world, heads_total)
        _block_check(rank, world, heads_total)
        _model_check(rank, world, heads_total)
        _model_check(rank, world, heads_total, hybrid=True)
        for softmax_ranks in range(max(1, world // 2), world):  # 1 + 1 on 2 ranks; 2 + 2 and 3 + 1 on 4
            _model_check(rank, world, heads_total, hybrid=True, softmax_ranks=softmax_ranks)
        _model_check(rank, world, heads_total, hybrid=True, softmax_ranks=world - 1, dtype=torch.float32)
        _generate_check(rank, world)
        decode_check(torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def _exchange_check(rank, world, rows_total, heads_total):
    everything = torch.randn(rows_total, heads_total, 5, generator=torch.Generator().manual_seed(7))
    rows = row_shards(rows_total, world)
    heads = head_ranges(balanced_splits(heads_total, world))
    start, stop = rows[rank]
    mine = rows_to_heads(everything[start:stop], rows, heads)
    assert torch.equal(mine, everything[:, heads[rank]]), rank
    back = heads_to_rows(mine, rows, heads)
    assert torch.equal(back, everything[start:stop]), rank


def _attention_check(rank, world, heads_total):
    from h3_core.models.dit import Attention, DiTConfig

    cfg = DiTConfig(hidden=48, heads=heads_total, head_dim=16, layers=1, ffn=64)
    torch.manual_seed(0)
    attn = Attention(cfg).double().eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(23, cfg.hidden, generator=g, dtype=torch.float64)
    angles = torch.randn(23, 4, generator=g, dtype=torch.float64)
    rope = (torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin())
    with torch.no_grad():
        whole = attn(x, rope)  # the single process's forward
        rows = row_shards(x.shape[0], world)
        heads = head_ranges(balanced_splits(heads_total, world))
        start, stop = rows[rank]
        part = ulysses_attention(attn, x[start:stop], tuple(r[start:stop] for r in rope), rows, heads)
    err = float((part - whole[start:stop]).abs().max() / whole.abs().max())
    assert err <= 1e-12, (rank, err)


def _block_check(rank, world, heads_total):
    """A dense DiT block (AdaLN, norms, FFN row by row; its attention on row shards) on a packed T2VA sequence."""
    from h3_core.models.dit import Block, DiTConfig, rope_cos_sin, rope_inv_freq
    from h3_core.pipeline.packing import pack_sequence

    cfg = DiTConfig(hidden=48, heads=heads_total, head_dim=16, layers=1, ffn=64, time_embed=16, rope_freqs=2)
    torch.manual_seed(2)
    block = Block(cfg).double().eval()
    packed = pack_sequence(torch.ones(5, dtype=torch.long), 3, 4, 6, 4)
    T = packed.positions.shape[0]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, cfg.hidden, generator=g, dtype=torch.float64)
    temb = torch.randn(1, cfg.time_embed, generator=g, dtype=torch.float64)
    rope = tuple(r.double() for r in rope_cos_sin(packed.positions, rope_inv_freq(cfg)))
    shards = SequenceShards.of(T, heads_total)
    mine = shards.mine
    with torch.no_grad():
        whole = block(x.clone(), temb, packed.tags, rope)
        part = block(x[mine].clone(), temb, packed.tags[mine], tuple(r[mine] for r in rope), shards)
    err = float((part - whole[mine]).abs().max() / whole.abs().max())
    assert err <= 1e-12, (rank, err)


def _model_check(rank, world, heads_total, hybrid=False, softmax_ranks=0, dtype=torch.float64):
    """A whole DiT evaluation with its blocks on row shards (``hybrid=SequenceShards``) against the single
    process's, for the T2VA, FL2VA (a first and a last keyframe) and Ref2VA (an image and a video reference with
    its soundtrack) layouts: every rank returns the whole velocity. ``hybrid``: VDN-H3, its window softmax and
    linear branch (text state included) on whole sequences of the rank's heads; with ``softmax_ranks`` = n, the
    branch split: the softmax on the first n ranks, the branch on the others. In fp32 the same to rounding."""
    from h3_core.attention import WindowSpec
    from h3_core.models.dit import DiTConfig, H3DiT
    from h3_core.models.hybrid import HybridContext
    from h3_core.pipeline.packing import Reference, pack_ref2va, pack_sequence

    cfg = DiTConfig(
        hidden=24, layers=2, heads=heads_total, head_dim=16, ffn=40, text_dim=20, freq_dim=8, time_hidden=12,
        time_embed=10, rope_freqs=2, hybrid=hybrid,
    )  # fmt: skip
    torch.manual_seed(6)
    model = H3DiT(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        model.rope.inv_freq.copy_(1 / (10000 ** (torch.arange(0, 4, 2, dtype=torch.float64) / 4)))
    model = model.to(dtype)
    text = torch.ones(4, dtype=torch.long)
    frames = 9 if hybrid else 3  # the window (1 chunk of 2 either side) leaves frames to the branch
    layouts = {
        "T2VA": pack_sequence(text, frames, 2, 4, 3),
        "FL2VA": pack_sequence(text, frames, 2, 4, 3, keyframes=("first", "last")),
        "Ref2VA": pack_ref2va(text, [Reference("image", 0, 2, 4), Reference("video", 2, 2, 2, 2)], frames, 2, 4, 3),
    }
    g = torch.Generator().manual_seed(8)
    for name, packed in layouts.items():
        T = packed.positions.shape[0]
        args = (
            torch.randn(packed.video_index.numel(), 96, generator=g, dtype=dtype),
            torch.randn(packed.audio_index.numel(), 32, generator=g, dtype=dtype),
            torch.randn(4, 20, generator=g, dtype=dtype),
            torch.tensor([0.3, 0.999], dtype=dtype),
            torch.arange(T) % 2,
            *packed.model_inputs("cpu"),
        )
        ctx = HybridContext(packed.layout, WindowSpec(1, 2, "both"), "ref", (0, 4)) if hybrid else None
        with torch.no_grad():
            whole = model(*args, hybrid=ctx)
            shards = SequenceShards.of(T, heads_total, inner=ctx, softmax_ranks=softmax_ranks)
            part = model(*args, hybrid=shards)
        for a, b in zip(part, whole):
            err = float((a - b).abs().max() / b.abs().max())
            bound = 1e-12 if dtype == torch.float64 else 1e-5
            assert a.shape == b.shape and err <= bound, (rank, name, softmax_ranks, dtype, err)


def _generate_check(rank, world):
    """The whole sampler loop with every evaluation across the ranks (``generate(..., Runner(ranks=RankGroup()))``,
    VDN-H3 with the branch on, in fp32) gives every rank the single process's latents, to rounding; so does the
    branch split."""
    from tiny_dit import ranks_clip, ranks_model

    from h3_core.parallel import RankGroup

    model = ranks_model()
    alone = ranks_clip(model)
    for softmax_ranks in (0, world - 1):
        shared = ranks_clip(model, ranks=RankGroup(softmax_ranks=softmax_ranks))
        for a, b in zip(shared, alone):
            err = float((a - b).abs().max() / b.abs().max())
            assert err <= 1e-5, (rank, softmax_ranks, err)


# 2 ranks with 7 heads (4 + 3) and an odd row count; 4 ranks (7 heads: 2, 2, 2, 1) whose last row shard is empty
@pytest.mark.parametrize("world, rows_total, heads_total", [(2, 11, 7), (4, 9, 7)])
def test_the_exchanges_are_slices_of_one_tensor_and_an_attention_on_row_shards_is_the_single_process_one(
    tmp_path, world, rows_total, heads_total
):
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), rows_total, heads_total), nprocs=world)
