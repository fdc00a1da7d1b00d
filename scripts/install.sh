#!/usr/bin/env bash
# Installs mempath (editable) into the active Python, with the PyTorch build this machine
# can use: PyPI's default (CUDA) build where there is an NVIDIA GPU, the CPU build where
# there is none. A plain `torch` requirement on Linux resolves to the CUDA build, whose
# ~3 GB of CUDA libraries a machine without a GPU never uses.
#
#   scripts/install.sh              mempath itself
#   scripts/install.sh serve,test   with extras (pyproject.toml's optional-dependencies)
#
# A torch that is already installed is kept: install the build you want first to choose
# it yourself. MEMPATH_TORCH=cpu or MEMPATH_TORCH=cuda overrides the GPU detection (e.g. to
# build a GPU image on a machine without one).
set -euo pipefail
cd "$(dirname "$0")/.."

extras=${1:-}
python=${PYTHON:-python3}
cpu_index=https://download.pytorch.org/whl/cpu
# Where the CPU index cannot be reached, the CPU build CI tests (.ci/run), which pip can
# still find where a mirror or a local wheel provides it.
cpu_fallback="torch==2.13.0+cpu"

say() { echo "install.sh: $*" >&2; }

has_nvidia_gpu() {
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
        return 0
    fi
    compgen -G '/dev/nvidia[0-9]*' >/dev/null
}

reachable() {
    "$python" - "$1" <<'PY'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=10).close()
except Exception:
    sys.exit(1)
PY
}

install_cpu_torch() {
    if reachable "$cpu_index/torch/"; then
        say "no NVIDIA GPU: installing the CPU build of torch from $cpu_index"
        "$python" -m pip install torch --index-url "$cpu_index"
        return
    fi
    say "no NVIDIA GPU, and $cpu_index is unreachable: trying $cpu_fallback from pip's own indexes"
    if ! "$python" -m pip install "$cpu_fallback"; then
        say "no CPU build of torch found. Install one (pip install torch --index-url $cpu_index)" \
            "and run this again; a plain 'pip install torch' here pulls the CUDA build (~3 GB)"
        return 1
    fi
}

if "$python" -c "import torch" 2>/dev/null; then
    say "keeping the installed torch: $("$python" -c 'import torch; print(torch.__version__)')"
else
    want=${MEMPATH_TORCH:-}
    if [ -z "$want" ]; then
        if [ "$(uname -s)" != Linux ] || has_nvidia_gpu; then want=default; else want=cpu; fi
    fi
    case "$want" in
        cpu) install_cpu_torch ;;
        cuda | default) say "installing torch from PyPI (its default build: CUDA on Linux)" ;;
        *) say "MEMPATH_TORCH must be cpu or cuda, got '$want'"; exit 2 ;;
    esac
fi

"$python" -m pip install -e ".${extras:+[$extras]}"
