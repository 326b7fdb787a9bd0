"""How far a result is from what was expected: the relative errors every test reports, in one place.

``rel_err`` is the one every comparison uses unless it says otherwise. The others differ from it on purpose,
and their names say how:

* ``rel_err_floored``: the expected norm counts as at least ``floor`` (and 1e-300), so an all-zero
  expectation makes any difference fail instead of being judged by its absolute size.
* ``plain_rel_err``: the formula as it stands, with no care for non-finite values: a NaN anywhere gives NaN,
  which fails a ``<`` check and a ``>`` check alike (``rel_err`` gives inf, which passes a ``>`` check).
* ``max_rel_err``: a dict of named tensors (a model's parameters or gradients) against a reference dict,
  the worst name's error, computed in the tensors' own dtype.
* ``distance``: the two norms themselves, for a bound that is not a plain ratio.

Import from here, not from conftest.py: a conftest is pytest's to load, and a module under its own name
resolves the same way from every folder of the suite.
"""

from __future__ import annotations

from typing import Optional

import torch


def distance(actual: torch.Tensor, expected: torch.Tensor) -> tuple:
    """``(||a - e||, ||e||)`` in float64 over the finite expected entries; ``(inf, 0.0)`` unless the non-finite
    expected entries are matched exactly (+inf for +inf, NaN for NaN) and the others of ``a`` are finite."""
    a = actual.detach().to("cpu", torch.float64).reshape(-1)
    e = expected.detach().to("cpu", torch.float64).reshape(-1)
    bad = ~torch.isfinite(e)
    if bool(bad.any()):
        same = (a[bad] == e[bad]) | (torch.isnan(a[bad]) & torch.isnan(e[bad]))
        if not bool(same.all()):
            return float("inf"), 0.0
        a, e = a[~bad], e[~bad]
    if not bool(torch.isfinite(a).all()):
        return float("inf"), 0.0
    return float(torch.linalg.vector_norm(a - e)), float(torch.linalg.vector_norm(e))


def rel_err(actual: Optional[torch.Tensor], expected: Optional[torch.Tensor]) -> float:
    """Norm-wise relative error ``||a - e|| / ||e||`` in float64 (``||a - e||`` when ``e`` is all zero).

    The shapes must be equal. NaN/inf in either tensor give inf unless both agree exactly on those positions.
    Two Nones agree (0.0)."""
    if actual is None and expected is None:
        return 0.0
    assert actual is not None and expected is not None, "one of the two tensors is None"
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    num, den = distance(actual, expected)
    return num / den if den > 0 else num


def rel_err_floored(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """``||a - e|| / max(||e||, floor, 1e-300)`` in float64 (0.0 when they are equal): unlike ``rel_err``, an
    expected norm below ``floor`` counts as ``floor``, and an all-zero expectation leaves any difference
    enormous. Non-finite entries as in ``distance``; the shapes are not compared, only the entries in order."""
    diff, norm = distance(actual, expected)
    return diff / max(norm, floor, 1e-300) if diff else 0.0


def plain_rel_err(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """``||a - e|| / max(||e||, floor)`` in float64 (``||a - e||`` when that maximum is 0), computed as it
    stands: NaN and inf propagate through the arithmetic, and shapes broadcast."""
    a, e = actual.detach().to(torch.float64), expected.detach().to(torch.float64)
    num, den = (a - e).norm(), e.norm().clamp_min(floor)
    return float(num / den) if den > 0 else float(num)


def max_rel_err(got: dict, ref: dict) -> float:
    """The worst of ``||got[k] - ref[k]|| / ||ref[k]||`` over the names of ``ref``, in the tensors' own dtype and
    with no floor (a reference tensor that is all zero gives inf or NaN, which no bound passes)."""
    return max(float((got[k] - ref[k]).norm() / ref[k].norm()) for k in ref)


def assert_each_close(got: dict, ref: dict, rtol: float) -> None:
    """The same names, and each tensor within ``rtol`` of the reference's, norm-wise in float64."""
    assert got.keys() == ref.keys()
    for name in ref:
        g, r = got[name].double(), ref[name].double()
        err = ((g - r).norm() / r.norm().clamp(min=1e-300)).item()
        assert err < rtol, (name, err)
