"""Saving and loading weights without ever losing a file.

Writes go to a temporary file in the same directory, then ``os.replace`` (atomic on POSIX), so a crash mid-write
leaves the previous checkpoint intact. Loads use ``weights_only=True``: a checkpoint is data, never code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fourfold.files import atomic_path

__all__ = ["load_checkpoint", "save_checkpoint"]


def save_checkpoint(path: str | Path, model_state: dict[str, torch.Tensor], *, config: dict[str, Any],
                    step: int) -> Path:
    """Save ``{"model", "config", "step"}`` atomically; tensors are moved to CPU first."""
    state = {k: v.detach().cpu() for k, v in model_state.items()}
    payload = {"model": state, "config": config, "step": step}
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)
    return Path(path)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (``weights_only=True``: no code runs)."""
    return torch.load(path, map_location="cpu", weights_only=True)
