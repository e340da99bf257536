"""A module's weights in host memory copied into page-locked memory, so that its later move to a GPU runs at the
copy engine's rate: from pageable memory (a memory-mapped file) the driver copies through bounce buffers of its
own, several times slower. The copying can run on a thread while the GPU is busy with other work; ``swap_in``
then points the module at the copies and ``release`` gives the page lock back once the module has moved.

The memory is allocated as ordinary host memory and registered with ``cudaHostRegister``, as the host registers
the weights it keeps in host memory, in chunks of ``CHUNK_BYTES`` so that no single call holds the driver long.
Only plain tensors on the CPU are copied; quantised tensor subclasses and tensors already pinned stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

__all__ = ["CHUNK_BYTES", "PinnedWeights", "copy_to_pinned", "host_tensors", "pinnable_bytes"]

CHUNK_BYTES = 256 << 20
_ALIGN = 256  # each tensor's first byte in a chunk, as the device allocators align theirs
_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every device's context


def _plain_on_cpu(tensor) -> bool:
    return (
        isinstance(tensor, torch.Tensor)
        and type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.device.type == "cpu"
        and tensor.numel() > 0
        and not tensor.is_pinned()
    )


def host_tensors(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, bool]]:
    """``(owner, name, is_parameter)`` for each plain CPU parameter and buffer of ``module`` that is not pinned,
    each tensor once."""
    found, seen = [], set()
    for owner in module.modules():
        for table, is_parameter in ((owner._parameters, True), (owner._buffers, False)):
            for name, tensor in table.items():
                if tensor is None or not _plain_on_cpu(tensor) or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                found.append((owner, name, is_parameter))
    return found


def _tensor(owner: torch.nn.Module, name: str, is_parameter: bool) -> torch.Tensor:
    return (owner._parameters if is_parameter else owner._buffers)[name]


def pinnable_bytes(module: torch.nn.Module) -> int:
    """Bytes ``copy_to_pinned`` would copy for ``module``."""
    return sum(_bytes(_tensor(*entry)) for entry in host_tensors(module))


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _register(buffer: torch.Tensor) -> bool:
    return torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), _PORTABLE) == 0


def _unregister(buffer: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


@dataclass(eq=False)
class PinnedWeights:
    """Copies of a module's host tensors in registered chunks; ``swap_in`` and ``release`` (module docstring)."""

    entries: list[tuple[torch.nn.Module, str, bool, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    chunks: list[torch.Tensor] = field(default_factory=list)
    unregister: Callable[[torch.Tensor], None] = _unregister

    @property
    def bytes(self) -> int:
        return sum(chunk.numel() for chunk in self.chunks)

    def swap_in(self) -> int:
        """Points each tensor the copies were made from at its copy, where the module still holds that tensor
        (one moved or replaced since is left as it is); returns how many were swapped."""
        swapped = 0
        for owner, name, is_parameter, source, copy in self.entries:
            table = owner._parameters if is_parameter else owner._buffers
            if table.get(name) is not source:
                continue
            if is_parameter:
                source.data = copy
            else:
                table[name] = copy
            swapped += 1
        return swapped

    def release(self) -> None:
        """Gives the page lock back: the memory stays valid (a tensor still on it reads it as ordinary host
        memory) and is freed with the last tensor viewing it."""
        for chunk in self.chunks:
            self.unregister(chunk)
        self.entries.clear()
        self.chunks.clear()


def copy_to_pinned(
    module: torch.nn.Module,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    register: Callable[[torch.Tensor], bool] = _register,
    unregister: Callable[[torch.Tensor], None] = _unregister,
    should_stop: Callable[[], bool] = lambda: False,
) -> PinnedWeights | None:
    """Copies of ``module``'s host tensors (``host_tensors``) in registered chunks, the module itself untouched
    (``PinnedWeights.swap_in`` points it at them). None when a chunk cannot be registered or ``should_stop()``
    turns true between chunks (what was registered is released)."""
    groups, current, used = [], [], 0
    for entry in host_tensors(module):
        size = -(-_bytes(_tensor(*entry)) // _ALIGN) * _ALIGN
        if current and used + size > chunk_bytes:
            groups.append((current, used))
            current, used = [], 0
        current.append((entry, used))
        used += size
    if current:
        groups.append((current, used))
    pinned = PinnedWeights(unregister=unregister)
    for members, size in groups:
        if should_stop():
            pinned.release()
            return None
        chunk = torch.empty(size, dtype=torch.uint8)
        if not register(chunk):
            pinned.release()
            return None
        pinned.chunks.append(chunk)
        for (owner, name, is_parameter), offset in members:
            source = _tensor(owner, name, is_parameter)
            flat = chunk[offset : offset + _bytes(source)]
            copy = flat.view(source.dtype).view(source.shape)
            copy.copy_(source)
            pinned.entries.append((owner, name, is_parameter, source, copy))
    return pinned
