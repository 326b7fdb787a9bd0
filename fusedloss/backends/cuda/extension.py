"""The CUDA extension's handle: ``fusedloss._C`` when it is built from sources that speak this package's protocol,
else None and why. The backend (``backend.py``) and the epilogue path (``epilogue.py``) both launch through it.
"""

from __future__ import annotations

import importlib

from ...core import problem as coef  # coef.COEF_*: the dz formula's coefficient rows (docs/design.md)
from ...core.problem import NUM_COEFFS, Statistics

# Rows of the fold's running-state buffer (csrc/fusedloss/args.h kStateFields: the RowState fields and the
# target logit): the backend sizes it, and an extension with another layout is refused.
STATE_FIELDS = 14

_COEF_ORDER = [coef.COEF_ONEHOT, coef.COEF_CONST, coef.COEF_LOGQ, coef.COEF_KL_REV, coef.COEF_TEACHER_PROB,
               coef.COEF_LOGM, coef.COEF_UNIFORM]


def _load_extension():
    """``(fusedloss._C, None)``, or ``(None, why)``: not built, or built from sources whose protocol
    (output names, coefficient order) differs from problem.py's, which it would then read and write wrongly."""
    try:
        _C = importlib.import_module("fusedloss._C")  # a module the build produces, not a file of the tree
    except ImportError as exc:  # not built (no nvcc, FUSEDLOSS_CUDA=0) or a plain source checkout
        return None, exc
    expected = {"OUTPUT_NAMES": list(Statistics._fields), "NUM_COEFFS": NUM_COEFFS, "COEF_INDEX": _COEF_ORDER,
                "STATE_FIELDS": STATE_FIELDS}
    for name, want in expected.items():
        got = getattr(_C, name, None)
        if got != want:
            return None, ImportError(f"fusedloss._C is stale: its {name} is {got!r}, the protocol has {want!r}; "
                                     "rebuild the extension (python setup.py build_ext --inplace)")
    return _C, None


_C, _IMPORT_ERROR = _load_extension()
