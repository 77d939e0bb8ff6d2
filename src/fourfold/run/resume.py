"""Which checkpoint a run starts from: ``--resume``'s, or after an automatic restart its own ``--out``'s newest,
and whether the run's files are continued in place. Checked before any process starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fourfold.checkpoint.store import CheckpointError, restart_count, starting_manifest
from fourfold.comm.wait import gather_objects
from fourfold.config import SECTIONS, Config, recorded_settings
from fourfold.data.loader import HELD_OUT
from fourfold.data.tokenizers import absolute_spec
from fourfold.models.gpt import GPTConfig
from fourfold.run.data import held_batches

__all__ = ["CONTINUED", "MODEL_KEYS", "changed_settings", "check_resume", "continues_run", "restart_count",
           "resume_from", "same_on_every_rank", "take_checkpoint_model"]


MODEL_KEYS = {"train": ("model", "model_config", "dtype"),
              "model": tuple(f.name for f in dataclasses.fields(GPTConfig))}
"""The settings that define a model, by section: a resumed run takes the checkpoint's for those it is not given."""


def take_checkpoint_model(values: dict[str, dict[str, Any]]) -> None:
    """``values`` (``{section: {key: value}}``, the file's and the flags') with ``--resume``: defaults < the
    checkpoint's model settings < file < flags. They must equal the checkpoint's anyway, so a resumed run need
    not repeat them; one given that differs is refused before launch. Given another ``--model``, none is taken
    (the refusal then lists what differs)."""
    t = values["train"]
    try:  # the checkpoint the run will load: after a restart its own newest, which --resume's may be pruned for
        out = values["output"].get("out", _default("output", "out"))
        manifest = starting_manifest(values["checkpoint"]["resume"], out)
    except CheckpointError as e:
        raise ValueError(str(e)) from None
    saved = manifest["config"] if manifest is not None else {}
    model = saved.get("train", {}).get("model", _default("train", "model"))  # older manifests: TinyGPT's
    if t.get("model", model) != model:
        return
    for section, keys in MODEL_KEYS.items():
        for key in keys:
            if key in saved.get(section, {}):
                values[section].setdefault(key, saved[section][key])
    path, written = t.get("model_config"), saved.get("model_config_values")
    if path is not None and path == saved.get("train", {}).get("model_config") and not os.path.isfile(path):
        hint = f"its keys are {json.dumps(written)}: write them" if written is not None else "write its keys"
        raise ValueError(f"resume: the checkpoint's model was built from --model-config {path}, which is gone; "
                         f"{hint} to a file and pass --model-config FILE.")
    # a model sized by --init-from's directory (its config.json, recorded as model_config_values) is built from it
    # again; the checkpoint holds the weights. A weights file sized nothing: the resumed run needs none.
    start = saved.get("train", {}).get("init_from")
    sized_by_it = start is not None and written is not None and saved.get("train", {}).get("model_config") is None
    if sized_by_it and t.get("model_config") is None and t.get("init_from") in (None, start):
        t["init_from"] = start
    if sized_by_it and t.get("init_from") == start and not os.path.isdir(start):
        raise ValueError(f"resume: the checkpoint's model was sized by --init-from {start}'s config.json, which is "
                         "gone (the checkpoint holds the weights). Put it back, or pass --init-from DIR where it is "
                         "now.")


def _default(section: str, key: str) -> Any:
    """[section] ``key``'s default."""
    return next(f.default for f in dataclasses.fields(SECTIONS[section]) if f.name == key)


def resume_from(cfg: Config) -> dict[str, Any] | None:
    """The manifest of the checkpoint this run starts from (:func:`~fourfold.checkpoint.store.starting_manifest`);
    a missing or damaged ``--resume`` is a ValueError."""
    try:
        return starting_manifest(cfg.checkpoint.resume, cfg.output.out)
    except CheckpointError as e:
        raise ValueError(str(e)) from None


def same_on_every_rank(manifest: dict[str, Any] | None, resume: str | None) -> None:
    """Refuse, on every rank alike, a start from different checkpoints: each rank finds ``--resume DIR``'s newest
    itself, and a run that is still writing DIR can hand two ranks two steps, whose pieces would be mixed
    silently (their shapes agree). A collective (an object gather), once at the start."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    found = gather_objects(manifest["dir"] if manifest is not None else None, op="agree on the checkpoint to resume")
    if len(set(found)) > 1:
        shown = ", ".join(f"rank {r}: {d or 'none'}" for r, d in enumerate(found) if d != found[0])
        where = f" in {resume}" if resume else ""
        raise ValueError(f"resume: the ranks found different checkpoints to start from{where}: rank 0 "
                         f"{found[0] or 'none'}, {shown}. Either a run is still writing there (pass one checkpoint "
                         "directory, --resume DIR/checkpoints/step-NNNNNN, or wait for it to finish), or the "
                         "machines do not share that folder (an --out on each machine: every rank's files must be "
                         "in one place to resume).")


def continues_run(cfg: Config, manifest: dict[str, Any]) -> bool:
    """True when the checkpoint lies in ``--out``'s own checkpoints: the run's files are continued there."""
    return Path(manifest["dir"]).resolve().parent == (Path(cfg.output.out) / "checkpoints").resolve()


def check_resume(cfg: Config, manifest: dict[str, Any]) -> None:
    """Refuse, before any process starts, a checkpoint of another model or dtype, or one at or past --steps.
    (The model settings not given were taken from the checkpoint: :func:`take_checkpoint_model`.)"""
    saved, here = manifest["config"], cfg.record()
    # what this model records: not TinyGPT's sizes for another model (older checkpoints recorded their defaults);
    # dropout shapes nothing: another one is a training change (changed_settings names it), not another model
    differ = [f"{k}={saved.get(s, {}).get(k)!r} there, {here[s][k]!r} here"
              for s, keys in MODEL_KEYS.items() for k in keys if k not in ("model_config", "dropout")
              and k in here[s] and saved.get(s, {}).get(k) != here[s][k]]
    then, now = saved.get("model_config_values"), here.get("model_config_values")
    if not differ and then is not None and now is not None and then != now:  # the file edited since, say
        keys = [k for k in sorted({*then, *now}) if then.get(k) != now.get(k)]
        shown = "; ".join(f"{k}={then.get(k)!r} there, {now.get(k)!r} here" for k in keys[:4])
        raise ValueError(f"resume: the checkpoint {manifest['dir']}'s model was built from other --model-config "
                         f"keys than {here['train']['model_config'] or 'the --init-from directory'} holds now: "
                         f"{shown}{f' and {len(keys) - 4} more' if len(keys) > 4 else ''}. Write the checkpoint's "
                         f"({json.dumps(then)}) to a file and pass --model-config FILE, or resume another "
                         "checkpoint.")
    if not _same_model_config(saved, here):
        differ.append(f"model_config={saved.get('train', {}).get('model_config')!r} there, "
                      f"{here['train']['model_config']!r} here")
    if differ:
        raise ValueError(f"resume: the checkpoint {manifest['dir']} was saved from another model: "
                         f"{'; '.join(differ)}. Leave these flags out (a resumed run takes the checkpoint's), or "
                         "resume another checkpoint.")
    if manifest["step"] >= cfg.train.steps:
        raise ValueError(f"resume: the checkpoint {manifest['dir']} is at step {manifest['step']}, got "
                         f"steps={cfg.train.steps}. Pass --steps {manifest['step'] + 1} or more.")


def _same_model_config(saved: dict[str, Any], here: dict[str, Any]) -> bool:
    """The same --model-config: files (the same one, edited or not; moved, copied, named another way) holding the
    same JSON object, or, for a checkpoint that recorded only the path as typed (before model_config_values), the
    same file; or none on either side."""
    if saved.get("model_config_values") is not None:
        return bool(saved["model_config_values"] == here.get("model_config_values"))
    path, now = saved.get("train", {}).get("model_config"), here["train"]["model_config"]
    if path is None or now is None:
        return path == now
    return os.path.abspath(path) == os.path.abspath(now)


CONTINUED = ("seed", "batch_size", "lr", "weight_decay", "warmup_steps", "lr_decay", "min_lr", "max_grad_norm",
             "precision", "data", "text_key", "tokenizer", "data_dtype", "pack", "tokens_per_step", "truncate_documents")
"""The training settings whose change makes a resumed run differ from the uninterrupted one (the layout's do
not: a checkpoint loads exactly under any layout)."""


def _value(key: str, value: Any) -> Any:
    """A setting as compared across runs: a tokenizer file by its absolute path (runs before 2026-11-24 recorded
    the path as typed, later ones absolute)."""
    return absolute_spec(value) if key == "tokenizer" else value


def changed_settings(cfg: Config, manifest: dict[str, Any]) -> list[str]:
    """The :data:`CONTINUED` settings this run gives other values than the checkpoint's run had, as
    ``"lr 0.001 (was 0.003)"``: legitimate (a lower learning rate after a spike), but never silent."""
    # every section as one table (a run before the sections recorded their settings under [train]); a key the
    # checkpoint's run did not record (an older fourfold's) had its default then
    here = recorded_settings(cfg.to_dict())
    saved = {**{f.name: f.default for section, cls in SECTIONS.items() if section != "model"
                for f in dataclasses.fields(cls)}, **recorded_settings(manifest["config"])}
    def shown(k: str, v: Any) -> str:
        return "the built-in corpus" if k == "data" and v is None else repr(v)

    out = [f"{k} {shown(k, here[k])} (was {shown(k, saved[k])})" for k in CONTINUED
           if _value(k, saved[k]) != _value(k, here[k])]
    held, was = (held_batches(t["eval_every"], t["eval_batches"]) for t in (here, saved))
    if held != was:  # the held-out data are not trained on: the training order differs
        out.append(f"{held} held-out batch(es) for --eval-every (was {was}: training reads other windows or "
                   "documents)")
    elif held and manifest["config"].get("held_out") != HELD_OUT:
        out.append("held-out data spread through the data (the checkpoint's run, before 2026-11-24, held out its "
                   "end: training reads other windows or documents)")
    if here["lr_decay"] != "none" and saved["steps"] != here["steps"]:
        out.append(f"steps {here['steps']} (was {saved['steps']}: the learning rate's decay now ends there)")
    dropout, was_dropout = cfg.model.dropout, manifest["config"].get("model", {}).get("dropout", cfg.model.dropout)
    if cfg.train.model == "tinygpt" and dropout != was_dropout:
        out.append(f"dropout {dropout!r} (was {was_dropout!r})")
    return out
