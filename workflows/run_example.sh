#!/usr/bin/env bash
# Set up everything (virtual environment, ComfyUI host) and run the bundled FL2VA example through a real
# ComfyUI server on the embedded default: tiny RANDOM checkpoints written by this command (the clip is noise
# with the right shape, length and soundtrack). Prints the mp4's path.
# Usage: bash workflows/run_example.sh [--workflow workflows/h3_t2va.json] [--out DIR]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source tests/setup_env.sh
exec "$venv/bin/python" workflows/run_example.py "$@"
