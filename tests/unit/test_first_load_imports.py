"""A process's first model load stays light: building the DiT and the VAEs on the meta device and filling them
from their files imports neither dynamo nor sympy (on the meta device torch.arange and friends run through
torch._refs, whose first call imports both: about a second of a restarted server's first load). Run in a fresh
interpreter, since this test process may have imported them already."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_checkpoints import write_tiny_checkpoints

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys, torch
from h3_core.formats.audio_vae import load_audio_vae
from h3_core.formats.checkpoints import load_h3_model
from h3_core.formats.video_vae import load_video_vae
before = sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules)
load_h3_model(sys.argv[1], branch=sys.argv[2], dtype=torch.bfloat16, linears="fp8")
load_video_vae(sys.argv[3], device="cpu", dtype=torch.float32)
load_audio_vae(sys.argv[4], device="cpu")
print(json.dumps(dict(before=before, after=sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoints(tmp_path_factory.mktemp("models"))


def test_loading_the_models_imports_neither_dynamo_nor_sympy(tiny):
    files = [tiny.dit, tiny.linear_branch, tiny.video_vae, tiny.audio_vae]
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, *map(str, files)],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"before": [], "after": []}
