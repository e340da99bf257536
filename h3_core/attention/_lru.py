"""A bounded least-recently-used cache for geometry-keyed plans and masks."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable


class BoundedLRU:
    """Holds at most ``maxsize`` entries; building a new one evicts the least recently used."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._entries: OrderedDict = OrderedDict()

    def get_or_build(self, key: Hashable, build: Callable[[], object]):
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        value = self._entries[key] = build()
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)
        return value

    def info(self) -> dict:
        return {"size": len(self._entries), "max": self.maxsize}
