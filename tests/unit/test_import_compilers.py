"""h3_core.triton_forms.import_compilers: what the compiled paths import on a process's first compiled run,
imported ahead of it (the pack does it on a thread while the server starts). Run in a fresh interpreter, since
this test process has imported them already."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
from h3_core.triton_forms import import_compilers
before = "torch._inductor.compile_fx" in sys.modules
seconds = import_compilers(("torch._inductor.compile_fx", "h3_missing_package.part", "h3_broken_module"))
print(json.dumps(dict(before=before, after="torch._inductor.compile_fx" in sys.modules, seconds=seconds)))
"""


def test_imports_what_is_there_and_skips_what_is_not(tmp_path):
    (tmp_path / "h3_broken_module.py").write_text("raise RuntimeError('this module does not import here')\n")
    env_path = f"{ROOT}:{tmp_path}"
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert not report["before"] and report["after"]
    seconds = report["seconds"]
    assert seconds["torch._inductor.compile_fx"] > 0
    assert seconds["h3_missing_package.part"] is None and seconds["h3_broken_module"] is None


LAUNCH = """
import json, torch
from h3_core.triton_forms import launch_once
print(json.dumps(dict(cpu=launch_once("cpu"), meta=launch_once("meta"))))
"""


def test_one_trivial_kernel_is_launched_ahead_and_checked():
    """Under Triton's CPU interpreter the kernel runs on a CPU tensor (on CUDA the server's start thread runs it
    there); a device it cannot launch on gives None."""
    result = subprocess.run(
        [sys.executable, "-c", LAUNCH],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1"},
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["cpu"] is not None and report["cpu"] > 0
    assert report["meta"] is None
    plain = subprocess.run(
        [sys.executable, "-c", LAUNCH], capture_output=True, text=True, check=True, env={"PYTHONPATH": str(ROOT)}
    )
    assert json.loads(plain.stdout.strip().splitlines()[-1]) == {"cpu": None, "meta": None}
