"""What each thread of a profiled process did, in order: a py-spy speedscope file (``h200_host.sh`` with
``E2E_PYSPY=1``) read back as runs of samples that stood at the same place.

A place is the innermost frame in the pack's own code (``h3_core``, ``nodes``) and the innermost frame of all. With
``--idle`` a thread waiting is sampled where it waits, so a long run at one line of plain Python is a thread that
could not take the interpreter's lock while another held it. The samples of a thread are 1/rate apart from its
first one (py-spy's speedscope files carry no timestamps); a thread's first sample is its start only for threads
that live as long as the recording, and samples py-spy failed to take shift what follows them.

    python bench/thread_timeline.py FILE [--thread NAME] [--from S] [--to S] [--min-ms MS] [--rate HZ]
    python bench/thread_timeline.py FILE --totals [--thread NAME] [--from S] [--to S]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

OURS = ("h3_core", "/nodes/", "h3_hybrid")


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as file:
        return json.load(file)


def places(profile: dict, frames: list[dict]) -> list[str]:
    """Each sample's place: ``ours | innermost``."""

    def name(index: int) -> str:
        frame = frames[index]
        return f"{frame['name']} ({Path(frame.get('file', '')).name}:{frame.get('line', '')})"

    out = []
    for stack in profile["samples"]:
        ours = [i for i in stack if any(part in frames[i].get("file", "") for part in OURS)]
        out.append(f"{name(ours[-1]) if ours else '-'} | {name(stack[-1]) if stack else '-'}")
    return out


def runs(samples: list[str], rate: float) -> list[tuple[float, float, str]]:
    """(start s, seconds, place) for each run of equal places."""
    out, start = [], 0
    for i in range(1, len(samples) + 1):
        if i == len(samples) or samples[i] != samples[start]:
            out.append((start / rate, (i - start) / rate, samples[start]))
            start = i
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--thread", default="", help="only threads whose name holds this")
    parser.add_argument("--from", dest="start", type=float, default=0.0, help="seconds from the thread's first sample")
    parser.add_argument("--to", dest="stop", type=float, default=float("inf"))
    parser.add_argument("--min-ms", type=float, default=50.0, help="runs shorter than this are left out")
    parser.add_argument("--rate", type=float, default=100.0, help="the recording's samples per second")
    parser.add_argument("--totals", action="store_true", help="seconds per place instead of the timeline")
    args = parser.parse_args()
    data = load(args.file)
    frames = data["shared"]["frames"]
    for profile in data["profiles"]:
        if args.thread not in profile["name"]:
            continue
        samples = places(profile, frames)
        print(f"# {profile['name']}: {len(samples) / args.rate:.2f} s of samples")
        window = [(t, s, p) for t, s, p in runs(samples, args.rate) if args.start <= t < args.stop]
        if args.totals:
            totals = collections.Counter()
            for _, seconds, place in window:
                totals[place] += seconds
            for place, seconds in totals.most_common(25):
                print(f"{seconds:8.2f} s  {place}")
        else:
            for start, seconds, place in window:
                if seconds * 1000 >= args.min_ms:
                    print(f"{start:8.2f} {seconds * 1000:7.0f} ms  {place}")


if __name__ == "__main__":
    main()
