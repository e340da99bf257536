"""Live previews through a real ComfyUI server: with the host's previews on (``--preview-method latent2rgb``) the
sampler sends one preview image per step through the host's own previewer; with previews off (the host's
default) it sends none."""

import io

from comfy_host import error_message
from graphs import generation
from PIL import Image


def previews_of(server, prompt):
    events = list(server.events(prompt))
    assert events[-1][0] == "execution_success", error_message({"status": {"messages": events}})
    steps = [data for kind, data in events if kind == "progress" and data.get("node") == "7"]
    return [data for kind, data in events if kind == "preview"], steps


def test_one_preview_per_step_when_the_host_sends_previews(previewing_server):
    previews, steps = previews_of(previewing_server, generation(prefix="H3/previewed", length=22, steps=3))
    assert [s["value"] for s in steps] == [1, 2, 3], steps  # the bar moves once per step
    assert len(previews) == 3, len(previews)
    # the host's preview event: the image type (1: JPEG) and the JPEG, a latent frame of the 64x32 canvas (4x2),
    # which the host scales to its preview size
    kind = int.from_bytes(previews[-1][:4], "big")
    image = Image.open(io.BytesIO(previews[-1][4:]))
    assert kind == 1 and image.format == "JPEG" and image.size[0] == 2 * image.size[1]


def test_no_previews_when_the_host_sends_none(server):
    previews, steps = previews_of(server, generation(prefix="H3/not_previewed", length=22, steps=2))
    assert previews == [] and [s["value"] for s in steps] == [1, 2]
