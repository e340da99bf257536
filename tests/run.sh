#!/usr/bin/env bash
# Set up a virtual environment from nothing (or reuse an up-to-date one), check lint and formatting (ruff), run the
# whole test suite, then the minimum-version lane (tests/lanes/minimum.sh: the host tests again with every
# requirement at its floor).
# Usage: bash tests/run.sh [pytest args...]: with arguments, pytest runs them in the main environment only.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source tests/setup_env.sh
if [ "$#" -gt 0 ]; then
    exec "$venv/bin/python" -m pytest tests "$@"
fi
status=0
# Lint and formatting (pyproject.toml's [tool.ruff]: 120 columns) before the tests.
"$venv/bin/ruff" check . || status=$?
"$venv/bin/ruff" format --check . || status=$?
"$venv/bin/python" -m pytest tests || status=$?
bash tests/lanes/minimum.sh || status=$?
exit "$status"
