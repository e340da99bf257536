"""Importing the core and the pack needs no ComfyUI and touches no GPU (checked in a fresh interpreter)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = textwrap.dedent(
    """
    import importlib.abc, importlib.util, json, sys

    BLOCKED = {"comfy", "folder_paths", "nodes", "server", "comfy_extras"}

    class NoComfy(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"blocked in this test: {name}")
            return None

    sys.meta_path.insert(0, NoComfy())
    for name in BLOCKED:
        try:
            __import__(name)
        except ImportError:
            pass
        else:
            raise SystemExit(f"the blocker let {name} through")
    result = {}
    """
)

CORE = PRELUDE + textwrap.dedent(
    """
    import h3_core, h3_core.attention
    import torch
    result["cuda_initialized"] = torch.cuda.is_initialized()
    result["exports"] = sorted(h3_core.attention.__all__)
    result["comfy_modules"] = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    print("RESULT " + json.dumps(result))
    """
)

PACK = PRELUDE + textwrap.dedent(
    """
    root = sys.argv[1]
    path_before = list(sys.path)
    spec = importlib.util.spec_from_file_location(
        "h3_hybrid", root + "/__init__.py", submodule_search_locations=[root]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["h3_hybrid"] = module
    spec.loader.exec_module(module)
    import torch
    result["cuda_initialized"] = torch.cuda.is_initialized()
    import inspect
    result["entrypoint"] = inspect.iscoroutinefunction(module.comfy_entrypoint)
    result["web"] = module.WEB_DIRECTORY
    result["path_changed"] = sys.path != path_before
    import h3_hybrid.h3_core.media.mp4
    result["library"] = sorted(m.split(".")[0] for m in sys.modules if m.split(".")[-1] == "mp4" and "h3" in m)
    result["comfy_modules"] = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    print("RESULT " + json.dumps(result))
    """
)


def run(script):
    proc = subprocess.run([sys.executable, "-c", script, str(ROOT)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout + proc.stderr
    return json.loads(lines[-1][len("RESULT ") :])


def test_core_imports_without_comfyui_or_cuda():
    result = run(CORE)
    assert result["cuda_initialized"] is False
    assert result["comfy_modules"] == []
    assert "window_softmax" in result["exports"] and "dense_attention" in result["exports"]


def test_pack_root_exposes_its_entrypoint_without_the_host_or_cuda():
    """The host's V3 entry point is there; the nodes (which need the host) are imported only when it is called."""
    result = run(PACK)
    assert result["entrypoint"] is True
    assert (ROOT / result["web"] / "h3_migrate.js").is_file()
    assert result["cuda_initialized"] is False
    assert result["comfy_modules"] == []
    assert result["path_changed"] is False  # nothing of the pack becomes a top-level name in the host
    assert result["library"] == ["h3_hybrid"]  # the library loads as the pack's own subpackage
