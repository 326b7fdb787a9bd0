#!/usr/bin/env bash
# Installs fusedloss for a user, from this checkout, in editable mode. Run it inside the virtualenv you want it in.
#   bash tools/install.sh            # the library and what the main job (benchmarks/tour.py) uses: torch, numpy,
#                                    # matplotlib; Triton too on a machine with an NVIDIA driver
#   bash tools/install.sh --tests    # then what the tests and examples import: the `test` and `integrations`
#                                    # extras (pytest, pytest-xdist, hypothesis, Triton, transformers, TRL,
#                                    # accelerate, datasets, peft, DeepSpeed); the installed torch is kept
# A contributor's set-up (the CUDA extension on a machine without a GPU, CUTLASS headers, the Tritons of the
# compile check, the frameworks' virtualenv) is tools/dev_setup.sh, which runs `install.sh --tests` first.
#
# torch: an installed torch is kept, and pinned for every later install, so that no extra replaces it.
# Otherwise torch==2.13.0 is installed, the version every test, benchmark table and TRL/transformers parity
# check in the README was run with (the package itself needs torch>=2.8, and the main job compares against torch
# 2.13's F.linear_cross_entropy). Without an NVIDIA driver (no nvidia-smi) it is the CPU build: from a local
# wheelhouse pip already knows (find-links) if it has one, else from the PyTorch CPU index ($TORCH_INDEX_URL), so
# that a CPU machine never downloads the multi-GB CUDA build.
#
# Size: on a CPU the user install is the CPU torch (750 MB of the environment), numpy and matplotlib, installed
# without byte-compiling every module (pip --no-compile: Python compiles the modules a program imports, when it
# imports them), which keeps the environment under 1 GB. Triton (about 1 GB) is left out there: the torch backend
# is the default on a CPU, and Triton's kernels need a GPU or its interpreter (which the tests use).
#
# The CUDA extension: built when a GPU is present and nvcc is found; FUSEDLOSS_CUDA=1 builds it anyway (and
# fails without nvcc), FUSEDLOSS_CUDA=0 never. Without it the torch and Triton backends remain.
set -euo pipefail
cd "$(dirname "$0")/.."
tests=0
case "${1:-}" in
    "") ;;
    --tests) tests=1 ;;
    *) echo "usage: bash tools/install.sh [--tests]" >&2; exit 2 ;;
esac
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
    if pip_install --no-compile --no-deps --no-index "torch==$TORCH_VERSION" 2>/dev/null; then
        pip_install --no-compile "torch==$TORCH_VERSION"  # the local wheel's dependencies, from the configured index
    else
        pip_install --no-compile "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
    fi
fi
# Every install below names the installed torch exactly: an extra that asks for another one (a CUDA build from
# PyPI) fails the install instead of replacing it.
torch_pin="torch==$("$PYTHON" -c "from importlib.metadata import version; print(version('torch'))")"

# The extras' requirements, read from pyproject.toml: `--tests` adds them without rebuilding a fusedloss already
# installed from this checkout (the CUDA extension tools/dev_setup.sh built stays as it is).
extras=bench
if [ "$gpu" = 1 ]; then extras=bench,triton; fi
if [ "$tests" = 1 ]; then extras=$extras,test,integrations; fi
installed_here=$("$PYTHON" - <<'PY'
import json
import os
from importlib import metadata
from urllib.parse import unquote, urlparse

try:
    url = json.loads(metadata.distribution("fusedloss").read_text("direct_url.json") or "{}").get("url", "")
except metadata.PackageNotFoundError:
    url = ""
here = url.startswith("file:") and os.path.realpath(unquote(urlparse(url).path)) == os.path.realpath(".")
print(int(here))
PY
)
if [ "$tests" = 1 ] && [ "$installed_here" = 1 ]; then
    say "the installed fusedloss is this checkout's: adding the extras $extras"
    mapfile -t requirements < <("$PYTHON" - "$extras" <<'PY'
import sys

try:
    import tomllib
except ImportError:  # Python 3.10: pip's own copy of the same parser
    from pip._vendor import tomli as tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
wanted = project["dependencies"] + [r for extra in sys.argv[1].split(",")
                                    for r in project["optional-dependencies"][extra]]
print("\n".join(dict.fromkeys(wanted)))
PY
)
    pip_install --no-build-isolation "$torch_pin" "${requirements[@]}"
    "$PYTHON" -c "import fusedloss; print('fusedloss install: backends:', fusedloss.backend_status())"
    say "done"
    exit 0
fi

# The CUDA extension is compiled by setup.py when FUSEDLOSS_CUDA=1, or unset with nvcc found (the same places it
# looks). A user without a GPU gets no compile: FUSEDLOSS_CUDA=0 unless the caller set it.
nvcc=""
for candidate in "${CUDA_HOME:-${CUDA_PATH:-}}/bin/nvcc" /usr/local/cuda/bin/nvcc /usr/local/bin/nvcc "$(command -v nvcc || true)"; do
    if [ -x "$candidate" ] && [ ! -d "$candidate" ]; then nvcc=$candidate; break; fi
done
build_tools=()
if [ -z "${FUSEDLOSS_CUDA:-}" ] && [ "$gpu" = 0 ]; then
    export FUSEDLOSS_CUDA=0
    say "no GPU: the CUDA extension is not built (FUSEDLOSS_CUDA=1 bash tools/install.sh builds it anyway)"
elif [ "${FUSEDLOSS_CUDA:-}" = "0" ]; then
    say "FUSEDLOSS_CUDA=0: the CUDA extension is skipped (the Triton and torch backends remain)"
elif [ -n "$nvcc" ]; then
    say "compiling the CUDA extension with $nvcc (a few minutes on 2 cores; FUSEDLOSS_CUDA=0 skips it)"
    build_tools=("pybind11>=2.12" ninja)
else
    say "no nvcc found: the CUDA extension is not built (the Triton and torch backends remain)"
fi

# Build with this environment's tools (no isolated build environment to download, no second compile).
# setuptools >= 77 reads pyproject.toml's SPDX licence string; a fresh virtualenv may hold an older one, which
# `-U` replaces. Below 82: torch 2.11 (the H100/H200 images' torch) requires setuptools<82.
say "fusedloss and its extras ($extras)"
pip_install --no-compile -U "setuptools>=77,<82" wheel "${build_tools[@]}"
pip_install --no-compile --no-build-isolation "$torch_pin" -e ".[$extras]"
"$PYTHON" -c "import fusedloss; print('fusedloss install: backends:', fusedloss.backend_status())"
say "done"
