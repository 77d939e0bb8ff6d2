"""Which checkpoint a run starts from: ``--resume``'s, or after an automatic restart its own ``--out``'s newest,
and whether the run's files are continued in place. Checked before any process starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fourfold.checkpoint.store import CheckpointError, read_manifest
from fourfold.config import Config

__all__ = ["check_resume", "continues_run", "restart_count", "resume_from"]


def restart_count() -> int:
    """How many times torchrun's agent has restarted this job's ranks (``--max-restarts``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def resume_from(cfg: Config) -> dict[str, Any] | None:
    """The manifest of the checkpoint this run starts from: ``--resume``'s, or after an automatic restart OUT's
    newest (None when there is none yet: the restarted run starts over). Refuses a missing or damaged one."""
    t = cfg.train
    if t.resume is None and restart_count() == 0:
        return None
    try:
        return read_manifest(t.resume if t.resume is not None else t.out)
    except CheckpointError as e:
        if t.resume is None:
            return None  # restarted before the first checkpoint was written
        raise ValueError(str(e)) from None


def continues_run(cfg: Config, manifest: dict[str, Any]) -> bool:
    """True when the checkpoint lies in ``--out``'s own checkpoints: the run's files are continued there."""
    return Path(manifest["dir"]).resolve().parent == (Path(cfg.train.out) / "checkpoints").resolve()


def check_resume(cfg: Config, manifest: dict[str, Any]) -> None:
    """Refuse, before any process starts, a checkpoint of another model or dtype, or one at or past --steps."""
    saved = manifest["config"]
    model, dtype = saved.get("model", {}), saved.get("train", {}).get("dtype")
    differ = [f"{k}={model.get(k)!r} there, {v!r} here" for k, v in cfg.to_dict()["model"].items()
              if model.get(k) != v]
    if dtype != cfg.train.dtype:
        differ.append(f"dtype={dtype!r} there, {cfg.train.dtype!r} here")
    if differ:
        raise ValueError(f"resume: the checkpoint {manifest['dir']} was saved from another model: "
                         f"{'; '.join(differ)}. Pass the same model flags (they are in its manifest.json).")
    if manifest["step"] >= cfg.train.steps:
        raise ValueError(f"resume: the checkpoint {manifest['dir']} is at step {manifest['step']}, got "
                         f"steps={cfg.train.steps}. Pass --steps {manifest['step'] + 1} or more.")
