"""The host arena: whole pages starting on a page boundary, writable through typed views, pinned only on a GPU."""

import mmap

import torch

from h3_core.models.host_arena import HostArena


def test_the_arena_is_whole_pages_from_a_page_boundary():
    arena = HostArena(3 * mmap.PAGESIZE + 5, "test")
    assert arena.bytes.numel() == 4 * mmap.PAGESIZE and arena.bytes.dtype == torch.uint8
    assert arena.bytes.untyped_storage().data_ptr() % mmap.PAGESIZE == 0
    assert not arena.pinned


def test_typed_views_write_through_and_outlive_the_handle():
    arena = HostArena(1024, "test")
    view = arena.bytes[512:520].view(torch.bfloat16)
    view.copy_(torch.tensor([1.5, -2.0, 3.25, 0.0], dtype=torch.bfloat16))
    del arena
    assert view.tolist() == [1.5, -2.0, 3.25, 0.0]


def test_an_empty_arena_is_empty():
    arena = HostArena(0, "test")
    assert arena.bytes.numel() == 0
    arena.release()
    assert not arena.pinned
