"""The engine every layout runs through: ``Layout`` (every parallel setting and its rules), ``parallelize`` (the
strategies applied in order), ``Engine`` (the step). The names load on first use, from their modules."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Engine", "Layout", "Loss", "parallelize"]

_HOMES = {"Engine": "fourfold.engine.step", "Loss": "fourfold.engine.step", "Layout": "fourfold.engine.layout",
          "parallelize": "fourfold.engine.parallelize"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'fourfold.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
