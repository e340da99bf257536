import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Tensors drawn at collection (parametrize lists) and inside tests without their own generator are the
# same on every run, so a result never depends on the draw.
torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _seeded_random():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _nan_poisoned_empty(monkeypatch):
    """torch.empty / empty_like return NaN-filled float tensors, so an unwritten output cannot pass."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        # Leave autograd leaves alone: torch.compile allocates some with requires_grad=True.
        if t.is_floating_point() and not t.requires_grad:
            t.fill_(float("nan"))
        return t

    def empty(*args, **kwargs):
        # A stand-in is not a factory torch's device context (``with torch.device("meta")``) knows, so it
        # passes the context's device on itself.
        if kwargs.get("device") is None:
            kwargs["device"] = torch.get_default_device()
        return poison(real_empty(*args, **kwargs))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
