"""``--init-from``: a run's first weights from a file, loaded into the whole model every rank builds, before any
strategy cuts it (so every layout starts from them, and ``--verify``'s one process too).

    fourfold train --model llama --init-from ./my-llama --data my.jsonl ...   # its tokenizer.json, by default
    fourfold train --init-from runs/first/model.pt --steps 200 ...         # go on from a finished run's weights

What can be read:

* a **Hugging Face directory** (what ``save_pretrained`` writes): ``config.json`` sizes the model (its
  ``model_type`` must be ``--model``'s family) and the weights are ``model.safetensors``, or shards listed by
  ``model.safetensors.index.json``, or ``pytorch_model.bin`` (and its index);
* a **file**: ``.safetensors``, or a ``torch.save`` of a state dict (``.pt``, ``.pth``, ``.bin``), fourfold's own
  ``model.pt`` included.

Nothing is downloaded, and nothing in a file runs: safetensors holds tensors only, and ``torch.load`` reads with
``weights_only=True``. Names and shapes are checked against the model before launch (the tensors' data are not
read there), each missing, unexpected or misshapen entry named. A weight the model ties to another (GPT-2's head
and token embedding) may be stored once, as ``save_pretrained`` does. The optimiser starts afresh: to continue a
run with its optimiser and data order, ``--resume`` its checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["WEIGHT_FILES", "check_file", "check_weights", "hf_directory", "load_weights", "model_names", "safetensors_module",
           "stored_shapes", "stored_weights", "tied_names", "weight_problems"]

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
"""A Hugging Face directory's weights, in the order they are looked for."""
SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
COMPUTED = (".inv_freq", ".attn.masked_bias", ".attn.bias")
"""Buffers older checkpoints hold that a model computes itself (rotary frequencies, GPT-2's causal mask): ignored."""


def hf_directory(path: str | Path) -> dict[str, Any] | None:
    """The ``config.json`` of a Hugging Face model directory, or None when ``path`` is not a directory."""
    folder = Path(path)
    if not folder.is_dir():
        return None
    config = folder / "config.json"
    try:
        values = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"init_from must be a Hugging Face model directory (config.json and its weights) or a "
                         f"weights file, got the directory {str(path)!r} without a readable config.json ({e}).") \
            from None
    if not isinstance(values, dict):
        raise ValueError(f"init_from's config.json must hold a JSON object, got {type(values).__name__} in {config}.")
    return values


def check_file(path: str | Path) -> None:
    """Refuse a ``path`` that is not a directory and not a weights file (:data:`SUFFIXES`) that exists."""
    if not Path(path).is_dir() and (Path(path).suffix not in SUFFIXES or not Path(path).is_file()):
        raise ValueError(f"init_from must be a Hugging Face model directory or a weights file ({', '.join(SUFFIXES)}), "
                         f"got {str(path)!r}. Pass save_pretrained's directory, a .safetensors file, or a run's "
                         "model.pt.")


def _files(path: Path) -> list[Path]:
    """The files holding the weights at ``path``: itself, or a Hugging Face directory's (all its shards)."""
    check_file(path)
    if not path.is_dir():
        return [path]
    for name in WEIGHT_FILES:
        found = path / name
        if not found.is_file():
            continue
        if not name.endswith(".index.json"):
            return [found]
        try:
            weight_map = json.loads(found.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"init_from's {name} must map every weight to its file (weight_map), got {found}: "
                             f"{type(e).__name__}: {e}.") from None
        shards = [path / f for f in sorted(set(weight_map.values()))]
        gone = [f.name for f in shards if not f.is_file()]
        if gone:
            raise ValueError(f"init_from's {name} lists shards that are not there, got {', '.join(gone[:4])} "
                             f"missing from {str(path)!r}. Copy the whole directory save_pretrained wrote.")
        return shards
    raise ValueError(f"init_from's directory {str(path)!r} holds no weights: none of {', '.join(WEIGHT_FILES)}. "
                     "Save the model there with save_pretrained.")


def safetensors_module() -> Any:
    """The safetensors package, or a ValueError saying how to install it."""
    try:
        import safetensors.torch
    except ImportError:
        raise ValueError("reading .safetensors needs the safetensors package, got none installed. Install it with: "
                         "pip install 'fourfold[hf]' (or pip install safetensors).") from None
    return safetensors


def _torch_file(path: Path) -> dict[str, torch.Tensor]:
    """A ``torch.save`` of a state dict, or of fourfold's ``{"model": ..., "config": ..., "step": ...}``."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # not a torch file, or one holding more than tensors and plain data
        raise ValueError(f"init_from {str(path)!r} must be a state dict saved with torch.save (read with "
                         f"weights_only=True), got {type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict) and "config" in obj:
        obj = obj["model"]  # fourfold's model.pt
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise ValueError(f"init_from {str(path)!r} must hold a state dict ({{name: tensor}}), got a "
                         f"{type(obj).__name__} of other things.")
    return obj


def stored_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every stored weight's name and shape, the tensors' data left unread (safetensors' header; a torch file
    memory-mapped)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in _files(Path(path)):
        if f.suffix == ".safetensors":
            with _opened(f) as opened:
                shapes.update({k: tuple(opened.get_slice(k).get_shape()) for k in opened.keys()})  # noqa: SIM118
        else:
            shapes.update({k: tuple(v.shape) for k, v in _torch_file(f).items()})
    return shapes


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[Any]:
    """A safetensors file, open; one that is not (a truncated download, another format) refused in one line."""
    try:
        opened = safetensors_module().safe_open(str(path), framework="pt")
    except ValueError:
        raise
    except Exception as e:  # safetensors' own SafetensorError, an OSError
        raise ValueError(f"init_from {str(path)!r} must be a safetensors file, got {type(e).__name__}: "
                         f"{str(e).splitlines()[0][:300]}. Save it again (save_pretrained, or safetensors' "
                         "save_file).") from None
    with opened:
        yield opened


def stored_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights stored at ``path`` (every shard of a directory), one at a time on the CPU, memory-mapped (from
    safetensors each as it is asked for; a torch file with ``mmap=True``)."""
    for f in _files(Path(path)):
        if f.suffix == ".safetensors":
            with _opened(f) as opened:
                for key in opened.keys():  # noqa: SIM118
                    yield key, opened.get_tensor(key)
        else:
            yield from _torch_file(f).items()


def tied_names(model: nn.Module) -> dict[str, set[str]]:
    """name -> the other names of the same tensor (a weight two modules share)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {n: set(names) - {n} for names in by_id.values() if len(names) > 1 for n in names}


def model_names(model: nn.Module, stored: Iterable[str]) -> dict[str, str]:
    """stored name -> the model's name for it: the same, or with the model's ``base_model_prefix`` added or taken
    away (a Hugging Face base model's checkpoint: GPT-2's on the Hub stores ``h.0.attn.c_attn.weight`` for the
    causal LM's ``transformer.h.0.attn.c_attn.weight``; ``from_pretrained`` reads it the same way)."""
    expected = model.state_dict().keys()
    prefix = getattr(model, "base_model_prefix", "")
    out = {}
    for name in stored:
        if name not in expected and prefix and f"{prefix}.{name}" in expected:
            out[name] = f"{prefix}.{name}"
        elif name not in expected and prefix and name.removeprefix(prefix + ".") in expected:
            out[name] = name.removeprefix(prefix + ".")
        else:
            out[name] = name
    return out


def check_weights(model: nn.Module, shapes: Mapping[str, tuple[int, ...]], source: str) -> dict[str, str]:
    """Refuse ``shapes`` (name -> shape, as stored at ``source``) that do not fill ``model`` exactly
    (:func:`weight_problems`; names as :func:`model_names` reads them), naming the first few of each kind; else
    the stored names' model names."""
    names = model_names(model, shapes)
    twice = sorted(n for n, count in collections.Counter(names.values()).items() if count > 1)
    if twice:  # stored with and without the prefix: which one would load?
        raise ValueError(f"init_from {source} must hold each weight once, got {', '.join(twice[:4])} stored under "
                         f"two names (with and without {getattr(model, 'base_model_prefix', '')!r}). Save it again "
                         "with one name per weight.")
    problems = weight_problems(model, {names[k]: v for k, v in shapes.items()})
    if problems:
        raise ValueError(f"init_from {source} must hold the model's weights by its own names and shapes, got "
                         f"{problems}. Build the model these weights were saved from (the same "
                         "--model and --model-config, or the directory's config.json).")
    return names


def weight_problems(model: nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> str:
    """What keeps ``shapes`` (name -> shape) from filling ``model`` exactly, "" when nothing: every entry of its
    state dict present (a tied weight once is enough) with its shape, and nothing else but buffers the model
    computes itself (:data:`COMPUTED`); the first few names of each kind."""
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    tied = tied_names(model)
    missing = [n for n in expected if n not in shapes and not tied.get(n, set()) & shapes.keys()]
    unexpected = [n for n in shapes if n not in expected and not n.endswith(COMPUTED)]
    wrong = [f"{n} {list(shapes[n])} (the model's: {list(expected[n])})" for n in expected
             if n in shapes and tuple(shapes[n]) != expected[n]]
    problems = []
    for what, names in (("missing", missing), ("not in the model", unexpected), ("of another shape", wrong)):
        if names:
            problems.append(f"{len(names)} {what}: {', '.join(names[:4])}"
                            + (f" and {len(names) - 4} more" if len(names) > 4 else ""))
    return "; ".join(problems)


def load_weights(model: nn.Module, path: str | Path) -> nn.Module:
    """Load the weights at ``path`` into ``model`` (checked first by :func:`check_weights`), cast to its dtype,
    one tensor at a time from memory-mapped files (file pages a machine's ranks share, not a private copy of the
    model). Returns ``model``."""
    names = check_weights(model, stored_shapes(path), repr(str(path)))
    expected = model.state_dict().keys()
    for name, value in stored_weights(path):  # each through the model's own loading (its hooks, if it has any)
        if names[name] in expected:  # not a buffer the model computes itself (COMPUTED)
            model.load_state_dict({names[name]: value}, strict=False)
    return model
