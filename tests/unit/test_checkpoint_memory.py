"""Loading a DiT checkpoint holds it once (``h3_core.formats.checkpoints.load_h3_model``): resident memory rises by
at most
1.2 × the file's size, at its peak while loading and after every weight has been read once (a memory-mapped
tensor costs nothing until it is touched), measured in a fresh process on a synthetic checkpoint of about 2 GiB
in H3's layout (bf16 with the fp32 islands, smaller widths)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.models.precision import keeps_fp32

ROOT = Path(__file__).resolve().parents[2]
# 41 blocks of width 1024 (attention, FFN and AdaLN projection: about 52 MB each in bf16): about 2 GiB in all
CFG = dict(
    hidden=1024,
    layers=41,
    heads=8,
    head_dim=128,
    ffn=4096,
    text_dim=1024,
    freq_dim=256,
    time_hidden=1024,
    time_embed=512,
    rope_freqs=16,
)

# In a fresh process: resident memory (VmRSS, RssAnon, RssFile, bytes) before loading, its peak while loading
# and touching every weight (sampled every 2 ms), and after.
MEASURE = textwrap.dedent(
    """
    import json, sys
    import torch
    from h3_core.formats.checkpoints import load_h3_model
    from h3_core.models.dit import DiTConfig
    from resident_memory import peak_while, resident

    path, cfg = sys.argv[1], DiTConfig(**json.loads(sys.argv[2]))

    def load_and_touch():
        model = load_h3_model(path, cfg=cfg, dtype=torch.bfloat16)
        with torch.no_grad():
            return model, all(bool(torch.isfinite(p.sum())) for p in model.parameters())

    (model, finite), before, peak = peak_while(load_and_touch)  # the model held while "after" is read
    print(json.dumps(dict(before=before, peak=peak, after=resident(), finite=finite)))
    """
)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads resident memory from /proc")
def test_loading_a_checkpoint_holds_it_once(tmp_path):
    from safetensors.torch import save_file

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in H3DiT(DiTConfig(**CFG)).state_dict().items()}
    state = {
        k: torch.full(s, 0.01, dtype=torch.float32 if keeps_fp32(k) else torch.bfloat16) for k, s in shapes.items()
    }
    path = tmp_path / "dit.safetensors"
    save_file(state, str(path))
    del state
    size = path.stat().st_size
    assert size > 2 * 10**9
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), json.dumps(CFG)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")])),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    assert measured["finite"]
    before = measured["before"]["VmRSS"]
    assert (measured["peak"]["VmRSS"] - before) / size <= 1.2
    assert (measured["after"]["VmRSS"] - before) / size <= 1.2
    assert (measured["after"]["RssFile"] - measured["before"]["RssFile"]) / size >= 0.95  # every weight was read
