import sys
from pathlib import Path

import wave

import numpy as np
import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflows"))

from comfy_host import ComfyServer  # noqa: E402

from h3_core.mp4 import write_mp4  # noqa: E402
from h3_core.tiny_checkpoints import write_tiny_checkpoints  # noqa: E402


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One ComfyUI server for the session, with the tiny random checkpoints in its model folders and two
    keyframe images in its input folder."""
    base = tmp_path_factory.mktemp("comfy")
    host = ComfyServer(base)
    host.tiny = write_tiny_checkpoints(host.models)
    rng = np.random.default_rng(0)
    for name, size in (("first.png", (96, 64)), ("last.png", (80, 48))):
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(host.input / name)
    t = torch.arange(40000) / 16000
    tone = (0.3 * torch.sin(2 * torch.pi * 330 * t)).clamp(-1, 1)
    with wave.open(str(host.input / "tone.wav"), "wb") as out:  # 2.5 s mono at 16 kHz: resampled to 32 kHz stereo
        out.setnchannels(1), out.setsampwidth(2), out.setframerate(16000)
        out.writeframes((tone * 32767).to(torch.int16).numpy().tobytes())
    write_mp4(host.input / "clip.mp4", torch.rand(30, 48, 80, 3), 0.2 * torch.randn(2, 40000).clamp(-3, 3), 32000, fps=30)
    host.start()
    yield host
    host.stop()
