"""The save node: frames and soundtrack into one mp4 (H.264 yuv420p + AAC) in the output folder, with the
workflow and the prompt in its metadata as the host's own SaveVideo stores them, so dropping the clip on the
canvas loads the workflow that made it."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

from comfy_api.v0_0_2 import io

from ..h3_core.media.mp4 import write_mp4
from ..h3_core.pipeline.geometry import FPS
from . import _host
from .images import single_waveform


def workflow_tags(prompt, extra_pnginfo) -> dict[str, str]:
    """The host's metadata for a saved video: ``prompt`` and each entry of ``extra_pnginfo`` (the workflow), as
    JSON text; none when the server runs with ``--disable-metadata``."""
    from comfy.cli_args import args

    if args.disable_metadata:
        return {}
    tags = {key: json.dumps(value) for key, value in (extra_pnginfo or {}).items()}
    if prompt is not None:
        tags["prompt"] = json.dumps(prompt)
    return tags


class H3SaveVideo(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3SaveVideo",
            display_name="H3 Save Video (mp4)",
            category=_host.CATEGORY,
            description="Writes the frames and the soundtrack as an mp4 (H.264 yuv420p, AAC) in the output folder, "
            "with the workflow in its metadata; the file appears under its name only when complete.",
            inputs=[
                io.Image.Input("images"),
                io.String.Input("filename_prefix", default="H3/clip"),
                io.Int.Input("fps", default=FPS, min=1, max=120),
                io.Audio.Input("audio", optional=True),
            ],
            outputs=[],
            is_output_node=True,
            hidden=[io.Hidden.prompt, io.Hidden.extra_pnginfo],
        )

    @classmethod
    def execute(cls, images, filename_prefix, fps, audio=None):
        waveform, rate = single_waveform(audio, "audio") if audio is not None else (None, 32000)
        target, subfolder = output_target(filename_prefix, images.shape[2], images.shape[1])
        with disk_errors(target):
            write_mp4(
                target,
                images,
                waveform,
                rate,
                fps=fps,
                check_cancel=_host.check_cancel,
                metadata=workflow_tags(cls.hidden.prompt, cls.hidden.extra_pnginfo),
                encoder="auto",
            )
        return saved(target, subfolder)


def output_target(filename_prefix: str, width: int, height: int) -> tuple[Path, str]:
    """The next free ``<prefix>_NNNNN.mp4`` in the host's output folder, and its subfolder there."""
    import folder_paths

    output = str(_host.output_directory())
    folder, name, counter, subfolder, _ = folder_paths.get_save_image_path(filename_prefix, output, width, height)
    return Path(folder) / f"{name}_{counter:05d}.mp4", subfolder


@contextmanager
def disk_errors(target: Path):
    """A failed write said with the file it was for and what to do (the writer has removed the partial file)."""
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise OSError(
            exc.errno,
            f"could not write {target.name} in {target.parent}: {reason}; nothing was left "
            "under that name (free space there, or change filename_prefix)",
        ) from exc


def saved(target: Path, subfolder: str, *outputs) -> io.NodeOutput:
    """The node's result for a saved clip: the file in the UI's output list, and ``outputs``."""
    _host.say(f"saved {target}")
    return io.NodeOutput(
        *outputs,
        ui={"images": [{"filename": target.name, "subfolder": subfolder, "type": "output"}], "animated": (True,)},
    )
