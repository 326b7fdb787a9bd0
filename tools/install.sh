#!/usr/bin/env bash
# Installs fusedloss from this checkout, in editable mode, with everything the README's examples, tests and
# benchmark use (pytest, Triton, matplotlib, transformers, TRL, accelerate, datasets, peft).
# Run it inside the virtualenv you want it in:  bash tools/install.sh
#
# torch: an installed torch is kept. Otherwise torch==2.13.0 is installed, the version every test, benchmark
# table and TRL/transformers parity check in the README was run with (the package itself needs torch>=2.8, and
# the benchmark compares against torch 2.13's F.linear_cross_entropy). Without an NVIDIA driver (no
# nvidia-smi) it is the CPU build: from a local wheelhouse pip already knows (find-links) if it has one, else
# from the PyTorch CPU index ($TORCH_INDEX_URL), so that a CPU machine never downloads the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
TORCH_VERSION=2.13.0
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
pip_install() { "$PYTHON" -m pip install -q --disable-pip-version-check "$@"; }

if "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "fusedloss install: keeping the installed torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1; then
    echo "fusedloss install: torch==$TORCH_VERSION (CUDA build: an NVIDIA driver is present)"
    pip_install "torch==$TORCH_VERSION"
else
    echo "fusedloss install: torch==$TORCH_VERSION, CPU build (no NVIDIA driver found)"
    if pip_install --no-deps --no-index "torch==$TORCH_VERSION" 2>/dev/null; then
        pip_install "torch==$TORCH_VERSION"  # the local wheel's dependencies, from the configured index
    else
        pip_install "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
    fi
fi

# The CUDA extension is compiled by nvcc whenever setup.py finds one (the same places it looks), GPU or not.
nvcc=""
for candidate in "${CUDA_HOME:-${CUDA_PATH:-}}/bin/nvcc" /usr/local/cuda/bin/nvcc /usr/local/bin/nvcc "$(command -v nvcc || true)"; do
    if [ -x "$candidate" ] && [ ! -d "$candidate" ]; then nvcc=$candidate; break; fi
done
if [ "${FUSEDLOSS_CUDA:-}" = "0" ]; then
    echo "fusedloss install: FUSEDLOSS_CUDA=0: the CUDA extension is skipped (the Triton and torch backends remain)"
elif [ -n "$nvcc" ]; then
    echo "fusedloss install: compiling the CUDA extension with $nvcc (a few minutes on 2 cores);" \
         "FUSEDLOSS_CUDA=0 bash tools/install.sh skips it"
else
    echo "fusedloss install: no nvcc found: the CUDA extension is not built (the Triton and torch backends remain)"
fi

# Build with this environment's tools (no isolated build environment to download, no second compile).
# setuptools >= 77 reads pyproject.toml's SPDX licence string; a fresh virtualenv may hold an older one, which
# `-U` replaces. Below 82: torch 2.11 (the H100/H200 images' torch) requires setuptools<82.
pip_install -U "setuptools>=77,<82" wheel "pybind11>=2.12" ninja
pip_install --no-build-isolation -e ".[test,bench,integrations]"
"$PYTHON" -c "import fusedloss; print('fusedloss install: backends:', fusedloss.backend_status())"

# The CUTLASS 3 headers (a 6 MB wheel; its Python interface and dependencies are not needed): the compile-only
# epilogue prototype of csrc/prototypes/ is built with them (tests/test_cutlass_prototype.py). The library never
# uses them.
pip_install --no-deps "nvidia-cutlass==4.2.0.0"

# The oldest supported Triton and the H200 images' version (about 170 MB each), beside the newest installed
# above: the compile check builds every Triton kernel variant for sm_90a with each (tools/triton_versions.py).
"$PYTHON" tools/triton_versions.py install

# A second virtualenv for the frameworks whose pins conflict with TRL's (verl, OpenRLHF), where present.
if [ -f tools/frameworks_env.sh ]; then
    bash tools/frameworks_env.sh
fi
