"""The README's two commands in one checkout, in either order, as a newcomer runs them: the example's run (its
server folder under ``out/example`` links back to the checkout) and then the tests, or the tests first. Each order
runs in a copy of the checkout's tracked files (with the main checkout's ComfyUI, ``COMFYUI_PATH``): the example
prints its mp4, the test that builds the pack's wheel from a copy of the checkout passes after it, and that test
leaves the checkout as it found it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from comfy_host import comfyui_root

ROOT = Path(__file__).resolve().parents[2]
PACKAGING = "tests/unit/test_packaging.py::test_the_installed_pack_gives_the_library_alone"


def checkout_copy(target: Path) -> Path:
    """The checkout's tracked and untracked-but-not-ignored files, copied to ``target``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (entry.decode() for entry in listed)):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def files_in(root: Path) -> set[str]:
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if "__pycache__" not in p.parts and ".pytest_cache" not in p.parts and not p.is_dir()
    }


def run(checkout: Path, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, COMFYUI_PATH=str(comfyui_root()))
    return subprocess.run([sys.executable, *args], cwd=checkout, env=env, capture_output=True, text=True)


def example(checkout: Path) -> None:
    proc = run(checkout, "tests/run_example.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (mp4,) = [Path(line) for line in proc.stdout.splitlines()]
    assert mp4.is_file() and mp4.is_relative_to(checkout / "out" / "example")
    assert (checkout / "out" / "example" / "custom_nodes" / "h3_hybrid").is_symlink()


def packaging(checkout: Path) -> None:
    before = files_in(checkout)
    proc = run(checkout, "-m", "pytest", "-q", "-p", "no:cacheprovider", PACKAGING)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert files_in(checkout) == before, "the test wrote into the checkout"


@pytest.mark.parametrize("order", [(example, packaging), (packaging, example)], ids=["example-first", "tests-first"])
def test_the_readmes_two_commands_in_either_order(tmp_path, order):
    checkout = checkout_copy(tmp_path / "checkout")
    for step in order:
        step(checkout)
