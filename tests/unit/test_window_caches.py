"""The decomposed plan cache and the flex block-mask cache stay bounded and hit on repeated geometry."""

import torch

from h3_core.attention import SequenceLayout, WindowSpec, window_decomposed, window_flex, window_softmax
from h3_core.attention.window_decomposed import cached_plan, plan_cache_info
from h3_core.attention.window_flex import block_mask_cache_info, cached_block_mask


def layout(frames, text=3):
    return SequenceLayout.packed(frames=frames, frame_h=1, frame_w=2, text=text, audio=1)


def qkv(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(T, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))


WIN = WindowSpec(1, 0, "both")  # not a full cover for F >= 3


def test_plan_cache_stays_bounded():
    limit = window_decomposed.MAX_CACHED_PLANS
    for frames in range(3, 3 + limit + 5):
        cached_plan(layout(frames, text=101), WIN)
        assert plan_cache_info()["size"] <= limit
    assert plan_cache_info() == {"size": limit, "max": limit}


def test_plan_cache_bounded_through_window_softmax():
    limit = window_decomposed.MAX_CACHED_PLANS
    for frames in range(3, 3 + limit + 3):
        lay = layout(frames, text=2)
        q, k, v = qkv(lay.seq_len, frames)
        window_softmax(q, k, v, lay, WIN, backend="decomposed")
        assert plan_cache_info()["size"] <= limit


def test_repeated_geometry_hits_the_plan_cache():
    first = cached_plan(layout(7, text=57), WindowSpec(1, 2, "columns"))
    # an equal geometry built afresh finds the same plan object
    assert cached_plan(layout(7, text=57), WindowSpec(1, 2, "columns")) is first


def test_plan_cache_evicts_least_recently_used(monkeypatch):
    monkeypatch.setattr(window_decomposed._plans, "maxsize", 3)
    a = cached_plan(layout(5, text=71), WIN)
    b = cached_plan(layout(6, text=71), WIN)
    cached_plan(layout(7, text=71), WIN)
    assert cached_plan(layout(5, text=71), WIN) is a  # refreshes a
    cached_plan(layout(8, text=71), WIN)  # evicts b, the least recently used
    assert plan_cache_info()["size"] == 3
    assert cached_plan(layout(5, text=71), WIN) is a
    b_again = cached_plan(layout(6, text=71), WIN)
    assert b_again is not b and b_again == b


def test_window_softmax_plans_a_geometry_once(monkeypatch):
    built = []
    real = window_decomposed.plan_decomposed

    def counting(lay, win):
        built.append((lay, win))
        return real(lay, win)

    monkeypatch.setattr(window_decomposed, "plan_decomposed", counting)
    lay = layout(9, text=83)
    q, k, v = qkv(lay.seq_len)
    first = window_softmax(q, k, v, lay, WIN, backend="decomposed")
    second = window_softmax(q, k, v, layout(9, text=83), WindowSpec(1, 0, "both"), backend="decomposed")
    assert len(built) == 1
    assert torch.equal(first, second)


def test_block_mask_cache_stays_bounded(monkeypatch):
    monkeypatch.setattr(window_flex._masks, "maxsize", 2)
    for frames in range(3, 7):
        lay = layout(frames, text=5)
        q, k, v = qkv(lay.seq_len, frames)
        window_softmax(q, k, v, lay, WIN, backend="flex")
        info = block_mask_cache_info()
        assert info["max"] == 2
        assert info["size"] <= 2


def test_repeated_geometry_hits_the_block_mask_cache(monkeypatch):
    monkeypatch.setattr(window_flex._masks, "maxsize", 2)
    built = []
    real = window_flex.build_window_block_mask

    def counting(*args, **kwargs):
        built.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(window_flex, "build_window_block_mask", counting)
    lay = layout(6, text=9)
    mask = cached_block_mask(lay, WIN, "cpu")
    assert cached_block_mask(layout(6, text=9), WindowSpec(1, 0, "both"), torch.device("cpu")) is mask
    q, k, v = qkv(lay.seq_len)
    window_softmax(q, k, v, lay, WIN, backend="flex")
    window_softmax(q, k, v, lay, WIN, backend="flex")
    assert len(built) == 1
    # a different window is a different mask
    assert cached_block_mask(lay, WindowSpec(2, 0, "both"), "cpu") is not mask
    assert len(built) == 2
