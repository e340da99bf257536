"""``host_frames.empty_frames``: large frame tensors on an anonymous mapping advised to use huge pages."""

from __future__ import annotations

import gc
import mmap
import sys
from pathlib import Path

import pytest
import torch

from h3_core.media.host_frames import HUGE_PAGE_BYTES, empty_frames
from h3_core.media.tiling import DecodeHooks, decode_tiled


def _mapping_flags(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding ``address``."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and ":" not in head[0]:
                low, high = (int(part, 16) for part in head[0].split("-"))
                if inside:
                    break
                inside = low <= address < high
            elif inside:
                fields[head[0].rstrip(":")] = head[1]
    return fields


def test_a_large_tensor_is_a_writable_mapping_that_outlives_its_maker_and_keeps_its_values():
    frames = empty_frames((5, 64, 96, 3), torch.float32)
    gc.collect()  # nothing but the tensor holds the mapping now
    assert frames.shape == (5, 64, 96, 3) and frames.dtype == torch.float32 and frames.is_contiguous()
    values = torch.rand(frames.shape)
    frames.copy_(values)
    gc.collect()
    torch.testing.assert_close(frames, values, rtol=0, atol=0)
    assert frames[2:4].clone().sum() == values[2:4].sum()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the advice is Linux's")
def test_the_mapping_is_advised_to_use_huge_pages_where_the_kernel_offers_them():
    frames = empty_frames((HUGE_PAGE_BYTES,), torch.uint8)
    frames.fill_(7)
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    chosen = setting.read_text().split("[")[1].split("]")[0] if setting.exists() else "never"
    flags = _mapping_flags(frames.data_ptr())
    assert flags, "the tensor's memory is in no mapping of this process"
    if hasattr(mmap, "MADV_HUGEPAGE") and chosen in ("always", "madvise") and "THPeligible" in flags:
        assert flags["THPeligible"] == "1"


def test_a_small_tensor_and_a_platform_without_the_advice_get_plain_memory(monkeypatch):
    small = empty_frames((4, 4, 3), torch.uint8)
    assert small.shape == (4, 4, 3) and small.untyped_storage().resizable()
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    plain = empty_frames((HUGE_PAGE_BYTES,), torch.uint8)
    assert plain.untyped_storage().resizable()  # torch.empty's own storage, not a mapping


def test_the_decode_writes_its_frames_into_such_a_tensor_and_they_equal_a_given_plain_one():
    """The decode's default output (``empty_frames``) against the same decode into a ``torch.empty`` it is given."""
    latents = torch.randn(4, 7, 8, 8, generator=torch.Generator().manual_seed(0))  # 25 frames of 128 px: 4.9 MB

    def decode(tiles):  # a stand-in decoder of the right geometry: 16 px a latent pixel, 4 frames a latent frame
        pixels = tiles[:, :3].repeat_interleave(4, dim=2)
        return pixels.repeat_interleave(16, dim=3).repeat_interleave(16, dim=4) * 0.5

    mapped = decode_tiled(decode, latents)
    assert not mapped.untyped_storage().resizable()  # the mapping, not torch.empty's storage
    given = torch.empty(mapped.shape)
    decode_tiled(decode, latents, hooks=DecodeHooks(out=given))
    torch.testing.assert_close(mapped, given, rtol=0, atol=0)
