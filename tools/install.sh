#!/usr/bin/env bash
# Installs fusedloss for a user, from this checkout, in editable mode, with what the README's examples, tests and
# main job use (pytest, Triton, matplotlib, transformers, TRL, accelerate, datasets, peft).
# Run it inside the virtualenv you want it in:  bash tools/install.sh
# A contributor's set-up (the CUDA extension on a machine without a GPU, CUTLASS headers, the Tritons of the
# compile check, the frameworks' virtualenv) is tools/dev_setup.sh, which runs this script first.
#
# torch: an installed torch is kept. Otherwise torch==2.13.0 is installed, the version every test, benchmark
# table and TRL/transformers parity check in the README was run with (the package itself needs torch>=2.8, and
# the main job compares against torch 2.13's F.linear_cross_entropy). Without an NVIDIA driver (no
# nvidia-smi) it is the CPU build: from a local wheelhouse pip already knows (find-links) if it has one, else
# from the PyTorch CPU index ($TORCH_INDEX_URL), so that a CPU machine never downloads the multi-GB CUDA build.
#
# The CUDA extension: built when a GPU is present and nvcc is found; FUSEDLOSS_CUDA=1 builds it anyway (and
# fails without nvcc), FUSEDLOSS_CUDA=0 never. Without it the torch and Triton backends remain.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
TORCH_VERSION=2.13.0
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
pip_install() { "$PYTHON" -m pip install -q --disable-pip-version-check "$@"; }
say() { echo "fusedloss install [$(( $(date +%s) - start ))s]: $*"; }
start=$(date +%s)

gpu=0
if command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1; then gpu=1; fi

if "$PYTHON" -c "import torch" 2>/dev/null; then
    say "keeping the installed torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
elif [ "$gpu" = 1 ]; then
    say "torch==$TORCH_VERSION (CUDA build: an NVIDIA driver is present; a few GB, a few minutes)"
    pip_install "torch==$TORCH_VERSION"
else
    say "torch==$TORCH_VERSION, CPU build (no NVIDIA driver found)"
    if pip_install --no-deps --no-index "torch==$TORCH_VERSION" 2>/dev/null; then
        pip_install "torch==$TORCH_VERSION"  # the local wheel's dependencies, from the configured index
    else
        pip_install "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
    fi
fi

# The CUDA extension is compiled by setup.py when FUSEDLOSS_CUDA=1, or unset with nvcc found (the same places it
# looks). A user without a GPU gets no compile: FUSEDLOSS_CUDA=0 unless the caller set it.
nvcc=""
for candidate in "${CUDA_HOME:-${CUDA_PATH:-}}/bin/nvcc" /usr/local/cuda/bin/nvcc /usr/local/bin/nvcc "$(command -v nvcc || true)"; do
    if [ -x "$candidate" ] && [ ! -d "$candidate" ]; then nvcc=$candidate; break; fi
done
if [ -z "${FUSEDLOSS_CUDA:-}" ] && [ "$gpu" = 0 ]; then
    export FUSEDLOSS_CUDA=0
    say "no GPU: the CUDA extension is not built (FUSEDLOSS_CUDA=1 bash tools/install.sh builds it anyway)"
elif [ "${FUSEDLOSS_CUDA:-}" = "0" ]; then
    say "FUSEDLOSS_CUDA=0: the CUDA extension is skipped (the Triton and torch backends remain)"
elif [ -n "$nvcc" ]; then
    say "compiling the CUDA extension with $nvcc (a few minutes on 2 cores; FUSEDLOSS_CUDA=0 skips it)"
else
    say "no nvcc found: the CUDA extension is not built (the Triton and torch backends remain)"
fi

# Build with this environment's tools (no isolated build environment to download, no second compile).
# setuptools >= 77 reads pyproject.toml's SPDX licence string; a fresh virtualenv may hold an older one, which
# `-U` replaces. Below 82: torch 2.11 (the H100/H200 images' torch) requires setuptools<82.
say "fusedloss and its extras (test, bench, integrations)"
pip_install -U "setuptools>=77,<82" wheel "pybind11>=2.12" ninja
pip_install --no-build-isolation -e ".[test,bench,integrations]"
"$PYTHON" -c "import fusedloss; print('fusedloss install: backends:', fusedloss.backend_status())"
say "done"
