#!/usr/bin/env bash
# Set up everything (virtual environment, ComfyUI host) and run a bundled example (default: FL2VA) through a
# real ComfyUI server on the embedded default: tiny RANDOM checkpoints and generated test inputs written by this
# command (the clip is noise with the right shape, length and soundtrack). Prints each mp4's path.
# Usage: bash tests/run_example.sh [--workflow workflows/h3_t2va.json ...] [--out DIR]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source tests/setup_env.sh
exec "$venv/bin/python" tests/run_example.py "$@"
