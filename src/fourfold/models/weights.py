"""``--init-from``: a run's first weights from a file. Every rank builds the model unfilled (its parameters zeros in
pages untouched until written: :func:`empty_parameters`, :func:`zero_pages`), the layout cuts it, and each rank
fills only the tensors it keeps (:class:`StoredWeights` through :meth:`fourfold.engine.step.Engine.load_state_dict`), so
every layout starts from them; ``--verify``'s one process loads them whole (:func:`load_weights`).

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
import mmap
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fourfold.parallel.tensor.plan import LazyState, fill_pieces

__all__ = ["WEIGHT_FILES", "StoredWeights", "check_file", "check_weights", "empty_parameters", "fill", "hf_directory",
           "load_weights", "model_names", "safetensors_module", "stored_shapes", "tied_names",
           "weight_problems", "zero_pages"]

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
        from fourfold.models.model_pt import check

        obj = check(path, obj)["model"]  # fourfold's model.pt, its weights the ones written
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise ValueError(f"init_from {str(path)!r} must hold a state dict ({{name: tensor}}), got a "
                         f"{type(obj).__name__} of other things.")
    return obj


def _index(path: str | Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every stored weight's name -> its file and shape, the tensors' data left unread (safetensors' header; a
    torch file memory-mapped), except in a file fourfold wrote, whose digest is checked
    (:mod:`fourfold.models.model_pt`)."""
    from fourfold.models.model_pt import SAFETENSORS_KEY, check_tensors

    index: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in _files(Path(path)):
        if f.suffix == ".safetensors":
            with _opened(f) as opened:
                index.update({k: (f, tuple(opened.get_slice(k).get_shape())) for k in opened.keys()})  # noqa: SIM118
                recorded = (opened.metadata() or {}).get(SAFETENSORS_KEY)
                if recorded is not None:
                    check_tensors(f, {k: opened.get_tensor(k) for k in opened.keys()}, recorded)  # noqa: SIM118
        else:
            index.update({k: (f, tuple(v.shape)) for k, v in _torch_file(f).items()})
    return index


def stored_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every stored weight's name and shape, the tensors' data left unread."""
    return {k: shape for k, (_, shape) in _index(path).items()}


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


class StoredWeights(LazyState):
    """The weights stored at ``path`` by ``model``'s own names (checked first by :func:`check_weights`), each read
    from its memory-mapped file only when asked for: ``stored[name]``. A weight ``model`` ties to another and
    stored once is found under either name. Use it as a context manager (it closes the files it opened)::

        with StoredWeights(path, model) as stored:  # model: the whole model, before anything cuts it
            engine = parallelize(model, mesh)
            engine.load_state_dict(stored)          # each rank reads the tensors it holds, and cuts them
    """

    def __init__(self, path: str | Path, model: nn.Module) -> None:
        self.path = Path(path)
        index = _index(path)
        names = check_weights(model, {k: shape for k, (_, shape) in index.items()}, repr(str(path)))
        expected = model.state_dict().keys()  # not the buffers older files hold that the model computes (COMPUTED)
        self._where = {names[k]: (f, k) for k, (f, _) in index.items() if names[k] in expected}  # name -> (file, key)
        for name, others in tied_names(model).items():  # a tied weight stored under one of its names
            if name not in self._where:
                self._where[name] = next(self._where[o] for o in sorted(others) if o in self._where)
        self._files = contextlib.ExitStack()
        self._open: dict[Path, Any] = {}
        self._closed = False
        super().__init__(self._where, self._tensor)

    def _tensor(self, name: str) -> torch.Tensor:
        if self._closed:
            raise ValueError(f"StoredWeights of {str(self.path)!r} is closed; read its tensors inside its with block.")
        f, key = self._where[name]
        if f not in self._open:
            self._open[f] = self._files.enter_context(_opened(f)) if f.suffix == ".safetensors" else _torch_file(f)
        opened = self._open[f]
        return opened.get_tensor(key) if f.suffix == ".safetensors" else opened[key]

    def close(self) -> None:
        self._files.close()
        self._open.clear()
        self._closed = True

    def __enter__(self) -> StoredWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    """Load the weights at ``path`` into the whole ``model`` (:class:`StoredWeights`: checked first), cast to its
    dtype, one tensor at a time from memory-mapped files. Returns ``model``. (A run's ranks load after the
    layout has cut the model, each only what it holds: :meth:`fourfold.engine.step.Engine.load_state_dict`.)"""
    with StoredWeights(path, model) as stored:
        return fill(model, stored)


def fill(model: nn.Module, state: Mapping[str, torch.Tensor]) -> nn.Module:
    """Copy ``state`` (whole tensors by ``model``'s names, read one at a time: :class:`StoredWeights`,
    :class:`~fourfold.models.seeded.SeededInit`) into the whole ``model``, each cast to its dtype, a tied weight
    once: :func:`~fourfold.parallel.tensor.plan.fill_pieces` with nothing cut. Returns ``model``. (A layout's
    ranks take their pieces instead: :meth:`fourfold.engine.step.Engine.load_state_dict`.)"""
    fill_pieces(model.state_dict(), state, {}, 0, 1)
    return model


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Modules built inside put their parameters on the ``meta`` device (shapes and dtypes, no memory, no
    initialisation drawn), their buffers where they were made: what a model computes when built (rotary
    frequencies) stays. :func:`zero_pages` then gives the parameters memory."""
    register = nn.Module.register_parameter
    twins: dict[int, nn.Parameter] = {}  # id of a parameter made -> its meta twin, while the made one lives: one
    # parameter registered on two modules (a tie made while building) stays one, and none is kept alive

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and type(param) is nn.Parameter and not param.is_meta:
            key = id(param)
            if key not in twins:
                twins[key] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
                twins[key].__dict__.update(param.__dict__)
                weakref.finalize(param, twins.pop, key, None)  # gone with it, before its id can be reused
            param = twins[key]
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def zero_pages(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Give each of ``model``'s parameters on the ``meta`` device zeros on ``device``, in place (the same
    ``nn.Parameter`` objects, so ties hold). On the CPU each lies in an anonymous memory map: its pages are the
    kernel's one zero page until written, so a rank that keeps a part of the model and fills it
    (:meth:`~fourfold.engine.step.Engine.load_state_dict`) uses memory for that part only, however much it reads the
    rest meanwhile. The buffers move to ``device``. Returns ``model``."""
    device = torch.device(device)
    for p in model.parameters():  # a tied parameter once
        if p.is_meta:
            zeros = nn.Parameter(_zeros(p.shape, p.dtype, device), requires_grad=p.requires_grad)
            zeros.__dict__.update(p.__dict__)  # attributes set on it (swap_tensors swaps them too)
            torch.utils.swap_tensors(p, zeros)
    meta = [n for n, b in model.named_buffers() if b.is_meta]
    if meta:
        raise ValueError(f"a model built on the meta device must compute its buffers, got {', '.join(meta[:4])} on "
                         "the meta device. Build it under fourfold.models.weights.empty_parameters(), which keeps "
                         "buffers.")
    return model.to(device)


def _zeros(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    numel, size = shape.numel(), torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    private = mmap.mmap(-1, numel * size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared would fill on read
    return torch.frombuffer(private, dtype=dtype, count=numel).view(shape)
