"""The save node: frames and soundtrack into one mp4 (H.264 yuv420p + AAC) in the output folder."""

from __future__ import annotations

from pathlib import Path

from h3_core.mp4 import write_mp4
from h3_core.pipeline.geometry import FPS

from . import _host
from .images import single_waveform


class H3SaveVideo:
    CATEGORY = _host.CATEGORY
    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "save"
    DESCRIPTION = ("Writes the frames and the soundtrack as an mp4 (H.264 yuv420p, AAC) in the output folder; the file "
                   "appears under its name only when complete.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "images": ("IMAGE",),
            "filename_prefix": ("STRING", {"default": "H3/clip"}),
            "fps": ("INT", {"default": FPS, "min": 1, "max": 120}),
        }, "optional": {"audio": ("AUDIO",)}}

    def save(self, images, filename_prefix, fps, audio=None):
        import folder_paths

        waveform, rate = single_waveform(audio, "audio") if audio is not None else (None, 32000)
        output = str(_host.output_directory())
        folder, name, counter, subfolder, _ = folder_paths.get_save_image_path(filename_prefix, output,
                                                                               images.shape[2], images.shape[1])
        target = Path(folder) / f"{name}_{counter:05d}.mp4"
        write_mp4(target, images, waveform, rate, fps=fps, check_cancel=_host.check_cancel)
        _host.say(f"saved {target}")
        return {"ui": {"images": [{"filename": target.name, "subfolder": subfolder, "type": "output"}],
                       "animated": (True,)}}
