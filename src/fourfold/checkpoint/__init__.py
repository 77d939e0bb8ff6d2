"""Checkpoints that survive a crash and load under any layout.

Two kinds of file:

* ``model.pt`` (:func:`save_checkpoint` / :func:`load_checkpoint`): the final, whole model of a run, one file.
* a **training checkpoint** (:func:`save` / :func:`load`), a directory ``OUT/checkpoints/step-000040/``::

      rank-00000.pt ... rank-00007.pt   each rank's own pieces (no rank gathers the whole model)
      manifest.json                      written last: step, config, layout, every file's size and sha256,
                                         and where each piece of each tensor lies

  :mod:`~fourfold.checkpoint.sharded` maps an engine's tensors to pieces keyed by the unsharded model's names
  and back, under any layout; :mod:`~fourfold.checkpoint.store` is the directory, its manifest and its checks.

A checkpoint without its ``manifest.json`` does not exist: the manifest is written through tmp + rename after
every rank's file is complete, so a crash mid-save leaves the previous checkpoint the newest. Loads check every
file they open against its sha256 (:class:`CheckpointError` "damaged: file, expected, got") and use
``weights_only=True``: a checkpoint is data, never code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fourfold.checkpoint.sharded import load, save
from fourfold.checkpoint.store import FORMAT, CheckpointError, find_latest, read_manifest, sha256_file
from fourfold.models import model_pt

__all__ = ["FORMAT", "CheckpointError", "find_latest", "load", "load_checkpoint", "read_manifest", "save",
           "save_checkpoint", "sha256_file"]


def save_checkpoint(path: str | Path, model_state: dict[str, torch.Tensor], *, config: dict[str, Any],
                    step: int) -> Path:
    """Save ``{"model", "config", "step"}`` atomically, with the sha256 :func:`load_checkpoint` checks
    (:mod:`fourfold.models.model_pt`); tensors are moved to CPU first."""
    return model_pt.write(path, model_state, config=config, step=step)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (``weights_only=True``: no code runs), checked against
    its sha256; :class:`~fourfold.models.model_pt.WeightsFileError` (a ValueError) names a damaged file."""
    return model_pt.read(path)
