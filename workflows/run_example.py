"""Run a bundled workflow (default: the FL2VA example) through a real ComfyUI server on the embedded default
and print the mp4's path.

The embedded default is the tiny RANDOM checkpoints of ``h3_core.tiny_checkpoints`` (written into the run's
model folders, each file labelled as random) at a small size, with two generated keyframe patterns in the
input folder: it shows the whole path working — loaders, text encoder, sampler, tiled decode, mp4 — in
seconds on a CPU. The clip it makes is noise. With the real checkpoints, open the workflow in ComfyUI.

    python3 workflows/run_example.py [--workflow workflows/h3_fl2va.json] [--out out/example]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from comfy_host import ComfyServer, error_message, mp4_files  # noqa: E402
from ui_to_api import embedded_default, to_api  # noqa: E402

from h3_core.tiny_checkpoints import write_tiny_checkpoints  # noqa: E402


def keyframe_patterns(folder: Path) -> None:
    """Two generated test patterns (not photographs) under the names the FL2VA example loads."""
    y, x = np.mgrid[0:160, 0:256]
    first = np.stack([x * 255 // 255, y * 255 // 159, np.full_like(x, 96)], -1).astype(np.uint8)
    last = np.stack([np.full_like(x, 200), (x + y) % 256, y * 255 // 159], -1).astype(np.uint8)
    Image.fromarray(first).save(folder / "h3_first_frame.png")
    Image.fromarray(last).save(folder / "h3_last_frame.png")


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workflow", type=Path, default=HERE / "h3_fl2va.json")
    parser.add_argument("--out", type=Path, default=HERE.parent / "out" / "example")
    args = parser.parse_args(argv)
    server = ComfyServer(args.out.resolve())
    print(f"writing the tiny RANDOM checkpoints (not a trained model) into {server.models}", flush=True)
    write_tiny_checkpoints(server.models)
    keyframe_patterns(server.input)
    print(f"starting ComfyUI (log: {server.log_path})", flush=True)
    server.start()
    try:
        prompt = embedded_default(to_api(json.loads(args.workflow.read_text()), server.object_info()))
        print(f"running {args.workflow.name} on the embedded default", flush=True)
        entry = server.run(prompt)
        if entry["status"]["status_str"] != "success":
            raise SystemExit(f"the workflow failed: {error_message(entry)}\n{server.log_tail()}")
        files = mp4_files(entry, server.output)
        if not files:
            raise SystemExit(f"the workflow wrote no mp4\n{server.log_tail()}")
    finally:
        server.stop()
    print(files[0])
    return files[0]


if __name__ == "__main__":
    main()
