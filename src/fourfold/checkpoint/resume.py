"""Which checkpoint a run starts from: ``--resume``'s, or after an automatic restart its own ``--out``'s newest,
and whether the run's files are continued in place. Checked before any process starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fourfold.checkpoint.store import CheckpointError, restart_count, starting_manifest
from fourfold.config import MODEL_KEYS, Config

__all__ = ["CONTINUED", "changed_settings", "check_resume", "continues_run", "restart_count", "resume_from"]


def resume_from(cfg: Config) -> dict[str, Any] | None:
    """The manifest of the checkpoint this run starts from (:func:`~fourfold.checkpoint.store.starting_manifest`);
    a missing or damaged ``--resume`` is a ValueError."""
    try:
        return starting_manifest(cfg.train.resume, cfg.train.out)
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
              and not (k == "model_config" and _same_model_config(saved, here))]
    if differ:
        raise ValueError(f"resume: the checkpoint {manifest['dir']} was saved from another model: "
                         f"{'; '.join(differ)}. Leave these flags out (a resumed run takes the checkpoint's), or "
                         "resume another checkpoint.")
    if manifest["step"] >= cfg.train.steps:
        raise ValueError(f"resume: the checkpoint {manifest['dir']} is at step {manifest['step']}, got "
                         f"steps={cfg.train.steps}. Pass --steps {manifest['step'] + 1} or more.")


def _same_model_config(saved: dict[str, Any], here: dict[str, Any]) -> bool:
    """The same --model-config: two files (moved, copied, named another way) holding the same JSON object, or,
    for a checkpoint that recorded only the path as typed (before model_config_values), the same file."""
    if saved.get("model_config_values") is not None:
        return bool(saved["model_config_values"] == here.get("model_config_values"))
    path = saved.get("train", {}).get("model_config")
    return path is not None and os.path.abspath(path) == here["train"]["model_config"]


CONTINUED = ("seed", "batch_size", "lr", "weight_decay", "precision", "data", "tokenizer", "data_dtype", "pack",
             "tokens_per_step", "truncate_documents")
"""The training settings whose change makes a resumed run differ from the uninterrupted one (the layout's do
not: a checkpoint loads exactly under any layout)."""


def changed_settings(cfg: Config, manifest: dict[str, Any]) -> list[str]:
    """The :data:`CONTINUED` settings this run gives other values than the checkpoint's run had, as
    ``"lr 0.001 (was 0.003)"``: legitimate (a lower learning rate after a spike), but never silent."""
    saved, here = manifest["config"].get("train", {}), cfg.to_dict()["train"]
    return [f"{k} {here[k]!r} (was {saved[k]!r})" for k in CONTINUED if k in saved and saved[k] != here[k]]
