"""The save node: frames and soundtrack into one mp4 (H.264 yuv420p + AAC) in the output folder."""

from __future__ import annotations

from pathlib import Path

import torch

from h3_core.errors import H3InputError
from h3_core.mp4 import write_mp4
from h3_core.pipeline.geometry import FPS

from . import _host


def _waveform(audio) -> tuple[torch.Tensor, int]:
    if not isinstance(audio, dict) or "waveform" not in audio or "sample_rate" not in audio:
        raise H3InputError("audio: expected the host's AUDIO ({'waveform': [batch, channels, samples], 'sample_rate'})")
    waveform = audio["waveform"]
    if not isinstance(waveform, torch.Tensor) or waveform.dim() != 3 or waveform.shape[0] != 1:
        shape = tuple(waveform.shape) if isinstance(waveform, torch.Tensor) else type(waveform).__name__
        raise H3InputError(f"audio: one clip's waveform [1, channels, samples] is needed, got {shape}")
    return waveform[0], int(audio["sample_rate"])


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

        waveform, rate = _waveform(audio) if audio is not None else (None, 32000)
        output = str(_host.output_directory())
        folder, name, counter, subfolder, _ = folder_paths.get_save_image_path(filename_prefix, output,
                                                                               images.shape[2], images.shape[1])
        target = Path(folder) / f"{name}_{counter:05d}.mp4"
        write_mp4(target, images, waveform, rate, fps=fps, check_cancel=_host.check_cancel)
        _host.say(f"saved {target}")
        return {"ui": {"images": [{"filename": target.name, "subfolder": subfolder, "type": "output"}],
                       "animated": (True,)}}
