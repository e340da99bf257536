"""The suite and the pack work from a checkout whose folder name is no Python name, as packs are usually
cloned into ``custom_nodes/`` (``ComfyUI-H3-Hybrid``): the checkout's files (tracked, and new ones git does not
ignore) copied under that name, a slice of the suite run there in a fresh interpreter, and the pack imported
there as ComfyUI imports a folder."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLICE = ["tests/unit/test_import.py", "tests/unit/test_packaging.py", "tests/unit/test_geometry.py"]

# ComfyUI's nodes.load_custom_node imports a folder from its __init__.py under a module name of its own and
# the pack's relative imports resolve below that name: the folder's name in older hosts (comfyanonymous/ComfyUI
# nodes.py at e60e19b), its path with "." replaced by "_x_" in 0.3.75 (the host the tests run).
COMFYUI_IMPORT = textwrap.dedent(
    """
    import asyncio, importlib.util, os, sys
    module_path, naming, host = sys.argv[1:]
    sys.path.insert(0, host)
    import comfy.options
    comfy.options.enable_args_parsing(False)
    from comfy.cli_args import args
    args.cpu = True
    name = os.path.basename(module_path) if naming == "folder name" else module_path.replace(".", "_x_")
    spec = importlib.util.spec_from_file_location(name, os.path.join(module_path, "__init__.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    # the host's V3 registration: the entry point's extension lists the nodes
    extension = asyncio.run(module.comfy_entrypoint())
    print(sorted(node.GET_SCHEMA().node_id for node in asyncio.run(extension.get_node_list())))
    """
)
HOST = Path(os.environ.get("COMFYUI_PATH") or ROOT / ".host" / "comfyui-0.3.75")  # as comfy_host.py finds it


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True
    )
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout (git ls-files: {listed.stderr.decode().strip()})")
    copy = tmp_path_factory.mktemp("clone") / "ComfyUI-H3-Hybrid"
    for name in listed.stdout.decode().split("\0"):
        source = ROOT / name
        if name and source.is_file():  # a tracked file deleted in the work tree is left out
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    return copy


def test_a_slice_of_the_suite_passes_in_a_checkout_named_like_a_clone(checkout):
    proc = subprocess.run([sys.executable, "-m", "pytest", *SLICE], cwd=checkout, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, proc.stdout[-3000:]


@pytest.mark.parametrize("naming", ["folder name", "folder path"])
def test_comfyui_imports_the_pack_from_a_folder_named_like_a_clone(checkout, naming):
    if not (HOST / "main.py").is_file():
        pytest.fail(f"no ComfyUI at {HOST}: tests/run.sh installs it")
    proc = subprocess.run(
        [sys.executable, "-c", COMFYUI_IMPORT, str(checkout), naming, str(HOST)],
        cwd=checkout.parent,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "H3Sampler" in proc.stdout
