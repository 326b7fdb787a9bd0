"""What the framework integrations share: the version gate, the exact restore and the ``enabled()`` context
manager."""

from __future__ import annotations

import contextlib
import importlib


def check_version(module: str, package: str, found: str, supported: str, keep: str) -> None:
    """Raise ``RuntimeError`` naming the versions unless ``found`` (``package``'s version) is in ``supported``;
    ``keep`` says what to leave in place instead."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if Version(Version(found).base_version) not in SpecifierSet(supported):
        raise RuntimeError(f"{module} supports {package}{supported}, found {package} {found}; install a supported "
                           f"version or leave {keep} in place")


def restore_originals(originals: dict, state: dict) -> None:
    """Put each replaced attribute back, the very object that was there before (``originals`` maps
    ``(module name, attribute)`` to it), and mark the integration disabled."""
    for (module_name, attr), original in originals.items():
        setattr(importlib.import_module(module_name), attr, original)
    state["enabled"] = False


def scoped(enable, disable, state: dict):
    """An ``enabled(**options)`` context manager over ``enable`` / ``disable``, which restores the previous
    state (``state["enabled"]`` and the options ``enable`` last got, the other keys of ``state``) on exit."""

    @contextlib.contextmanager
    def enabled(*args, **options):
        was = dict(state)
        enable(*args, **options)
        try:
            yield
        finally:
            if was.pop("enabled"):
                enable(**was)
            else:
                disable()

    enabled.__doc__ = "``with enabled(...): ...`` runs the block with ``enable(...)`` and restores the previous state."
    return enabled
