"""``fourfold export RUN --out DIR``: a run's final weights as a Hugging Face directory, for ``from_pretrained``,
the Hub, or another run's ``--init-from``.

    fourfold export runs/qwen2 --out runs/qwen2-hf
    python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('runs/qwen2-hf')"

Reads ``RUN/model.pt`` (``weights_only=True``; or a ``model.pt`` named directly) and what the run recorded of its
model, and writes into ``DIR`` (new, or empty: nothing of yours is overwritten):

* ``model.safetensors``: every weight by the model's own names, a tied one once (GPT-2's head is its token
  embedding), as ``save_pretrained`` stores it;
* for a Hugging Face family (gpt2, llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, granite, phi3, olmo2,
  olmo3, smollm3),
  ``config.json``: the config the run built its model from (``--model-config``'s keys, or ``--init-from``'s directory's), so ``from_pretrained`` builds the
  same model;
* ``tokenizer.json``, the run's own, when it read text through one (``--tokenizer FILE``, or ``bpe:N``'s, saved
  in RUN).

A model of your own (``--model MODULE:FACTORY``) or TinyGPT gets ``model.safetensors`` alone: ``--init-from`` takes
it with the same ``--model`` and flags.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

__all__ = ["export", "main"]


def export(source: str | Path, out: str | Path) -> tuple[list[str], str]:
    """Write ``source``'s (a run directory or its ``model.pt``) final weights into ``out``: (the names written,
    a note on the tokenizer). Written into a new directory beside ``out`` and renamed into place when complete
    (:func:`fourfold.files.atomic_path`), so a failure leaves nothing half-written."""
    from fourfold.checkpoint import load_checkpoint
    from fourfold.config import recorded_settings
    from fourfold.models.hf import FAMILIES

    path = Path(source)
    model_pt = path / "model.pt" if path.is_dir() else path
    if not model_pt.is_file():
        raise ValueError(f"export reads a run's model.pt, got {str(source)!r}, which holds none. Pass a run's --out "
                         "(trained with model.pt saved: the default), or its model.pt.")
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"out must be a new or empty directory (nothing of yours is overwritten), got {str(out)!r}, "
                         "which holds files. Pass another --out.")
    saved = load_checkpoint(model_pt)  # a damaged or foreign file: one line naming it (a ValueError)
    state, record = saved["model"], saved["config"]
    train = recorded_settings(record)  # the model's and the data's settings, as any fourfold recorded them
    family = train.get("model")
    config = None
    if family in FAMILIES:
        from fourfold.models.hf import hf_config

        config = hf_config(family, overrides=record.get("model_config_values") or {})
    weights = _once(state, config)
    tokenizer, note = _tokenizer(train, model_pt.parent)
    from fourfold.files import atomic_path
    from fourfold.models.model_pt import SAFETENSORS_KEY, weights_sha256
    from fourfold.models.weights import safetensors_module

    with atomic_path(target) as staging:  # replaces an empty --out; a file put there meanwhile stops it
        staging.mkdir()
        weights_file = staging / "model.safetensors"
        tensors = {k: v.contiguous() for k, v in weights.items()}
        safetensors_module().torch.save_file(tensors, str(weights_file), metadata={
            "format": "pt", SAFETENSORS_KEY: weights_sha256(tensors, None, None)})  # --init-from checks it
        weights_file.chmod(0o666 & ~_umask())  # save_file makes it its owner's alone; an export is for others too
        written = ["model.safetensors"]
        if config is not None:
            config.save_pretrained(staging)
            written.append("config.json")
        if tokenizer is not None:
            shutil.copyfile(tokenizer, staging / "tokenizer.json")
            written.append("tokenizer.json")
    return written, note


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _once(state: dict[str, Any], config: Any) -> dict[str, Any]:
    """``state`` with each tied weight once (the name that comes first: the embedding, not the head), as the
    model built from ``config`` ties them; a state of another model kept whole."""
    if config is None:
        return dict(state)
    import torch

    from fourfold.models.hf import causal_lm_class
    from fourfold.models.weights import tied_names, weight_problems

    with torch.device("meta"):
        model = causal_lm_class(config.model_type)(config)
    problems = weight_problems(model, {k: tuple(v.shape) for k, v in state.items()})
    if problems:  # a run that recorded no config's keys (with --init-from a directory, before 2026-11-24)
        raise ValueError(f"the run's model.pt must fit the {config.model_type} config the run recorded, got "
                         f"{problems}. Its config.json would build another model: save this model.pt with "
                         "save_pretrained from Python, building it from the config it was trained with.")
    tied = tied_names(model)
    kept: dict[str, Any] = {}
    for name, value in state.items():
        if not tied.get(name, set()) & kept.keys():
            kept[name] = value
    return kept


def _tokenizer(train: dict[str, Any], run: Path) -> tuple[Path | None, str]:
    """(the tokenizer.json the run read its text through: ``--tokenizer FILE``, or ``bpe:N``'s in the run; a
    note saying which, or why none)."""
    spec = train.get("tokenizer") or "bytes"
    if spec == "bytes":
        return None, "the run read UTF-8 bytes (ids 0-255): no tokenizer.json"
    # an older run recorded the path as typed: relative to where it ran, which is not known; try the run's folder
    found = run / "tokenizer.json" if spec.startswith("bpe:") else Path(spec)
    if found.is_file():
        return found, f"tokenizer.json from {found}"
    return None, f"no tokenizer.json: the run's ({found}) is gone"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fourfold export", description="a run's final weights as a Hugging Face "
                                     "directory (model.safetensors, config.json, tokenizer.json)")
    parser.add_argument("run", help="a run's --out (its model.pt), or a model.pt")
    parser.add_argument("--out", required=True, help="a new or empty directory to write into")
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        written, note = export(ns.run, ns.out)
    except ValueError as e:
        print(f"fourfold export: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"fourfold export: error: writing {ns.out} failed, nothing left there: {e}", file=sys.stderr)
        return 1
    weights = Path(ns.out) / "model.safetensors"
    print(f"fourfold export: wrote {', '.join(written)} to {ns.out}; {note}"
          + ("" if "config.json" in written else f". --init-from {weights} takes it, with the run's --model and "
             "flags"))
    return 0
