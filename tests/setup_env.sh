# Sourced by tests/run.sh and tests/run_example.sh: set up a virtual environment from nothing (or reuse
# an up-to-date one) with the pack's requirements, the test tools and the ComfyUI host; sets $venv.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${H3_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
stamp="$venv/.h3-requirements"
want="$(cd "$root" && cat requirements.txt tests/requirements.txt tests/host/requirements.txt tests/host/install_comfyui.sh | sha256sum | cut -c1-16)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ ! -f "$root/.host/comfyui-0.3.75/main.py" ]; then
    echo "setting up $venv"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    # torch 2.14.1 first: the host's part (requirements.txt names no torch, torchvision or torchaudio).
    "$venv/bin/python" -m pip install -q "torch==2.14.1"
    "$venv/bin/python" -m pip install -q -r "$root/requirements.txt" -r "$root/tests/requirements.txt"
    # The host the pack runs in here: ComfyUI 0.3.75 (or COMFYUI_PATH) and its requirements.
    bash "$root/tests/host/install_comfyui.sh" "$venv/bin/python" -r "$root/tests/host/requirements.txt"
    echo "$want" > "$stamp"
fi
# The browser tests drive Debian's Chromium (not a downloaded browser build).
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "installing Debian's chromium for the browser tests"
    ($sudo apt-get install -y -q chromium >/dev/null 2>&1 || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q chromium >/dev/null; }) \
        || echo "could not install chromium: the browser tests will say so"
fi
