"""The install the README gives the frameworks' users (fusedloss without extras) keeps every pin of theirs, and
the ``integrations`` extra is kept out of their environments for a reason: read from the frameworks' own
requirements (their installed metadata) and pyproject.toml."""

from __future__ import annotations

from importlib.metadata import requires, version
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def _ours():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return ([Requirement(r) for r in project["dependencies"]],
            [Requirement(r) for r in project["optional-dependencies"]["integrations"]])


def _pins(package: str) -> dict:
    """The exact (``==``) or bounded versions ``package`` requires, by requirement name, without extras."""
    pins = {}
    for line in requires(package) or []:
        requirement = Requirement(line)
        if requirement.marker is None:
            pins[requirement.name] = requirement.specifier
    return pins


def _conflicts(ours, theirs: dict, candidates: dict) -> list:
    """Our requirements that no candidate version satisfying theirs satisfies (candidates: name -> versions)."""
    bad = []
    for requirement in ours:
        spec = theirs.get(requirement.name)
        if spec is None:
            continue
        allowed = [v for v in candidates[requirement.name] if v in spec]
        if not any(v in requirement.specifier for v in allowed):
            bad.append(requirement.name)
    return bad


# Versions on each side of the pins that matter (the frameworks' pins, and ours)
CANDIDATES = {"torch": ["2.8.0", "2.11.0", "2.13.0"], "numpy": ["1.26.4", "2.1.0", "2.3.0"],
              "transformers": ["4.56.2", "5.6.0", "5.10.4", "5.16.1", "5.25.0"],
              "trl": ["0.24.0", "1.9.0", "1.16.0"], "accelerate": ["1.10.1", "1.11.0", "1.13.0", "1.16.0"],
              "datasets": ["4.0.0", "4.7.0", "4.8.4", "5.2.0"], "peft": ["0.13.0", "0.18.1", "0.20.0", "0.21.2"]}


def test_the_library_alone_keeps_axolotls_pins_and_the_extra_would_not():
    base, extra = _ours()
    pins = _pins("axolotl")
    assert version("axolotl").startswith("0.19.")
    assert _conflicts(base, pins, CANDIDATES) == []
    assert _conflicts(extra, pins, CANDIDATES) == ["trl"]  # trl>=1.16 against Axolotl's trl==1.9.0
    assert str(pins["trl"]) == "==1.9.0"


def test_llamafactorys_pins_are_kept_by_the_library_alone():
    """LLaMA-Factory 0.9.5's pins, as its wheel's metadata states them (it is not installed here)."""
    pins = {"torch": ">=2.4.0", "transformers": "!=4.52.0,!=4.57.0,<=5.6.0,>=4.55.0", "trl": "<=0.24.0,>=0.18.0",
            "datasets": "<=4.0.0,>=2.16.0", "accelerate": "<=1.11.0,>=1.3.0", "peft": "<=0.18.1,>=0.18.0",
            "numpy": ""}
    from packaging.specifiers import SpecifierSet

    pins = {name: SpecifierSet(spec) for name, spec in pins.items()}
    base, extra = _ours()
    assert _conflicts(base, pins, CANDIDATES) == []
    assert sorted(_conflicts(extra, pins, CANDIDATES)) == ["datasets", "trl"]
