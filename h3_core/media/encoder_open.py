"""Whether an H.264 encoder opens on this machine: it is opened with PyAV and given a blank frame.

``fails_to_open`` asks in this process. ``fails_to_open_elsewhere`` asks a child process that runs this file as a
script (it imports nothing but PyAV and the standard library), for the probe made while a server starts: PyAV
calls FFmpeg's ``avcodec_open2`` without letting go of the interpreter's lock, and for NVENC that call loads the
driver (on a GPU with no video encoder too: bench/results/end_to_end.md), so in-process it stalls every other
thread of the server, the checks of a first prompt among them.

    python encoder_open.py FPS WIDTH HEIGHT NAME [NAME ...]

prints one JSON line: ``{"answers": {name: why it fails, or null}}``, or ``{"import_error": "..."}`` where PyAV
is not importable.
"""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import Iterable

__all__ = ["fails_to_open", "fails_to_open_elsewhere"]

# a probe that has not answered by then is taken as a failure (a driver that hangs must not hold a server's start)
CHILD_TIMEOUT_S = 120


def fails_to_open(name: str, width: int, height: int, fps: int) -> str | None:
    """Why encoder ``name`` cannot encode ``width``×``height`` yuv420p at ``fps`` in this process, or None when it
    can."""
    import av

    try:
        context = av.CodecContext.create(name, "w")
        context.width, context.height, context.pix_fmt = width, height, "yuv420p"
        context.time_base = Fraction(1, fps)
        context.open()
        blank = av.VideoFrame(width, height, "yuv420p")
        blank.pts = 0
        context.encode(blank)
        context.encode(None)
    except Exception as exc:  # unknown to this FFmpeg, no device, no driver, a size it refuses
        return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
    return None


def fails_to_open_elsewhere(names: Iterable[str], width: int, height: int, fps: int) -> dict[str, str | None]:
    """``fails_to_open`` for each of ``names``, asked of a child process (this file run by this interpreter, with
    this process's environment). ``ImportError`` where the child cannot import PyAV; a child that fails otherwise
    or does not answer within ``CHILD_TIMEOUT_S`` makes every name fail, with the reason."""
    names = list(names)
    command = [sys.executable, str(Path(__file__).resolve()), str(fps), str(width), str(height), *names]
    try:
        # its output decoded as UTF-8 whatever the locale's code page (Windows), undecodable bytes replaced
        done = subprocess.run(command, capture_output=True, encoding="utf-8", errors="replace", timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return dict.fromkeys(names, f"the probe's process did not answer within {CHILD_TIMEOUT_S} s")
    except OSError as exc:
        return dict.fromkeys(names, f"the probe's process did not start ({exc})")
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if done.returncode == 0 and lines else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        said = (done.stderr.strip().splitlines() or ["nothing on its error output"])[-1][:200]
        return dict.fromkeys(names, f"the probe's process exited with {done.returncode} ({said})")
    if "import_error" in answer:
        raise ImportError(answer["import_error"])
    return {name: answer["answers"].get(name, "the probe's process did not answer for it") for name in names}


def _main(argv: list[str]) -> None:
    fps, width, height, *names = argv
    try:
        import av  # noqa: F401
    except ImportError as exc:
        print(json.dumps({"import_error": str(exc)}))
        return
    print(json.dumps({"answers": {name: fails_to_open(name, int(width), int(height), int(fps)) for name in names}}))


if __name__ == "__main__":
    _main(sys.argv[1:])
