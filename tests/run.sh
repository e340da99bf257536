#!/usr/bin/env bash
# Set up a virtual environment from nothing (or reuse an up-to-date one) and run the whole test suite.
# Usage: bash tests/run.sh [pytest args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${H3_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
stamp="$venv/.h3-requirements"
want="$(cat requirements.txt tests/requirements.txt tests/host/requirements.txt tests/host/install_comfyui.sh | sha256sum | cut -c1-16)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setting up $venv"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    # torch 2.14.1 first, so the range in requirements.txt installs nothing newer.
    "$venv/bin/python" -m pip install -q "torch==2.14.1"
    "$venv/bin/python" -m pip install -q -r requirements.txt -r tests/requirements.txt
    # The host the host tests run the pack in: ComfyUI 0.3.75 (or COMFYUI_PATH) and its requirements.
    bash tests/host/install_comfyui.sh "$venv/bin/python"
    echo "$want" > "$stamp"
fi
exec "$venv/bin/python" -m pytest tests "$@"
