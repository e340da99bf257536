"""The README's first command ends in workflows/run_example.py: it prints the path of a playable mp4 with a
stereo soundtrack, made by a real ComfyUI server from the bundled FL2VA example."""

import subprocess
import sys
from pathlib import Path

from test_host_runs import check_mp4
from ui_to_api import EMBEDDED_SIZE

ROOT = Path(__file__).resolve().parents[2]


def test_the_example_run_prints_the_mp4_it_wrote(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "workflows" / "run_example.py"), "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tiny RANDOM checkpoints" in proc.stdout
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert path.parent == tmp_path / "run" / "output" / "H3" and path.name == "fl2va_00001.mp4"
    check_mp4(path, EMBEDDED_SIZE["length"], EMBEDDED_SIZE["width"], EMBEDDED_SIZE["height"])
