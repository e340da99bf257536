import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# The host and browser tests drive a real ComfyUI server through tests/comfy_host.py.
for folder in (ROOT / "tests", ROOT / "tests" / "host"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


class CheckoutRootIsNotATestPackage:
    """The checkout's root has an ``__init__.py`` (ComfyUI imports the folder as a package), so pytest would
    collect it as a package and import that ``__init__.py`` under a name made from the folder's: a clone named
    ``ComfyUI-H3-Hybrid`` is no Python name, the file is then imported with no parent package and its relative
    imports fail. Collected as a plain directory it is not imported at all (its tests import the pack as the
    host does). A plugin rather than a hook of this file: pytest asks the hooks of the folder above the root."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collect_directory(self, path, parent):
        if path == ROOT:
            return pytest.Dir.from_parent(parent, path=path)
        return None


def pytest_configure(config):
    config.pluginmanager.register(CheckoutRootIsNotATestPackage(), "h3-checkout-root")


# Tensors drawn at collection (parametrize lists) and inside tests without their own generator are the
# same on every run, so a result never depends on the draw.
torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _seeded_random():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _nan_poisoned_empty(monkeypatch):
    """torch.empty / empty_like return NaN-filled float tensors, so an unwritten output cannot pass."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        # Leave autograd leaves alone: torch.compile allocates some with requires_grad=True.
        if t.is_floating_point() and not t.requires_grad:
            t.fill_(float("nan"))
        return t

    def empty(*args, **kwargs):
        # A stand-in is not a factory torch's device context (``with torch.device("meta")``) knows, so it
        # passes the context's device on itself.
        if kwargs.get("device") is None:
            kwargs["device"] = torch.get_default_device()
        return poison(real_empty(*args, **kwargs))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One ComfyUI server for the session (host and browser tests), with the tiny random checkpoints in its
    model folders, and in its input folder two keyframe images, a tone, a short clip with a soundtrack and the
    images and sound the bundled workflows load."""
    import wave

    import numpy as np
    from comfy_host import ComfyServer
    from PIL import Image
    from tiny_checkpoints import write_tiny_checkpoints, write_tiny_text_encoder_file

    from h3_core.media.mp4 import write_mp4

    base = tmp_path_factory.mktemp("comfy")
    host = ComfyServer(base)
    # the test-only probes of the host's model management, installed beside the pack
    (host.base / "custom_nodes" / "h3_host_probe").symlink_to(ROOT / "tests" / "host" / "probe_nodes")
    host.tiny = write_tiny_checkpoints(host.models)
    host.text_encoder_file = write_tiny_text_encoder_file(host.models)  # ComfyUI's single-file layout
    rng = np.random.default_rng(0)
    for name, size in (("first.png", (96, 64)), ("last.png", (80, 48))):
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(host.input / name)
    t = torch.arange(40000) / 16000
    tone = (0.3 * torch.sin(2 * torch.pi * 330 * t)).clamp(-1, 1)
    with wave.open(str(host.input / "tone.wav"), "wb") as out:  # 2.5 s mono at 16 kHz: resampled to 32 kHz stereo
        out.setnchannels(1), out.setsampwidth(2), out.setframerate(16000)
        out.writeframes((tone * 32767).to(torch.int16).numpy().tobytes())
    # 17 frames at 30 fps: 13 at 24 fps, the shortest video reference, all of which the VAE encodes (a longer
    # clip costs minutes on the CPU)
    write_mp4(
        host.input / "clip.mp4", torch.rand(17, 48, 80, 3), 0.2 * torch.randn(2, 20000).clamp(-3, 3), 32000, fps=30
    )
    # the inputs the bundled workflows name
    for name in ("h3_first_frame.png", "h3_last_frame.png", "h3_reference_image.png"):
        Image.fromarray(rng.integers(0, 256, (120, 200, 3), dtype=np.uint8)).save(host.input / name)
    (host.input / "h3_reference_audio.wav").write_bytes((host.input / "tone.wav").read_bytes())
    host.start()
    yield host
    host.stop()


@pytest.fixture(scope="session")
def previewing_server(server, tmp_path_factory):
    """A second server on the session server's model and input folders and packs, started with the host's previews
    on (``--preview-method latent2rgb``)."""
    from comfy_host import ComfyServer

    host = ComfyServer.beside(server, tmp_path_factory.mktemp("comfy_previews"), ("--preview-method", "latent2rgb"))
    host.start()
    yield host
    host.stop()
