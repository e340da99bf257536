"""The bundled workflows in the host's own frontend, in headless Chromium: loaded as a drop loads them, no
missing node types, the frontend's API form equal to ours, queued from the page and finished; the saved mp4
carries the workflow, and dropping it back on the canvas loads it. Workflows saved with the earlier node inputs
(``earlier_workflows/``: the bundled ones as they were) load through the pack's migration into the current
graphs, and the FL2VA one runs.

Each bundled workflow, once loaded, is also drawn: a PNG of the whole graph, fitted to the window, is saved in the
test's own temporary folder and checked; with ``H3_UPDATE_SCREENSHOTS=1`` the PNGs are copied to
``docs/images/<workflow>.png``, the pictures the README shows. The native VDN-H3 workflows are only drawn (their host
nodes need a ComfyUI with native H3, which the test host is not): on a page of their own, where a host node the test
host lacks is drawn from the inputs ComfyUI 0.38 defines for it (``native_schema``) and the workflow's own values."""

import base64
import io
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from comfy_host import error_message, mp4_files
from native_schema import NATIVE_NODES
from PIL import Image
from ui_to_api import EMBEDDED_FILES, EMBEDDED_SIZE, SIZED_NODES, to_api

playwright = pytest.importorskip("playwright.sync_api", reason="install the test requirements (tests/run.sh does)")

ROOT = Path(__file__).resolve().parents[2]
# the pack's own workflows; h3_vdn_native_* need a host with native H3 (0.30 or later), which the test host is not
WORKFLOWS = sorted(p for p in (ROOT / "workflows").glob("*.json") if "_native_" not in p.name)
NATIVE = sorted(p for p in (ROOT / "workflows").glob("*.json") if "_native_" in p.name)
# where the README's pictures of the workflows live; written only when H3_UPDATE_SCREENSHOTS=1
IMAGES = ROOT / "docs" / "images"
EARLIER = sorted((Path(__file__).resolve().parent / "earlier_workflows").glob("*.json"))
CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def browser(server):
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"no Chromium at {CHROMIUM}: the test command installs Debian's chromium package")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield browser
        browser.close()


def open_frontend(server, browser):
    page = browser.new_page()
    page.goto(server.url)
    page.wait_for_function("window.app && window.app.graph && window.app.graph._nodes !== undefined", timeout=120_000)
    return page


@pytest.fixture(scope="module")
def page(server, browser):
    page = open_frontend(server, browser)
    yield page
    page.close()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory):
    """The test's own folder for the pictures (never the checkout, unless H3_UPDATE_SCREENSHOTS=1 asks for a copy)."""
    return tmp_path_factory.mktemp("screenshots")


def load(page, workflow):
    page.evaluate("async (w) => { await window.app.loadGraphData(w); }", workflow)
    return nodes_on_canvas(page)


# Everything drawn over the graph's canvas: the menus and side bars, dialogs (a missing model's), toasts, banners.
OVER_THE_CANVAS = (
    "body > *:not(#vue-app), .splitter-overlay-root, #comfyui-body-top, #comfyui-body-bottom "
    "{ display: none !important; }"
)
SHOT_WIDTH = 1600


def screenshot(page, path: Path, folder: Path) -> Path:
    """The loaded graph drawn whole: the window's height follows the graph's shape (1600 wide, 400 to 1200 high,
    never magnified), the graph fitted into it, nothing else over the canvas. The PNG (256 colours) goes to
    ``folder``; with H3_UPDATE_SCREENSHOTS=1 it is copied to docs/images/ as well. The page is left as it was."""
    bounds = page.evaluate(
        """() => {
        const title = window.LiteGraph.NODE_TITLE_HEIGHT;
        let x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity;
        for (const n of window.app.graph._nodes) {
            x0 = Math.min(x0, n.pos[0]); y0 = Math.min(y0, n.pos[1] - title);
            x1 = Math.max(x1, n.pos[0] + n.size[0]); y1 = Math.max(y1, n.pos[1] + n.size[1]);
        }
        return [x0, y0, x1, y1];
    }"""
    )
    margin = 40
    x0, y0, x1, y1 = bounds
    scale = min(1.0, SHOT_WIDTH / (x1 - x0 + 2 * margin))
    height = max(400, min(1200, round((y1 - y0 + 2 * margin) * scale)))
    viewport = page.viewport_size
    page.set_viewport_size({"width": SHOT_WIDTH, "height": height})
    style = page.add_style_tag(content=OVER_THE_CANVAS)
    view = page.evaluate(
        """([x0, y0, x1, y1, m]) => {
        const c = window.app.canvas, w = c.canvas.clientWidth, h = c.canvas.clientHeight;
        const before = {scale: c.ds.scale, offset: [...c.ds.offset], info: c.show_info};
        const s = Math.min(1, w / (x1 - x0 + 2 * m), h / (y1 - y0 + 2 * m));
        c.ds.scale = s;
        c.ds.offset = [(w / s - (x1 - x0)) / 2 - x0, (h / s - (y1 - y0)) / 2 - y0];
        c.show_info = false;
        c.setDirty(true, true);
        return before;
    }""",
        [*bounds, margin],
    )
    try:
        page.wait_for_timeout(300)  # a few frames: the canvas redraws on the next animation frame
        out = folder / f"{path.stem}.png"
        shot = page.screenshot()
    finally:
        page.evaluate(
            """(v) => {
            const c = window.app.canvas;
            c.ds.scale = v.scale; c.ds.offset = v.offset; c.show_info = v.info; c.setDirty(true, true);
        }""",
            view,
        )
        style.evaluate("s => s.remove()")
        page.set_viewport_size(viewport)
    # a graph on ComfyUI's dark canvas needs few colours: 256 of them keep every label sharp at a third of the bytes
    with Image.open(io.BytesIO(shot)) as image:
        image.convert("RGB").quantize(256, Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(out, optimize=True)
    check_png(out, (SHOT_WIDTH, height))
    if os.environ.get("H3_UPDATE_SCREENSHOTS") == "1":
        IMAGES.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, IMAGES / out.name)
    return out


def check_png(path: Path, size: tuple[int, int]):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert len(data) > 20_000, f"{path}: {len(data)} bytes, too few for a drawn graph"
    with Image.open(io.BytesIO(data)) as image:
        image.verify()
    with Image.open(io.BytesIO(data)) as image:
        assert image.size == size, f"{path}: {image.size}, the window was {size}"
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
        assert colours is None or len(colours) > 50, f"{path}: {len(colours)} colours, not a drawn graph"


def nodes_on_canvas(page):
    return page.evaluate(
        "() => window.app.graph._nodes.map(n => [n.type, !!(n.constructor && n.constructor.nodeData)])"
    )


def frontend_prompt(page):
    return page.evaluate("async () => (await window.app.graphToPrompt()).output")


def queue_on_tiny(server, page):
    """Set the embedded default on the widgets as a user would pick them, queue from the page, and wait."""
    page.evaluate(
        """([files, size, sized]) => {
        for (const node of window.app.graph._nodes) {
            const wanted = {...(files[node.type] || {}), ...(sized.includes(node.type) ? size : {})};
            for (const w of node.widgets || []) if (w.name in wanted) w.value = wanted[w.name];
        }
    }""",
        [EMBEDDED_FILES, EMBEDDED_SIZE, list(SIZED_NODES)],
    )
    before = set(server.get("/history"))
    page.evaluate("async () => { await window.app.queuePrompt(0); }")
    check = server.stall_check("the queued prompt never reached the history", 600)
    new = set()
    while not new:
        check()
        time.sleep(0.5)
        new = set(server.get("/history")) - before
    entry = server.wait(new.pop())
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    (path,) = mp4_files(entry, server.output)
    return path


# How the clip is written: the current workflows decode and save in one node, earlier ones in three (which stay).
WRITERS = {"H3VideoDecode", "H3AudioDecode", "H3SaveVideo", "H3DecodeAndSave"}


def shape(prompt, leave_out=()):
    """An API-form prompt without its node ids (and without the node types ``leave_out``): each node's type and
    widget values, and its links by the types of the nodes they come from."""

    def value(v):
        if isinstance(v, list):
            return ("link", prompt[v[0]]["class_type"], v[1])
        return int(v) if isinstance(v, float) and v.is_integer() else v  # JSON from the page has 3 for 3.0

    return sorted(
        json.dumps([node["class_type"], {k: value(v) for k, v in sorted(node["inputs"].items())}])
        for node in prompt.values()
        if node["class_type"] not in leave_out
    )


# Queued from the page: the workflows without reference media or a second sampler (Ref2VA's run, its image
# reference encoded at the released 2048 px whatever the canvas, is the slowest on a CPU, and the extend example
# samples twice; tests/host/test_example_command.py runs both from the same conversion, which the test below shows
# is the frontend's).
QUEUED = [p for p in WORKFLOWS if p.stem not in ("h3_ref2va", "h3_extend")]


def loads_and_converts(server, page, path):
    """``path`` loaded on the canvas as a drop loads it, every node type known, and the frontend's API prompt equal
    to ours (``ui_to_api``)."""
    workflow = json.loads(path.read_text())
    nodes = load(page, workflow)
    assert sorted(t for t, _ in nodes) == sorted(n["type"] for n in workflow["nodes"])
    assert [t for t, known in nodes if not known] == [], "missing node types"
    ours = to_api(workflow, server.object_info())
    assert {k: (v["class_type"], v["inputs"]) for k, v in frontend_prompt(page).items()} == {
        k: (v["class_type"], v["inputs"]) for k, v in ours.items()
    }
    return workflow


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.stem for p in WORKFLOWS])
def test_a_workflow_loads_and_converts_as_the_frontend_converts_it(server, page, path, screenshots):
    loads_and_converts(server, page, path)
    screenshot(page, path, screenshots)


@pytest.mark.parametrize("path", QUEUED, ids=[p.stem for p in QUEUED])
def test_a_workflow_runs_from_the_page_and_comes_back_from_its_mp4(server, page, path):
    workflow = loads_and_converts(server, page, path)
    mp4 = queue_on_tiny(server, page)
    page.evaluate("async () => { await window.app.loadGraphData({nodes: [], links: [], version: 0.4}); }")
    assert nodes_on_canvas(page) == []
    # the saved clip dropped back on the canvas: the frontend reads the workflow from its metadata
    page.evaluate(
        """async (b64) => {
        const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
        await window.app.handleFile(new File([bytes], 'clip.mp4', {type: 'video/mp4'}));
    }""",
        base64.b64encode(mp4.read_bytes()).decode(),
    )
    page.wait_for_function("window.app.graph._nodes.length > 0", timeout=60_000)
    assert sorted(t for t, _ in nodes_on_canvas(page)) == sorted(n["type"] for n in workflow["nodes"])


@pytest.mark.parametrize("path", EARLIER, ids=[p.stem for p in EARLIER])
def test_a_workflow_saved_with_the_earlier_inputs_is_migrated_and_runs(server, page, path):
    earlier = json.loads(path.read_text())
    nodes = load(page, earlier)
    assert [t for t, known in nodes if not known] == [], "missing node types"
    types = sorted(t for t, _ in nodes)
    assert types.count("H3Canvas") == 1 and "H3LoraList" not in types
    current = json.loads((ROOT / "workflows" / path.name).read_text())
    # the files a user picked stay theirs (the bundled Ref2VA graph names another checkpoint since)
    (saved,) = [n for n in earlier["nodes"] if n["type"] == "H3DiTLoader"]
    for node in current["nodes"]:
        if node["type"] == "H3DiTLoader":
            node["widgets_values"][:2] = saved["widgets_values"][:2]
    assert shape(frontend_prompt(page), WRITERS) == shape(to_api(current, server.object_info()), WRITERS)
    if path.stem == "h3_fl2va":  # the migrated graphs equal the current ones; one of them runs from the page
        assert queue_on_tiny(server, page).is_file()


def widget_spec(value):
    """A host node's widget, as a node definition gives it, from the value a workflow stores for it."""
    if isinstance(value, bool):
        return ["BOOLEAN", {"default": value}]
    if isinstance(value, int):
        return ["INT", {"default": value, "min": -(2**53), "max": 2**53}]
    if isinstance(value, float):
        return ["FLOAT", {"default": value, "min": -1e9, "max": 1e9, "step": 0.01}]
    if isinstance(value, str) and (" " in value or len(value) > 40):
        return ["STRING", {"default": value, "multiline": True}]
    return [[value], {}]


# each host node's sockets with the types the native workflows give them (one workflow may leave some unconnected)
SOCKETS: dict[str, dict[str, str]] = {}
for _path in NATIVE:
    for _node in json.loads(_path.read_text())["nodes"]:
        SOCKETS.setdefault(_node["type"], {}).update({i["name"]: i["type"] for i in _node.get("inputs", [])})


def drawn_as(node: dict) -> dict:
    """A definition to draw a host node the test host lacks: its inputs in ComfyUI 0.38's order
    (``native_schema``), the sockets with the types the native workflows give them, the widgets with this
    workflow's values."""
    _, inputs, _ = NATIVE_NODES[node["type"]]
    sockets = SOCKETS[node["type"]]
    values = iter(node.get("widgets_values", []))
    required = {}
    for name, kind in inputs:
        if kind == "widget":
            required[name] = widget_spec(next(values))
        elif name in sockets:
            required[name] = [sockets[name], {}]
    outputs = node.get("outputs", [])
    return {
        "name": node["type"],
        "display_name": node["type"],
        "category": "drawn only",
        "description": "",
        "python_module": "nodes",
        "input": {"required": required},
        "output": [o["type"] for o in outputs],
        "output_is_list": [False] * len(outputs),
        "output_name": [o["name"] for o in outputs],
        "output_node": False,
    }


@pytest.fixture(scope="module")
def native_page(server, browser):
    """A page of its own: the host nodes drawn here stay out of the page the other tests use."""
    page = open_frontend(server, browser)
    yield page
    page.close()


@pytest.mark.parametrize("path", NATIVE, ids=[p.stem for p in NATIVE])
def test_a_native_vdn_workflow_is_drawn(native_page, path, screenshots):
    workflow = json.loads(path.read_text())
    types = sorted({n["type"] for n in workflow["nodes"]})
    lacking = native_page.evaluate("(ts) => ts.filter(t => !(t in window.LiteGraph.registered_node_types))", types)
    # only the host's own nodes may be missing (ComfyUI 0.3.75 has no native H3), never the pack's
    assert set(lacking) <= set(NATIVE_NODES), f"missing node types: {lacking}"
    definitions = {n["type"]: drawn_as(n) for n in workflow["nodes"] if n["type"] in lacking}
    native_page.evaluate(
        "async (defs) => { for (const [k, d] of Object.entries(defs)) await window.app.registerNodeDef(k, d); }",
        definitions,
    )
    nodes = load(native_page, workflow)
    assert sorted(t for t, _ in nodes) == sorted(n["type"] for n in workflow["nodes"])
    assert [t for t, known in nodes if not known] == [], "node types still missing"
    screenshot(native_page, path, screenshots)
