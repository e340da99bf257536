"""Run bundled workflows (default: the FL2VA example) through one real ComfyUI server on the embedded default
and print each mp4's path, one a line, in the order given.

The embedded default is the tiny RANDOM checkpoints of ``tests/tiny_checkpoints.py`` (written into the run's
model folders, each file labelled as random) at a small size. Every file a workflow loads from the input
folder (an image, a clip, a sound) is written there under the name the workflow gives it, as a GENERATED
test input: a colour pattern, a tone, a short clip of both; not a photograph or a recording. It shows the
whole path working — loaders, text encoder, references, sampler, tiled decode, mp4 — on a CPU. The clip it
makes is noise. With the real checkpoints, open the workflow in ComfyUI.

Progress goes to stderr and the mp4 paths to stdout. When a workflow fails, the script stops with the failing
node's id, type and error on stderr and a non-zero exit status.

    python3 tests/run_example.py [--workflow workflows/h3_fl2va.json ...] [--out out/example]
"""

from __future__ import annotations

import argparse
import json
import sys
import wave
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKFLOWS = ROOT / "workflows"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from comfy_host import ComfyServer, PromptRefused, failure_message, mp4_files
from tiny_checkpoints import write_tiny_checkpoints
from ui_to_api import WorkflowError, embedded_default, to_api

from h3_core.media.mp4 import write_mp4

UPLOAD_KINDS = {"image_upload": "image", "video_upload": "video", "audio_upload": "audio"}
# Loaders that read a file from the input folder without an upload button.
FILE_INPUTS = {("H3LoadAudio", "audio_file"): "audio"}
# A square image is the cheapest Ref2VA reference: an image reference is encoded at a fixed short edge.
IMAGE_SIZE = (160, 160)
AUDIO_RATE = 32000


class ExampleFailed(RuntimeError):
    pass


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def input_files(prompt: dict, object_info: dict) -> dict[str, str]:
    """The input-folder files ``prompt`` (API form) loads, each with its kind (image, video or audio): the
    values of the inputs with an upload button and of the loaders in ``FILE_INPUTS``."""
    files = {}
    for node in prompt.values():
        info = object_info[node["class_type"]]["input"]
        specs = {**info.get("required", {}), **info.get("optional", {})}
        for name, value in node["inputs"].items():
            if not isinstance(value, str) or name not in specs:
                continue
            spec = specs[name]
            options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            kind = FILE_INPUTS.get((node["class_type"], name))
            kind = kind or next((k for flag, k in UPLOAD_KINDS.items() if options.get(flag)), None)
            if kind:
                files[value] = kind
    return files


def _pattern(index: int, width: int, height: int) -> np.ndarray:
    """A colour test pattern ``[H, W, 3]`` uint8, different for each ``index``."""
    y, x = np.mgrid[0:height, 0:width]
    phase = 37 * index
    return np.stack(
        [
            (x * 255 // max(width - 1, 1) + phase) % 256,
            (y * 255 // max(height - 1, 1) + 2 * phase) % 256,
            (x + y + 3 * phase) % 256,
        ],
        -1,
    ).astype(np.uint8)


def _tone(seconds: float, hz: float) -> np.ndarray:
    t = np.arange(int(seconds * AUDIO_RATE)) / AUDIO_RATE
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def write_input(path: Path, kind: str, index: int) -> None:
    """A generated input of ``kind`` at ``path``: an image in the format its extension names; audio as WAV (PyAV,
    which reads it, goes by the content); a video as a 1.25 s mp4 with a stereo soundtrack."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "image":
        Image.fromarray(_pattern(index, *IMAGE_SIZE)).convert("RGB").save(path)
    elif kind == "audio":
        samples = (_tone(3.0, 220 + 110 * index) * 32767).astype(np.int16)
        with wave.open(str(path), "wb") as out:
            out.setnchannels(1), out.setsampwidth(2), out.setframerate(AUDIO_RATE)
            out.writeframes(samples.tobytes())
    else:
        import torch

        frames = np.stack([np.roll(_pattern(index, 96, 64), 4 * i, axis=1) for i in range(30)])
        tone = torch.from_numpy(_tone(1.25, 330 + 110 * index))
        write_mp4(path, torch.from_numpy(frames), torch.stack([tone, tone]), AUDIO_RATE, fps=24)


def run_workflows(server: ComfyServer, workflows: list[Path], on_done=print) -> list[Path]:
    """Run each workflow on the started ``server`` on the embedded default, after writing the generated inputs
    it loads; ``on_done(path)`` for each mp4 as it is written. ``ExampleFailed`` with the failing nodes'
    errors when one is refused or fails."""
    info = server.object_info()
    written = []
    for workflow in workflows:
        try:
            prompt = embedded_default(to_api(json.loads(workflow.read_text()), info))
        except WorkflowError as error:
            raise ExampleFailed(f"{workflow.name}: {error}") from None
        files = input_files(prompt, info)
        if files:
            log(
                f"writing GENERATED test inputs (patterns and tones, not photographs or recordings) into "
                f"{server.input}: {', '.join(files)}"
            )
        for index, (name, kind) in enumerate(files.items()):
            write_input(server.input / name, kind, index)
        log(f"running {workflow.name} on the embedded default")
        try:
            entry = server.run(prompt)
        except PromptRefused as refused:
            raise ExampleFailed(f"{workflow.name}: {refused}") from None
        if entry["status"]["status_str"] != "success":
            raise ExampleFailed(f"{workflow.name}: {failure_message(entry)}")
        outputs = mp4_files(entry, server.output)
        if not outputs:
            raise ExampleFailed(f"{workflow.name}: the workflow wrote no mp4")
        on_done(outputs[0])
        written.append(outputs[0])
    return written


def main(argv=None, server: ComfyServer | None = None) -> list[Path]:
    """``server``: an already started one to run on (with its checkpoints), left running."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workflow",
        type=Path,
        action="append",
        help="a UI-format workflow; give it several times to run several on one server "
        "(default: workflows/h3_fl2va.json)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "example")
    args = parser.parse_args(argv)
    workflows = args.workflow or [WORKFLOWS / "h3_fl2va.json"]
    missing = [str(path) for path in workflows if not path.is_file()]
    if missing:
        parser.error(f"no such workflow file: {', '.join(missing)}")
    own = server is None
    if own:
        server = ComfyServer(args.out.resolve())
        log(f"writing the tiny RANDOM checkpoints (not a trained model) into {server.models}")
        write_tiny_checkpoints(server.models)
        log(f"starting ComfyUI (log: {server.log_path})")
        server.start()
    try:
        return run_workflows(server, workflows, on_done=lambda path: print(path, flush=True))
    except ExampleFailed as failure:
        raise SystemExit(f"{failure}\n(server log: {server.log_path})") from None
    finally:
        if own:
            server.stop()


if __name__ == "__main__":
    main()
