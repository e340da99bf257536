"""The models' state-dict shapes a new server's first checks need (``h3_core.formats.meta_shapes``): built on the
meta device, as a process without the kept files does, against read back from the folder the nodes keep them in
(``compile_cache/meta_shapes``), each in a fresh process, ``--reps`` times in turn, per model at its released
configuration (the DiT, its linear branch, both VAEs).

    python3 bench/meta_shapes.py --out bench/results/meta_shapes.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import record

# One process's first checks: every model's shapes, timed, the folder named as the nodes name theirs.
CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from h3_core.formats.meta_shapes import keep_on_disk, meta_shapes
from h3_core.formats.vdn import BranchWeights
from h3_core.models.audio_vae import AudioVAE, AudioVAEConfig
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.models.video_vae import VideoVAE, VideoVAEConfig
keep_on_disk(sys.argv[2])
seconds = {}
for name, build, cfg in (("dit", H3DiT, DiTConfig()), ("branch", BranchWeights, DiTConfig()),
                         ("video_vae", VideoVAE, VideoVAEConfig()), ("audio_vae", AudioVAE, AudioVAEConfig())):
    started = time.perf_counter()
    meta_shapes(build, cfg)
    seconds[name] = time.perf_counter() - started
print(json.dumps(seconds))
"""


def first_checks(folder: Path) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT), str(folder)], capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout.splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="h3_meta_shapes_"))
    rows = []
    try:
        for rep in range(args.reps):
            shutil.rmtree(folder, ignore_errors=True)
            rows.append(dict(rep=rep, variant="built (nothing kept)", seconds=first_checks(folder)))
            rows.append(dict(rep=rep, variant="read (kept by the process before)", seconds=first_checks(folder)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    medians = {}
    for variant in dict.fromkeys(row["variant"] for row in rows):
        runs = [row["seconds"] for row in rows if row["variant"] == variant]
        medians[variant] = {name: statistics.median(run[name] for run in runs) for name in runs[0]}
        medians[variant]["all"] = statistics.median(sum(run.values()) for run in runs)
    report = dict(record.header("meta_shapes.py", argv), rows=rows, medians=medians)
    print(record.write(report, args.out))
    return report


if __name__ == "__main__":
    main()
