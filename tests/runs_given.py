"""What the modules of a DiT are given with each call, now that ``RunOptions`` are passed down and never held:
``runs_given(modules)`` records, call by call, the ``run`` argument (or another) each of ``modules`` was called
with, read by the forward's own signature whether it came by keyword or by position, and its default where the call
left it out."""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict

__all__ = ["runs_given", "by_module"]


@contextlib.contextmanager
def runs_given(modules, argument: str = "run"):
    """A list filled in the ``with`` block with ``(module, value)`` for each call of one of ``modules``, in call
    order: ``value`` the call's ``argument``."""
    seen = []

    def record(module, args, kwargs):
        signature = inspect.signature(module.forward)
        given = signature.bind(*args, **kwargs).arguments
        seen.append((module, given.get(argument, signature.parameters[argument].default)))

    handles = [m.register_forward_pre_hook(record, with_kwargs=True) for m in modules]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def by_module(seen) -> dict:
    """``runs_given``'s calls grouped: each module's values, in call order."""
    grouped = defaultdict(list)
    for module, value in seen:
        grouped[module].append(value)
    return dict(grouped)
