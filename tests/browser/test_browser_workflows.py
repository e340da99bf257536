"""The bundled workflows in the host's own frontend, in headless Chromium: loaded as a drop loads them, no
missing node types, the frontend's API form equal to ours, queued from the page and finished."""

import json
import time
from pathlib import Path

import pytest

from comfy_host import error_message, mp4_files
from ui_to_api import EMBEDDED_FILES, EMBEDDED_SIZE, to_api

playwright = pytest.importorskip("playwright.sync_api", reason="install the test requirements (tests/run.sh does)")

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((ROOT / "workflows").glob("*.json"))
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def page(server):
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"no Chromium at {CHROMIUM}: the test command installs Debian's chromium package")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page()
        page.goto(server.url)
        page.wait_for_function("window.app && window.app.graph && window.app.graph._nodes !== undefined", timeout=120_000)
        yield page
        browser.close()


def load(page, workflow):
    page.evaluate("async (w) => { await window.app.loadGraphData(w); }", workflow)
    return page.evaluate("() => window.app.graph._nodes.map(n => [n.type, !!(n.constructor && n.constructor.nodeData)])")


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.stem for p in WORKFLOWS])
def test_a_workflow_loads_converts_and_runs_in_the_frontend(server, page, path):
    workflow = json.loads(path.read_text())
    nodes = load(page, workflow)
    assert sorted(t for t, _ in nodes) == sorted(n["type"] for n in workflow["nodes"])
    assert [t for t, known in nodes if not known] == [], "missing node types"
    frontend = page.evaluate("async () => (await window.app.graphToPrompt()).output")
    ours = to_api(workflow, server.object_info())
    assert {k: (v["class_type"], v["inputs"]) for k, v in frontend.items()} == \
           {k: (v["class_type"], v["inputs"]) for k, v in ours.items()}
    # the embedded default, set on the widgets as a user would pick them
    page.evaluate("""([files, size]) => {
        for (const node of window.app.graph._nodes) {
            const wanted = {...(files[node.type] || {}), ...((node.type === 'H3Sampler' || node.type === 'H3TextEncode') ? size : {})};
            for (const w of node.widgets || []) if (w.name in wanted) w.value = wanted[w.name];
        }
    }""", [EMBEDDED_FILES, EMBEDDED_SIZE])
    before = set(server.get("/history"))
    page.evaluate("async () => { await window.app.queuePrompt(0); }")
    deadline = time.monotonic() + 300
    new = set()
    while not new and time.monotonic() < deadline:
        time.sleep(0.5)
        new = set(server.get("/history")) - before
    assert new, "the queued prompt never reached the history"
    entry = server.wait(new.pop())
    assert entry["status"]["status_str"] == "success", error_message(entry) + server.log_tail()
    assert len(mp4_files(entry, server.output)) == 1
