"""The test run ends with one line per skip reason (tests/conftest.py's ``pytest_terminal_summary``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_the_run_says_what_it_skipped_and_why(tmp_path):
    (tmp_path / "test_needs_a_missing_package.py").write_text(
        "import pytest\npytest.importorskip('fusedloss_no_such_package')\n\ndef test_a():\n    pass\n")
    (tmp_path / "test_some_skipped.py").write_text(
        "import pytest\n\ndef test_runs():\n    pass\n\n@pytest.mark.skip(reason='needs a CUDA device')\n"
        "def test_gpu_one():\n    pass\n\n@pytest.mark.skip(reason='needs a CUDA device')\ndef test_gpu_two():\n"
        "    pass\n")
    tests = Path(__file__).resolve().parents[1]
    path = (str(tests), str(tests.parent), os.environ.get("PYTHONPATH"))
    # the outer run's options (CI's two processes) are not this small run's
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-c", os.devnull,
                          "--rootdir", str(tmp_path), str(tmp_path)], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    summary = out[out.index("skipped, by reason"):].splitlines()
    assert ("could not import 'fusedloss_no_such_package': No module named 'fusedloss_no_such_package': "
            "1 module (test_needs_a_missing_package.py (all))") in summary
    assert "needs a CUDA device: 2 tests, 1 module (test_some_skipped.py)" in summary
    assert summary[-1].startswith("1 passed, 3 skipped")
