#!/usr/bin/env bash
# Builds (or reuses) a virtualenv for a compatibility job: the ends of the supported version range.
#
#   bash tools/compat_env.sh NAME        # prints the environment's folder on its last line
#
#   NAME        torch    Triton  transformers  TRL     accelerate  datasets  peft    why
#   torch2.11   2.11.0   3.6.0   5.25.0        1.16.0  newest      newest    newest  the H100/H200 images' torch, Triton
#   torch2.8    2.8.0    3.4.0   4.56.2        1.16.0  1.10.1      4.7.0     0.13.0  the floors pyproject.toml declares
#
# The folder is $FUSEDLOSS_COMPAT_ENVS/NAME ($FUSEDLOSS_COMPAT_ENVS defaults to .venv-compat/, git-ignored); it is
# reused when its stamp matches the pins below, so point FUSEDLOSS_COMPAT_ENVS at a lasting folder to build each
# environment once. fusedloss itself is not installed there: the jobs put the checkout on PYTHONPATH.
# torch comes from the configured index (PyPI: the CUDA build; it runs on a CPU too, and its CUDA libraries
# are dependencies of the wheel, a few GB per environment).
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: tools/compat_env.sh torch2.11|torch2.8}
case "$name" in
    torch2.11) pins=("torch==2.11.0" "triton==3.6.0" "transformers==5.25.0" "trl==1.16.0" accelerate datasets peft) ;;
    torch2.8)  pins=("torch==2.8.0" "triton==3.4.0" "transformers==4.56.2" "trl==1.16.0" "accelerate==1.10.1"
                     "datasets==4.7.0" "peft==0.13.0") ;;
    *) echo "tools/compat_env.sh: unknown environment '$name' (torch2.11 or torch2.8)" >&2; exit 2 ;;
esac
# The test tools, bounded as the test extra bounds them.
pins+=("numpy" "pytest>=8" "hypothesis>=6.100" "setuptools>=77,<82")
root=${FUSEDLOSS_COMPAT_ENVS:-$PWD/.venv-compat}
env_dir=$root/$name
stamp="${pins[*]}"
if [ -x "$env_dir/bin/python" ] && [ "$(cat "$env_dir/.fusedloss-pins" 2>/dev/null)" = "$stamp" ]; then
    echo "compat env $name: reusing $env_dir" >&2
else
    echo "compat env $name: building $env_dir (${pins[*]})" >&2
    rm -rf "$env_dir"
    "${PYTHON:-python3}" -m venv "$env_dir"
    # The pins are exact; a machine-wide constraint on torch's version must not veto them.
    PIP_CONSTRAINT= "$env_dir/bin/python" -m pip install -q --disable-pip-version-check "${pins[@]}" >&2
    echo "$stamp" > "$env_dir/.fusedloss-pins"
fi
echo "$env_dir"
