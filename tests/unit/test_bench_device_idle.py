"""bench/device_idle.py: the device's idle stretches from the intervals of its activities."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from device_idle import device_gaps  # noqa: E402


def test_gaps_between_activities_and_none_inside_overlaps():
    # two streams overlap on [10, 40) and [20, 30); a gap [40, 50); back to back at 60; a gap [70, 100)
    intervals = [(10, 40), (20, 30), (50, 60), (60, 70), (100, 105)]
    span, busy, gaps = device_gaps(intervals)
    assert span == 95 and busy == 30 + 20 + 5
    assert gaps == [(10, 40, 0, 2), (30, 70, 3, 4)]


def test_a_short_activity_inside_a_long_one_leaves_the_long_one_as_the_last_before_a_gap():
    span, busy, gaps = device_gaps([(0, 100), (10, 20), (130, 140)])
    assert (span, busy) == (140, 110)
    assert gaps == [(30, 100, 0, 2)]
