"""Where the GPU waits during one profiled run: the stretches with no kernel, copy or memset on the device.

``idle_table(run, top)`` profiles ``run()`` (CPU and CUDA activities, Python frames) and returns the span of
device work, the time some device activity was running, the idle rest, and the idle time grouped by where
the next device activity was launched from: the innermost host op open around its launch call, with the
innermost ``h3_core`` frame where the profile holds Python frames or stacks (torch 2.11's does not: its
sites are op names, or none for a Triton launch). Gaps under ``SHORT_NS`` (back-to-back launches) are
summed as one group. A gap whose next launch came after the device had already gone idle is the host being
late (launch overhead, Python, a synchronisation); one whose launch came earlier is the device's own (a
dependency between streams or a kernel's start-up). The ``top`` largest gaps are listed one by one.
"""

from __future__ import annotations

import bisect
import re

import torch

LAUNCH_NAMES = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernelEx",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
    "cudaLaunchCooperativeKernel",
    "cudaGraphLaunch",
)
SHORT_NS = 5000
PYTHON_FRAME = re.compile(r".*\.py\(\d+\): ")


def _is_device(event) -> bool:
    return event.device_type() == torch.autograd.DeviceType.CUDA


def _is_frame(event) -> bool:
    # named "path.py(line): function" (older torch builds have no is_python_function() on these events)
    return PYTHON_FRAME.match(event.name()) is not None


def _host_spans(events):
    """The host's ops and Python frames (no launch calls, no device work) sorted by start, and their starts."""
    spans = sorted(
        (e for e in events if not _is_device(e) and e.name() not in LAUNCH_NAMES and e.duration_ns() > 0),
        key=lambda e: e.start_ns(),
    )
    return spans, [e.start_ns() for e in spans]


def _ours(event) -> str | None:
    """The innermost h3_core frame of a host span: its own name for a Python frame, else from its stack."""
    if _is_frame(event):
        return event.name() if "h3_core" in event.name() else None
    stack = event.stack() if hasattr(event, "stack") else []
    return next((frame for frame in stack if "h3_core" in frame), None)


def _site(spans, starts, thread, at_ns, scan=20000) -> str:
    """Where a launch at ``at_ns`` on ``thread`` came from: the innermost open op (or frame) and the innermost
    h3_core frame around it."""
    innermost = ours = None
    last = bisect.bisect_right(starts, at_ns) - 1
    for i in range(last, max(-1, last - scan), -1):
        span = spans[i]
        if span.start_thread_id() != thread or span.end_ns() < at_ns:
            continue
        innermost = innermost or span.name()
        ours = _ours(span)
        if ours:
            break
    if innermost is None:
        return "no host op open (a Triton or library launch)"
    return innermost if ours in (None, innermost) else f"{innermost} in {ours}"


def device_gaps(intervals):
    """``intervals``: (start, end) of device activities sorted by start, overlaps allowed (several streams).
    Returns the span from the first start to the last end, the time covered by at least one activity, and
    the gaps as (length, gap start, index of the activity that ended last before it, index of the one after).
    """
    gaps, busy = [], 0
    end, last = intervals[0][0], 0
    for i, (start, stop) in enumerate(intervals):
        if start > end:
            gaps.append((start - end, end, last, i))
        busy += max(0, stop - max(start, end))
        if stop >= end:
            end, last = stop, i
    return end - intervals[0][0], busy, gaps


def idle_table(run, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        run()
        torch.cuda.synchronize()
    events = list(prof.profiler.kineto_results.events())
    device = sorted((e for e in events if _is_device(e) and e.duration_ns() > 0), key=lambda e: e.start_ns())
    if not device:
        return dict(span_ms=0.0, busy_ms=0.0, idle_ms=0.0, host_late_ms=0.0, by_site=[], gaps=[])
    launches = {e.correlation_id(): e for e in events if not _is_device(e) and e.name() in LAUNCH_NAMES}
    spans, starts = _host_spans(events)
    span, busy, gaps = device_gaps([(e.start_ns(), e.end_ns()) for e in device])
    by_site: dict[str, list[float]] = {}
    listed, host_late = [], 0
    for idle, idle_from, before_index, after_index in sorted(gaps, key=lambda g: -g[0]):
        before, after = device[before_index], device[after_index]
        if idle < SHORT_NS:  # back-to-back launches: not worth a frame search each
            totals = by_site.setdefault(f"gaps under {SHORT_NS // 1000} µs", [0.0, 0, 0.0])
            totals[0] += idle / 1e6
            totals[1] += 1
            continue
        launch = launches.get(after.linked_correlation_id()) or launches.get(after.correlation_id())
        late = launch is not None and launch.start_ns() > idle_from
        host_late += idle if late else 0
        site = _site(spans, starts, launch.start_thread_id(), launch.start_ns()) if launch else "unknown"
        totals = by_site.setdefault(site, [0.0, 0, 0.0])
        totals[0] += idle / 1e6
        totals[1] += 1
        totals[2] += idle / 1e6 if late else 0.0
        if len(listed) < top:
            listed.append(
                dict(
                    idle_us=round(idle / 1e3, 1),
                    host_late=late,
                    launched_from=site,
                    before=before.name()[:90],
                    after=after.name()[:90],
                )
            )
    sites = sorted(by_site.items(), key=lambda kv: -kv[1][0])
    return dict(
        span_ms=round(span / 1e6, 3),
        busy_ms=round(busy / 1e6, 3),
        idle_ms=round((span - busy) / 1e6, 3),
        host_late_ms=round(host_late / 1e6, 3),
        by_site=[
            dict(site=site[:140], idle_ms=round(ms, 3), gaps=n, host_late_ms=round(late, 3))
            for site, (ms, n, late) in sites[:top]
        ],
        gaps=listed,
    )
