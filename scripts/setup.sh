#!/usr/bin/env bash
# Install hybrid and its dependencies into the current Python environment.
#
#   scripts/setup.sh               the full set-up (`make setup`)
#   scripts/setup.sh --if-needed   nothing when scripts/ready.py finds this Python set up (hybrid installed
#                                  editable from this checkout after the last change to pyproject.toml or
#                                  setup.py, every dependency with the test extra present), else the full
#                                  set-up: what `make run` and `make test` call first, a fraction of a second
#                                  when everything is there
#
# torch comes first and is chosen for the machine: a CUDA build where an NVIDIA GPU is present,
# a CPU build otherwise (never the multi-GB CUDA wheels on a CPU-only machine). The package's
# own `torch>=…` requirement is then already satisfied, so `pip install -e .` adds nothing of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/versions.sh
source scripts/versions.sh
PY=${PYTHON:-python3}
if [[ "${1:-}" == "--if-needed" ]]; then
    if reason=$("$PY" scripts/ready.py 2>&1); then
        exit 0
    fi
    echo "setup: ${reason:-$PY cannot run scripts/ready.py}: installing"
fi
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
# the floor pyproject.toml declares ("torch>=X"): any torch at or above it is kept, whatever its build
TORCH_MIN=$(sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)

have_torch() {
    local v
    v=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null) && version_ge "$v" "${TORCH_MIN:-2.5}"
}

if have_torch; then
    echo "setup: torch $("$PY" -c 'import torch; print(torch.__version__)') already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found: installing the CUDA build of torch $TORCH_VERSION"
    "$PY" -m pip install "torch==$TORCH_VERSION"
else
    echo "setup: no GPU: installing the CPU build of torch $TORCH_VERSION"
    # A local CPU wheel (pip's find-links) or PyTorch's CPU index; never PyPI's CUDA build.
    "$PY" -m pip install "torch==$TORCH_VERSION+cpu" 2>/dev/null \
        || "$PY" -m pip install "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
fi
# A fresh checkout of an installed project (CI's clean clone) needs only its own editable link: without
# dependencies or an isolated build environment that takes seconds, not the ~25 s of resolving every
# requirement; whatever the link's metadata then finds missing gets the full install.
if ! { "$PY" -m pip install -q -e . --no-deps --no-build-isolation 2>/dev/null && "$PY" scripts/ready.py >/dev/null; }; then
    "$PY" -m pip install -e ".[test]"
fi
"$PY" -c "import torch, hybrid; print(f'setup: hybrid ready (torch {torch.__version__}, cuda={torch.cuda.is_available()})')"
