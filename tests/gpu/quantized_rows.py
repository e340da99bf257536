"""Comparing two quantisations of the same rows whose inputs were summed or rounded in another order."""

import torch


def assert_codes_within_a_step(got, want, scale_step: float):
    """``got`` and ``want`` (``QuantizedRows``): the scales within ``scale_step`` (relative), every value
    within one e4m3 step, and at most one code in a thousand different."""
    assert ((got.scale - want.scale).abs() <= want.scale * scale_step).all()
    a, b = (r.codes.float() * r.scale for r in (got, want))
    assert ((a - b).abs() <= b.abs() * 2**-3 + 1e-6 * b.abs().max()).all()
    assert (got.codes.view(torch.uint8) != want.codes.view(torch.uint8)).float().mean() <= 1e-3
