#!/usr/bin/env bash
# Set up a virtual environment from nothing (or reuse an up-to-date one) and run the whole test suite.
# Usage: bash tests/run.sh [pytest args...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source tests/setup_env.sh
exec "$venv/bin/python" -m pytest tests "$@"
