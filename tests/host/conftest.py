import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflows"))

from comfy_host import ComfyServer  # noqa: E402

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
    host.start()
    yield host
    host.stop()
