"""What the framework integrations share: the version gate and the ``enabled()`` context manager."""

from __future__ import annotations

import contextlib


def check_version(module: str, package: str, found: str, supported: str, keep: str) -> None:
    """Raise ``RuntimeError`` naming the versions unless ``found`` (``package``'s version) is in ``supported``;
    ``keep`` says what to leave in place instead."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if Version(Version(found).base_version) not in SpecifierSet(supported):
        raise RuntimeError(f"{module} supports {package}{supported}, found {package} {found}; install a supported "
                           f"version or leave {keep} in place")


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
