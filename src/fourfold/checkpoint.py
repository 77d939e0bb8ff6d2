"""Saving and loading weights without ever losing a file.

Writes go to a temporary file in the same directory, then ``os.replace`` (atomic on POSIX), so a crash mid-write
leaves the previous checkpoint intact. Loads use ``weights_only=True``: a checkpoint is data, never code.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

__all__ = ["atomic_write", "load_checkpoint", "save_checkpoint"]


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], Any]) -> Path:
    """Call ``write(file)`` on a temporary file beside ``path``, then move it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_checkpoint(path: str | Path, model_state: dict[str, torch.Tensor], *, config: dict[str, Any],
                    step: int) -> Path:
    """Save ``{"model", "config", "step"}`` atomically; tensors are moved to CPU first."""
    state = {k: v.detach().cpu() for k, v in model_state.items()}
    payload = {"model": state, "config": config, "step": step}
    return atomic_write(path, lambda f: torch.save(payload, f))


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (``weights_only=True``: no code runs)."""
    return torch.load(path, map_location="cpu", weights_only=True)
