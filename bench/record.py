"""What every benchmark writes beside its numbers: the command that produced them, the machine and library
versions, the date; and the JSON written to ``--out`` and printed."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch


def header(script: str, argv) -> dict:
    """``command`` (as run from the repository root), ``device``, ``torch``, ``cuda``, ``cudnn``, ``python``
    and ``date`` (UTC)."""
    args = argv if argv is not None else sys.argv[1:]
    cuda = torch.cuda.is_available()
    return dict(command=f"python3 bench/{script} " + " ".join(str(a) for a in args),
                device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version() if cuda else None,
                python=platform.python_version(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def write(result: dict, out: Path | None, indent: int = 1) -> str:
    """``result`` as JSON, written to ``out`` when given; returns the text."""
    text = json.dumps(result, indent=indent)
    if out:
        Path(out).write_text(text + "\n")
    return text
