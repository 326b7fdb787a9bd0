#!/usr/bin/env bash
# A contributor's and CI's set-up, on top of the user install (tools/install.sh): the CUDA extension wherever
# nvcc is found (GPU or not: its host code is tested on a CPU), the CUTLASS headers of the epilogue kernels,
# the Tritons of the compile check and the frameworks' virtualenv. Run it inside the virtualenv you want it in:
#   bash tools/dev_setup.sh       # FUSEDLOSS_SKIP_FRAMEWORKS=1 skips the frameworks' virtualenv
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
pip_install() { "$PYTHON" -m pip install -q --disable-pip-version-check "$@"; }
say() { echo "fusedloss dev setup [$(( $(date +%s) - start ))s]: $*"; }
start=$(date +%s)

# The extension is built whenever nvcc is found, as setup.py does with FUSEDLOSS_CUDA unset.
if [ -z "${FUSEDLOSS_CUDA:-}" ]; then
    for candidate in "${CUDA_HOME:-${CUDA_PATH:-}}/bin/nvcc" /usr/local/cuda/bin/nvcc /usr/local/bin/nvcc "$(command -v nvcc || true)"; do
        if [ -x "$candidate" ] && [ ! -d "$candidate" ]; then export FUSEDLOSS_CUDA=1; break; fi
    done
fi
bash tools/install.sh --tests

# The CUTLASS 3 headers (a 6 MB wheel; its Python interface and dependencies are not needed): the extension's
# opt-in sm_90a epilogue kernels are built with them (tests/tooling/test_compile_cuda_epilogue_kernels.py compiles them).
say "CUTLASS headers (nvidia-cutlass, 6 MB)"
pip_install --no-deps "nvidia-cutlass==4.2.0.0"

# The oldest supported Triton and the H200 images' version (about 550-650 MB each unpacked), beside the newest
# installed above: the compile check builds every Triton kernel variant for sm_90a with each
# (tools/triton_versions.py).
say "Triton 3.4.0 and 3.6.0 into .triton-versions/ (about 1.2 GB unpacked, a minute or two)"
"$PYTHON" tools/triton_versions.py install

# A second virtualenv for the frameworks whose pins conflict with TRL's (verl, OpenRLHF, Axolotl).
if [ "${FUSEDLOSS_SKIP_FRAMEWORKS:-}" = "1" ]; then
    say "FUSEDLOSS_SKIP_FRAMEWORKS=1: no frameworks' virtualenv"
elif [ -f tools/frameworks_env.sh ]; then
    say "the frameworks' virtualenv .venv-frameworks/ (verl, OpenRLHF, Axolotl; about 3 minutes, 2 GB)"
    bash tools/frameworks_env.sh
fi
say "done"
