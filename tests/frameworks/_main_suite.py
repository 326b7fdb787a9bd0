"""The main suite's data and error helpers (tests/conftest.py), loaded from that file under a module name of their
own, so the framework tests never depend on which module pytest registered as ``conftest``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("fusedloss_main_suite_conftest",
                                               Path(__file__).resolve().parents[1] / "conftest.py")
_main = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_main)

make_head = _main.make_head
rel_err = _main.rel_err
