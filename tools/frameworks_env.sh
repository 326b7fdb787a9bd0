#!/usr/bin/env bash
# Creates .venv-frameworks/, the environment of tests/frameworks: verl, OpenRLHF and Axolotl on a CPU torch,
# with fusedloss imported from this checkout. A second environment because their pins conflict with the main
# one's (verl needs transformers < 5.11) and their extras pull a CUDA torch; so the CPU torch goes in first and
# the frameworks never get to replace it. Idempotent: returns at once when the environment was built by this
# very script (a stamp holds the script's hash); edit the script and the next run rebuilds.
#   bash tools/frameworks_env.sh            # then: .venv-frameworks/bin/python -m pytest -q tests/frameworks
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-frameworks
PYTHON=${PYTHON:-python}
STAMP="$VENV/.built-by-$(sha1sum tools/frameworks_env.sh | cut -c1-16)"
if [ -f "$STAMP" ]; then
    echo "frameworks env: $VENV is up to date"
    exit 0
fi
start=$(date +%s)
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
# --no-warn-conflicts: the no-deps installs below leave pins unmet on purpose (transformers, ray, flash-attn).
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-warn-conflicts "$@"; }

# The CPU torch first; every later install keeps it (none of the frameworks is installed with its extras).
pip_install "torch==2.13.0"
# verl with its own dependencies (transformers < 5.11, ray, tensordict), megatron-core for the Megatron site.
pip_install "verl==0.9.1" "megatron-core==0.16.1" "pytest>=8"
# OpenRLHF pins flash-attn, which compiles against CUDA, and transformers 5.15: installed without dependencies,
# with what its model code imports. flash_attn itself is stubbed by the tests (tests/frameworks/_stand_ins.py).
pip_install --no-deps "openrlhf==0.11.2" "deepspeed==0.19.6"
pip_install einops hjson ninja py-cpuinfo pydantic msgpack loralib optree
# Axolotl pins transformers 5.16 (and ~300 packages: gradio, modal, lm_eval, ...): installed without
# dependencies, for its plugin machinery (axolotl.integrations, axolotl.utils.config), which needs addict.
pip_install --no-deps "axolotl==0.19.0"
pip_install addict

# fusedloss from this checkout, as an editable install would put it (without building the CUDA extension:
# the frameworks tests run the torch backend).
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$PWD" > "$site/fusedloss-checkout.pth"
"$VENV/bin/python" -c "import fusedloss, verl, openrlhf, axolotl; print('frameworks env: fusedloss from', \
fusedloss.__file__, '| verl', verl.__version__)"
touch "$STAMP"
echo "frameworks env: built $VENV in $(( $(date +%s) - start )) s"
