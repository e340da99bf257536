"""The bundled workflows in the host's own frontend, in headless Chromium: loaded as a drop loads them, no
missing node types, the frontend's API form equal to ours, queued from the page and finished; the saved mp4
carries the workflow, and dropping it back on the canvas loads it. Workflows saved with the earlier node inputs
(``earlier_workflows/``: the bundled ones as they were) load through the pack's migration into the current
graphs, and the FL2VA one runs."""

import base64
import json
import time
from pathlib import Path

import pytest
from comfy_host import error_message, mp4_files
from ui_to_api import EMBEDDED_FILES, EMBEDDED_SIZE, SIZED_NODES, to_api

playwright = pytest.importorskip("playwright.sync_api", reason="install the test requirements (tests/run.sh does)")

ROOT = Path(__file__).resolve().parents[2]
# the pack's own workflows; h3_vdn_native_* need a host with native H3 (0.30 or later), which the test host is not
WORKFLOWS = sorted(p for p in (ROOT / "workflows").glob("*.json") if "_native_" not in p.name)
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
def page(server):
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"no Chromium at {CHROMIUM}: the test command installs Debian's chromium package")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page()
        page.goto(server.url)
        page.wait_for_function(
            "window.app && window.app.graph && window.app.graph._nodes !== undefined", timeout=120_000
        )
        yield page
        browser.close()


def load(page, workflow):
    page.evaluate("async (w) => { await window.app.loadGraphData(w); }", workflow)
    return nodes_on_canvas(page)


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
def test_a_workflow_loads_and_converts_as_the_frontend_converts_it(server, page, path):
    loads_and_converts(server, page, path)


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
