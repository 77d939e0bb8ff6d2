"""Which checkpoint a run starts from: ``--resume``'s, or after an automatic restart its own ``--out``'s newest,
and whether the run's files are continued in place. Checked before any process starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fourfold.checkpoint.store import CheckpointError, read_manifest
from fourfold.config import MODEL_KEYS, Config

__all__ = ["CONTINUED", "changed_settings", "check_resume", "continues_run", "restart_count", "resume_from"]


def restart_count() -> int:
    """How many times torchrun's agent has restarted this job's ranks (``--max-restarts``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def resume_from(cfg: Config) -> dict[str, Any] | None:
    """The manifest of the checkpoint this run starts from: after an automatic restart, OUT's newest (the run's
    own progress), else ``--resume``'s; None when there is neither (a run restarted before its first
    checkpoint starts over). Refuses a missing or damaged ``--resume``."""
    t = cfg.train
    if restart_count() > 0:
        try:
            return read_manifest(t.out)
        except CheckpointError:
            pass  # none written yet: --resume's, or from the start
    if t.resume is None:
        return None
    try:
        return read_manifest(t.resume)
    except CheckpointError as e:
        raise ValueError(str(e)) from None


def continues_run(cfg: Config, manifest: dict[str, Any]) -> bool:
    """True when the checkpoint lies in ``--out``'s own checkpoints: the run's files are continued there."""
    return Path(manifest["dir"]).resolve().parent == (Path(cfg.train.out) / "checkpoints").resolve()


def check_resume(cfg: Config, manifest: dict[str, Any]) -> None:
    """Refuse, before any process starts, a checkpoint of another model or dtype, or one at or past --steps.
    (The model settings not given were taken from the checkpoint: :func:`fourfold.config.from_namespace`.)"""
    saved, here = manifest["config"], cfg.record()
    differ = [f"{k}={saved.get(s, {}).get(k)!r} there, {here[s][k]!r} here"
              for s, keys in MODEL_KEYS.items() for k in keys if saved.get(s, {}).get(k) != here[s][k]
              and not (k == "model_config" and _same_contents(saved, here))]
    if differ:
        raise ValueError(f"resume: the checkpoint {manifest['dir']} was saved from another model: "
                         f"{'; '.join(differ)}. Leave these flags out (a resumed run takes the checkpoint's), or "
                         "resume another checkpoint.")
    if manifest["step"] >= cfg.train.steps:
        raise ValueError(f"resume: the checkpoint {manifest['dir']} is at step {manifest['step']}, got "
                         f"steps={cfg.train.steps}. Pass --steps {manifest['step'] + 1} or more.")


def _same_contents(saved: dict[str, Any], here: dict[str, Any]) -> bool:
    """Two --model-config files (moved, copied, or named another way) that hold the same JSON object."""
    return saved.get("model_config_values") is not None and saved.get("model_config_values") == here.get(
        "model_config_values")


CONTINUED = ("seed", "batch_size", "lr", "weight_decay", "precision", "data", "tokenizer", "data_dtype", "pack",
             "tokens_per_step", "truncate_documents")
"""The training settings whose change makes a resumed run differ from the uninterrupted one (the layout's do
not: a checkpoint loads exactly under any layout)."""


def changed_settings(cfg: Config, manifest: dict[str, Any]) -> list[str]:
    """The :data:`CONTINUED` settings this run gives other values than the checkpoint's run had, as
    ``"lr 0.001 (was 0.003)"``: legitimate (a lower learning rate after a spike), but never silent."""
    saved, here = manifest["config"].get("train", {}), cfg.to_dict()["train"]
    return [f"{k} {here[k]!r} (was {saved[k]!r})" for k in CONTINUED if k in saved and saved[k] != here[k]]
