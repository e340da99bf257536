#!/usr/bin/env bash
# The minimum-version lane: the host tests (tests/host) in a second virtual environment holding only what a
# user's ComfyUI has once the pack is installed, with every requirement of the pack at its floor:
#   torch 2.14.1 and torchvision 0.29.1 (the host's own, installed first and held by the constraints),
#   ComfyUI 0.3.75's requirements less torch/torchvision/torchaudio (tests/host/install_comfyui.sh),
#   requirements.txt with each `name>=X` installed as `name==X` (a constraints file derived from it),
#   and pytest; nothing else (no test oracles, no pinned transformers).
# Set up from nothing when requirements.txt, this script or the host's install script changed (or on the first
# run), reused otherwise. Usage: bash tests/lanes/minimum.sh [pytest args...]: pytest runs tests/host, or the
# paths under it that the arguments name.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
venv="${H3_MIN_VENV:-$root/.venv-minimum}"
python="${PYTHON:-python3}"
stamp="$venv/.h3-minimum"
want="$(cat requirements.txt tests/lanes/minimum.sh tests/lanes/share_install.py tests/host/install_comfyui.sh | sha256sum | cut -c1-16)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setting up the minimum-version lane in $venv"
    # From nothing: a package left from an earlier set-up could be newer than a floor.
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    # The same torch and torchvision release as the main environment's: where that one holds them, their files
    # (5 GiB with the CUDA libraries) are hard-linked rather than copied a second time; pip installs the rest.
    main_venv="${H3_VENV:-$root/.venv}"
    if [ -x "$main_venv/bin/python" ]; then
        "$main_venv/bin/python" tests/lanes/share_install.py \
            "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
            "torch==2.14.1" "torchvision==0.29.1"
    fi
    "$venv/bin/python" -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
    floors="$venv/floors.txt"
    printf 'torch==2.14.1\ntorchvision==0.29.1\n' > "$floors"
    requirements="$(grep -v -E '^\s*(#|$)' requirements.txt)"
    while read -r requirement; do
        if [[ ! "$requirement" =~ ^([A-Za-z0-9._-]+)\>=([A-Za-z0-9._]+)$ ]]; then
            echo "requirements.txt: '$requirement' is not NAME>=VERSION, so the lane cannot install its floor" >&2
            exit 1
        fi
        echo "${BASH_REMATCH[1]}==${BASH_REMATCH[2]}" >> "$floors"
    done <<< "$requirements"
    bash tests/host/install_comfyui.sh "$venv/bin/python" -r requirements.txt -c "$floors" pytest
    "$venv/bin/python" -m pip check
    echo "$want" > "$stamp"
fi
names="torch torchvision $(grep -v -E '^\s*(#|$)' requirements.txt | sed -E 's/>=.*//')"
# shellcheck disable=SC2086
"$venv/bin/python" -c 'import sys, importlib.metadata as m
print("the lane runs with", *(f"{name}=={m.version(name)}" for name in sys.argv[1:]))' $names
for argument in "$@"; do
    [[ "$argument" == tests/host* ]] && exec "$venv/bin/python" -m pytest "$@"
done
# The example command's test checks the command itself (the main suite runs it); what it runs at the floors, the
# three workflows, the host tests here run too. The README's two commands in turn run the main suite's wheel test,
# which needs the test environment's build tools: the main suite runs them.
exec "$venv/bin/python" -m pytest tests/host --deselect tests/host/test_example_command.py \
    --deselect tests/host/test_readme_commands.py "$@"
