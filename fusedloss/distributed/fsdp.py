"""FSDP2 heads (placeholder)."""

from __future__ import annotations


def prepare(*args, **kwargs):
    raise NotImplementedError
