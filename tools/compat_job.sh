#!/usr/bin/env bash
# One compatibility job of the CI (.ci/run): a focused subset of the tests in an environment at one end of the
# supported version range (tools/compat_env.sh builds or reuses it). The checkout is put first on PYTHONPATH.
#
#   bash tools/compat_job.sh torch2.11|torch2.8
#
# The subset: torch.compile with a dynamic token count (one compile for every length), the custom ops'
# registration (opcheck), the core equivalence against the float64 reference (every backend that runs here;
# the Triton ones under the interpreter on a CPU; float64 of the Triton backend only once its tl.dot exists), and
# the README's Quick start.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: tools/compat_job.sh torch2.11|torch2.8}
start=$(date +%s)
env_dir=$(bash tools/compat_env.sh "$name" | tail -n 1)
built=$(date +%s)
"$env_dir/bin/python" -c "import torch, triton, transformers; print('compat job $name: torch', torch.__version__,
      'triton', triton.__version__, 'transformers', transformers.__version__)"
status=0
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$env_dir/bin/python" -m pytest -q -p no:cacheprovider \
    tests/contract/test_api_torch_compile.py tests/contract/test_api_op_registration.py tests/contract/test_api_versions.py tests/contract/test_numerics_equivalence.py \
    tests/contract/test_docs_quickstart.py \
    -k "not (triton and float64)" || status=$?
end=$(date +%s)
echo "compat job $name: exit $status, wall $((end - start)) s (environment $((built - start)) s, tests $((end - built)) s)"
exit $status
