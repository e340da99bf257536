"""Block offload for the DiT: the blocks' weights live in host memory and each streamed block is copied to the
device just before it runs, a few blocks ahead on a side CUDA stream, so a card that cannot hold the weights
(66 GiB in bf16, reference/vdn_h3.md §7) still runs the model.

Modes, by ``resident_blocks`` of a model with ``L`` blocks: ``L`` keeps every block on the device (nothing
streams); ``k`` keeps blocks ``0..k−1`` on the device and streams ``k..L−1``; ``0`` streams every block.
Everything outside ``model.blocks`` (the embeddings, the token refiner, the final layer) stays on the device.

Memory. Device: the non-block parts, the resident blocks and a pool of ``prefetch + 1`` slots, each the size of
the largest streamed block's image. Host: one arena with every streamed block's image, page-locked on a GPU.

A block's image is its parameters and buffers laid end to end, each at a 512-byte offset, byte for byte as
stored: e4m3 codes, fp32 scales and bf16 matrices side by side. One copy moves a whole image into a slot; each
tensor of the block is then a view of its bytes, reinterpreted with ``.view(dtype).view(shape)``, so dtypes and
shapes are kept per tensor and nothing is allocated per block. Between its runs a streamed block's tensors are
views of its image in the host arena: ``state_dict()`` reads them there, and in-place edits (a LoRA merge) are
picked up by the next evaluation, which copies every streamed block afresh.

The schedule is driven by forward hooks on the blocks (``dit.py`` is unchanged): block 0's pre-hook starts an
evaluation and fills every slot with the first streamed blocks; a streamed block's pre-hook makes the compute
stream wait for its copy, points its tensors at its slot and starts the copies of the next ``prefetch`` blocks;
its post-hook marks the slot free and points the tensors back at the host image.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import H3InputError
from ..models.host_arena import HostArena, aligned

__all__ = ["BlockOffload", "OffloadStats", "offload_blocks", "block_image_bytes"]

_MARK = "_h3_block_offload"  # the model attribute that holds its handle while it is offloaded


@dataclass(frozen=True)
class OffloadStats:
    """Where ``offload_blocks`` put the weights, in bytes of tensor storage."""

    blocks: int
    resident_blocks: int
    streamed_blocks: int
    resident_bytes: int  # weights kept on the device: everything but the streamed blocks
    streamed_bytes: int  # weights of the streamed blocks, each read from host memory once per evaluation
    copied_bytes: int  # bytes copied to the device per evaluation: the streamed images, alignment gaps included
    slot_bytes: int  # the device slot pool: min(prefetch + 1, streamed blocks) × the largest image
    host_bytes: int  # the host arena holding the images (whole pages)
    pinned: bool  # the arena is page-locked, so copies run asynchronously (a GPU device only)


@dataclass(frozen=True, eq=False)
class _Place:
    """One tensor of a streamed block: its owner, its name there, and where its bytes sit in the block's image."""

    module: nn.Module
    name: str
    parameter: nn.Parameter | None  # the Parameter object (its storage is swapped), None for a buffer
    dtype: torch.dtype
    shape: torch.Size
    offset: int
    nbytes: int


def offload_blocks(model: nn.Module, *, device, resident_blocks: int, prefetch: int = 1) -> BlockOffload:
    """Keep the first ``resident_blocks`` of ``model.blocks`` and everything outside the blocks on ``device``,
    and stream the other blocks from (pinned) host memory, ``prefetch`` blocks ahead of the one running.

    Swap modules (``quantize_linears``) before offloading: the handle keeps the parameters and buffers it found.
    In-place edits of their values (a LoRA merge) are fine between evaluations. ``remove()`` on the returned
    handle makes the model plain again.

    Args:
        model: an ``H3DiT`` (any module whose transformer blocks are a non-empty ``nn.ModuleList`` ``blocks``).
        device: where the model runs ("cuda", "cuda:1", "cpu"; on the CPU copies are plain copies, no streams).
        resident_blocks: 0 to ``len(model.blocks)``; blocks ``0..resident_blocks−1`` stay on the device.
        prefetch: blocks copied ahead of the one running, at least 1. Default: 1 (double buffering).
    Returns:
        The ``BlockOffload`` handle: ``stats``, ``slots``, ``copies``, ``remove()``.
    """
    blocks, device = _checked(model, device, resident_blocks, prefetch)
    return BlockOffload(model, blocks, device, resident_blocks, prefetch)


def _checked(model, device, resident_blocks, prefetch) -> tuple[nn.ModuleList, torch.device]:
    """Refuse what cannot be offloaded before anything is moved, naming the argument and what is allowed."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(model, nn.Module) or not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        found = (
            "no `blocks`"
            if blocks is None
            else "an empty `blocks` list"
            if isinstance(blocks, nn.ModuleList)
            else f"`blocks` of type {type(blocks).__name__}"
        )
        raise H3InputError(
            f"model must hold its transformer blocks in a non-empty nn.ModuleList `blocks` (an "
            f"H3DiT), got a {type(model).__name__} with {found}"
        )
    if getattr(model, _MARK, None) is not None:
        raise H3InputError(
            "model is already offloaded: call remove() on the handle offload_blocks returned before offloading it again"
        )
    packed = sorted({type(p.data).__name__ for p in blocks.parameters() if type(p.data) is not torch.Tensor})
    if packed:
        raise H3InputError(
            f"the blocks hold weights of a packed type ({', '.join(packed)}: comfy-kitchen layers kept "
            "quantised), whose bytes cannot be streamed as an image; keep them resident, or load the "
            "file dequantised"
        )
    count = len(blocks)
    if isinstance(resident_blocks, bool) or not isinstance(resident_blocks, int) or not 0 <= resident_blocks <= count:
        raise H3InputError(
            f"resident_blocks must be an integer from 0 (stream every block) to {count} (keep all "
            f"{count} blocks on the device), got {resident_blocks!r}"
        )
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise H3InputError(
            f"prefetch must be an integer of at least 1 (the blocks copied ahead of the one running), got {prefetch!r}"
        )
    return blocks, _device(device, "device")


def _device(device, argument: str) -> torch.device:
    """``device`` as a torch.device with its index filled in (streams and events need a definite GPU)."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise H3InputError(
            f"{argument} must be a torch device such as 'cuda', 'cuda:1' or 'cpu', got {device!r}"
        ) from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise H3InputError(
                f"{argument} {device!r} needs CUDA, which is not available here "
                f"(torch.cuda.is_available() is False); use 'cpu'"
            )
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _stays_on_host(module: nn.Module) -> bool:
    """Modules marked ``stays_on_host`` (the AdaLN projections under ``keep_adaln_on_host``) are neither streamed
    nor moved: the evaluation does not read them."""
    return bool(getattr(module, "stays_on_host", False))


def _streamed_modules(block: nn.Module):
    """``block`` and its submodules, less those that stay on the host and everything inside them."""
    if _stays_on_host(block):
        return
    yield block
    for child in block.children():
        yield from _streamed_modules(child)


def _block_layout(block: nn.Module) -> tuple[list[_Place], list[torch.Tensor], int]:
    """The image of ``block``: a place per parameter and buffer, the tensors as they are now, and the image size.
    A tensor two modules share gets one place per owner (each owner is repointed) but one copy of its bytes."""
    places, tensors, offsets, size = [], [], {}, 0
    for module in _streamed_modules(block):
        owned = [(name, p, True) for name, p in module.named_parameters(recurse=False)]
        owned += [(name, b, False) for name, b in module.named_buffers(recurse=False)]
        for name, tensor, is_parameter in owned:
            nbytes = tensor.numel() * tensor.element_size()
            if id(tensor) not in offsets:
                offsets[id(tensor)] = size
                size = aligned(size + nbytes)  # see host_arena.ALIGN: the resident kernels, bit for bit
            places.append(
                _Place(
                    module,
                    name,
                    tensor if is_parameter else None,
                    tensor.dtype,
                    tensor.shape,
                    offsets[id(tensor)],
                    nbytes,
                )
            )
            tensors.append(tensor)
    return places, tensors, size


def block_image_bytes(block: nn.Module) -> int:
    """The bytes of ``block``'s image: what one slot holds and one copy moves when it streams."""
    return _block_layout(block)[2]


def _typed_view(image: torch.Tensor, place: _Place) -> torch.Tensor:
    """``place``'s tensor inside the byte buffer ``image``: its own bytes read with its own dtype and shape."""
    return image[place.offset : place.offset + place.nbytes].view(place.dtype).view(place.shape)


def _point(places: list[_Place], tensors: list[torch.Tensor]) -> None:
    """Make each place's parameter or buffer ``tensors[i]``. Parameter objects stay the same (hooks and
    ``model.parameters()`` keep seeing them); only the storage behind them changes."""
    for place, tensor in zip(places, tensors):
        if place.parameter is not None:
            place.parameter.data = tensor
        else:
            setattr(place.module, place.name, tensor)


def _move_all_but(module: nn.Module, skipped: set[int], device: torch.device) -> None:
    """Move every tensor of ``module`` outside the modules whose ids are in ``skipped`` (and those that stay on
    the host) to ``device``, with ``.to(device)`` only: a dtype cast would break Fp8Linear's e4m3 weights."""
    for name, param in module.named_parameters(recurse=False):
        param.data = param.data.to(device)
    for name, buffer in module.named_buffers(recurse=False):
        setattr(module, name, buffer.to(device))
    for child in module.children():
        if id(child) not in skipped and not _stays_on_host(child):
            _move_all_but(child, skipped, device)


def _own_copies(places: list[_Place], views: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The host views of a block copied to ``device`` into storage of their own (a clone on the CPU, so nothing
    keeps the arena alive); one copy per image offset, so tensors shared inside the block stay shared."""
    copies = {}
    for place, view in zip(places, views):
        if place.offset not in copies:
            copies[place.offset] = view.clone() if device.type == "cpu" else view.to(device)
    return [copies[place.offset] for place in places]


def _unique_bytes(model: nn.Module) -> int:
    """Bytes of every distinct parameter and buffer of ``model``."""
    seen = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in seen.values())


class BlockOffload:
    """The handle of an offloaded model (build it with ``offload_blocks``).

    Attributes:
        stats: an ``OffloadStats``.
        slots: the device slots, ``[slot_bytes]`` uint8 each (for inspection; empty after ``remove``).
        copies: block images copied to the device so far (each streamed block once per evaluation).
    """

    def __init__(
        self, model: nn.Module, blocks: nn.ModuleList, device: torch.device, resident_blocks: int, prefetch: int
    ):
        self.model, self.device, self.prefetch, self.copies = model, device, prefetch, 0
        self._first_streamed = resident_blocks
        streamed = list(blocks)[resident_blocks:]
        self._streamed = streamed
        layouts = [_block_layout(block) for block in streamed]
        self._places = [places for places, _, _ in layouts]
        image_sizes = [size for _, _, size in layouts]
        total_bytes = _unique_bytes(model)
        streamed_bytes = sum(sum({p.offset: p.nbytes for p in places}.values()) for places in self._places)
        self._slot_count = min(prefetch + 1, len(streamed))
        self._removed, self._active, self._hooks = False, set(), []
        with torch.no_grad():
            self._arena = self._to_host(layouts, image_sizes)
            _move_all_but(model, {id(block) for block in streamed}, device)
            self._make_slots(max(image_sizes, default=0))
        self.stats = OffloadStats(
            blocks=len(blocks),
            resident_blocks=resident_blocks,
            streamed_blocks=len(streamed),
            resident_bytes=total_bytes - streamed_bytes,
            streamed_bytes=streamed_bytes,
            copied_bytes=sum(image_sizes),
            slot_bytes=sum(slot.numel() for slot in self.slots),
            host_bytes=self._arena.bytes.numel(),
            pinned=self._arena.pinned,
        )
        if streamed:
            self._install_hooks(blocks)
        setattr(model, _MARK, self)

    # ---- setting up -------------------------------------------------------------------------------------------

    def _to_host(self, layouts, image_sizes) -> HostArena:
        """Copy each streamed block into its image in a new arena and point its tensors there, block by block, so
        each block's former storage is released before the next is copied; then pin the arena."""
        arena = HostArena(sum(image_sizes), "the streamed DiT blocks")
        self._images, self._host_views = [], []
        start = 0
        for (places, tensors, _), size in zip(layouts, image_sizes):
            image = arena.bytes[start : start + size]
            views = [_typed_view(image, place) for place in places]
            for view, tensor in zip(views, tensors):
                view.copy_(tensor)
            _point(places, views)
            self._images.append(image)
            self._host_views.append(views)
            start += size
        if self.device.type == "cuda":
            arena.pin(self.device)
        return arena

    def _make_slots(self, slot_bytes: int) -> None:
        """One device allocation for all slots, made once, so the allocator sees no churn per block; and each
        streamed block's views into its slot (block ``j`` of the streamed ones always uses slot ``j % slots``)."""
        pool = torch.empty(self._slot_count, slot_bytes, dtype=torch.uint8, device=self.device)
        self.slots = tuple(pool.unbind(0))
        self._slot_views = [
            [_typed_view(self.slots[j % self._slot_count], p) for p in places] for j, places in enumerate(self._places)
        ]
        self._holder: list[int | None] = [None] * self._slot_count  # the streamed block copied into each slot
        if self.device.type == "cuda" and self._slot_count:
            self._copy_stream = torch.cuda.Stream(device=self.device)
            self._loaded = [torch.cuda.Event() for _ in self.slots]  # on the copy stream, after a slot's copy
            self._freed = [torch.cuda.Event() for _ in self.slots]  # on the compute stream, after a slot's reader
        else:
            self._copy_stream = None

    def _install_hooks(self, blocks: nn.ModuleList) -> None:
        """Pre-hooks on block 0 (an evaluation starts there) and on every streamed block, prepended so the weights
        are in place before any other hook runs; post-hooks on the streamed blocks that also run when the block
        raises, so a failed evaluation leaves no block pointing into a slot."""
        for index in sorted({0, *range(self._first_streamed, len(blocks))}):
            hook = functools.partial(self._before_block, index)
            self._hooks.append(blocks[index].register_forward_pre_hook(hook, prepend=True))
        for ordinal, block in enumerate(self._streamed):
            hook = functools.partial(self._after_block, ordinal)
            self._hooks.append(block.register_forward_hook(hook, always_call=True))

    # ---- the schedule -----------------------------------------------------------------------------------------

    def _compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def _before_block(self, index: int, module, args) -> None:
        if index == 0:
            self._begin_evaluation()
        if index >= self._first_streamed:
            self._load(index - self._first_streamed)

    def _begin_evaluation(self) -> None:
        """Copy the first streamed blocks into every slot, so they arrive while the resident blocks compute. Always
        afresh, even where a slot still holds the block from the last evaluation: the host weights may have been
        edited in place since."""
        for ordinal in list(self._active):
            self._after_block(ordinal, None, None, None)
        if self._copy_stream is not None:
            # Everything already enqueued on the compute stream, including a previous or failed evaluation's use
            # of the slots, finishes before this evaluation's first copies overwrite them.
            self._copy_stream.wait_stream(self._compute_stream())
        for ordinal in range(self._slot_count):
            self._copy(ordinal)

    def _load(self, ordinal: int) -> None:
        """Make streamed block ``ordinal`` run on its slot, then start the copies of the next ``prefetch`` blocks."""
        slot = ordinal % self._slot_count
        if self._holder[slot] != ordinal:  # not prefetched (a block run on its own, or out of order)
            self._copy(ordinal)
        if self._copy_stream is not None:
            self._compute_stream().wait_event(self._loaded[slot])
        _point(self._places[ordinal], self._slot_views[ordinal])
        self._active.add(ordinal)
        for ahead in range(ordinal + 1, min(ordinal + self.prefetch, len(self._streamed) - 1) + 1):
            if self._holder[ahead % self._slot_count] != ahead:
                self._copy(ahead)

    def _copy(self, ordinal: int) -> None:
        """Copy streamed block ``ordinal``'s image into its slot.

        On a GPU the order is kept by events, never by host waits:
          1. the copy stream waits for ``_freed[slot]``, recorded on the compute stream right after the kernels of
             the block that last read this slot were enqueued: the slot is not overwritten while they may run;
          2. the copy is enqueued on the copy stream, and ``_loaded[slot]`` recorded after it;
          3. ``_load`` makes the compute stream wait for ``_loaded[slot]`` before the block's kernels are enqueued.
        With ``prefetch + 1`` slots, block ``j + prefetch`` goes into the slot block ``j − 1`` used, so the copy
        waits on a block that has already been enqueued and runs while block ``j`` computes."""
        slot = ordinal % self._slot_count
        assert self._holder[slot] not in self._active, "a slot is never overwritten while its block runs"
        self._holder[slot] = ordinal
        image = self._images[ordinal]
        target = self.slots[slot][: image.numel()]
        if self._copy_stream is None:
            target.copy_(image)
        else:
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(self._freed[slot])
                target.copy_(image, non_blocking=True)
                self._loaded[slot].record(self._copy_stream)
        self.copies += 1

    def _after_block(self, ordinal: int, module, args, output) -> None:
        """Mark the block's slot free once the kernels just enqueued have run; point its tensors back home."""
        if ordinal not in self._active:
            return
        self._active.discard(ordinal)
        if self._copy_stream is not None:
            self._freed[ordinal % self._slot_count].record(self._compute_stream())
        _point(self._places[ordinal], self._host_views[ordinal])

    # ---- undoing ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def remove(self, device=None, *, streamed_to=None) -> None:
        """Undo the offload: hooks removed, the slots and the host arena released, and the model a plain module
        with every tensor on ``device`` (default: the device it was offloaded to, i.e. fully resident there;
        "cpu" gives the host a plain copy of everything, for a card that cannot hold the whole model).
        ``streamed_to`` puts the blocks that were streamed elsewhere (default: ``device``): "cpu" keeps the
        resident part where it is and the streamed blocks in host memory, e.g. to stream more of them next.
        Calling it again does nothing."""
        if self._removed:
            return
        target = self.device if device is None else _device(device, "device")
        streamed_target = target if streamed_to is None else _device(streamed_to, "streamed_to")
        for handle in self._hooks:
            handle.remove()
        for ordinal in list(self._active):
            self._after_block(ordinal, None, None, None)
        if self._copy_stream is not None:
            self._copy_stream.synchronize()  # no copy still reads the arena or writes a slot
        self.slots, self._slot_views = (), []
        for places, views in zip(self._places, self._host_views):
            _point(places, _own_copies(places, views, streamed_target))
        _move_all_but(self.model, {id(block) for block in self._streamed}, target)
        self._host_views, self._images = [], []
        self._arena.release()
        self._arena = None
        delattr(self.model, _MARK)
        self._removed = True
