"""The verl, OpenRLHF and Axolotl integration tests (tests/frameworks), run in their own environment.

Those frameworks pin versions the main environment cannot hold (verl: transformers < 5.11), so
``bash tools/frameworks_env.sh`` builds ``.venv-frameworks/`` and this test runs the folder's tests there. A
missing environment fails with the command to build it, unless ``FUSEDLOSS_SKIP_FRAMEWORKS=1`` says to skip
them (then the skip says so).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-frameworks" / "bin" / "python"


def test_framework_integrations_pass_in_their_environment():
    if not PYTHON.exists():
        if os.environ.get("FUSEDLOSS_SKIP_FRAMEWORKS") == "1":
            pytest.skip("FUSEDLOSS_SKIP_FRAMEWORKS=1: the verl / OpenRLHF / Axolotl tests (tests/frameworks) "
                        "were not run")
        pytest.fail("the frameworks environment is missing: run bash tools/frameworks_env.sh "
                    "(or set FUSEDLOSS_SKIP_FRAMEWORKS=1 to skip the verl / OpenRLHF / Axolotl tests)")
    # the outer run's options (CI's pytest-xdist processes) are not for this environment, which has no xdist
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTEST_ADDOPTS")}
    run = subprocess.run([str(PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/frameworks"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, tail
    summary = re.search(r"(\d+) passed", run.stdout)
    assert summary and int(summary.group(1)) > 0, tail
    assert not re.search(r"\d+ (failed|error)", run.stdout), tail
