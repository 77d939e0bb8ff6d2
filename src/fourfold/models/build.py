"""The model a run trains, named on the command line: ``tinygpt``, ``gpt2``, ``llama`` or ``MODULE:FACTORY``.

    fourfold train --model gpt2 --model-config tiny.json --tp 2
    fourfold train --model mypkg.models:build --model-config kwargs.json --pp 2

Every rank builds the same model from the same seed; :func:`check_model` refuses what cannot run (heads tp does
not divide, too few blocks for the stages, a vocabulary smaller than the tokenizer's, sequences longer than the
model's positions) before any process starts. A model of your own carries its plan and split as attributes
(``fourfold_tp_plan``, ``fourfold_split``); see docs/your-model.md.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from fourfold.models.gpt import TinyGPT
from fourfold.models.hf import FAMILIES, read_model_config
from fourfold.models.meta import on_meta

__all__ = ["ModelError", "ModelInfo", "build_model", "meta_model", "build_unfilled", "builds_unfilled", "built_info", "check_causal", "check_forward",
           "check_model", "check_vocab", "first_weights", "model_info", "num_parameters"]


class ModelError(ValueError):
    """The user's model cannot be built or run as the flags configure it (a bad factory keyword, sequences longer
    than its context): the run is refused before any process starts."""

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class ModelInfo:
    """What the CLI knows of a model before building it (None: not known until it is built)."""

    label: str
    vocab_size: int | None
    blocks: int | None  # pipeline blocks: embedding, layers, head
    positions: int | None  # the longest sequence it takes


def model_info(cfg: Any) -> ModelInfo:
    """``cfg``: a :class:`fourfold.config.Config`. Reads a Hugging Face config; builds nothing."""
    name = cfg.train.model
    if name == "tinygpt":
        m = cfg.model
        return ModelInfo("TinyGPT", m.vocab_size, m.n_layer + 2, m.seq_len)
    if name in FAMILIES:
        from fourfold.models.hf import hf_config, sizes

        s = sizes(hf_config(name, model_config_path(cfg.train)))
        return ModelInfo(s.label, s.vocab_size, s.layers + 2, s.positions)
    _factory(name)  # importable, callable: checked now
    return ModelInfo(name, None, None, None)


def _factory(name: str) -> Any:
    module, _, attr = name.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # `--model mymodel:build` beside mymodel.py, as `python -m` would find it
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise ModelError(f"model {name!r}: cannot import {module!r} ({e}). Run from the directory holding it, "
                         "or install its package") from None
    except AttributeError:
        raise ModelError(f"model {name!r}: {module!r} has no {attr!r}. Name a function that returns an "
                         "nn.Module") from None
    if not callable(fn):
        raise ModelError(f"model {name!r}: {attr} must be a function returning an nn.Module, got "
                         f"{type(fn).__name__}.")
    return fn


def check_model(cfg: Any, tp: int, stages: int) -> ModelInfo:
    """Refuse, before any process starts, a model this layout cannot run; returns what it read."""
    info = model_info(cfg)
    if cfg.train.model in FAMILIES:
        from fourfold.models.hf import check_tp, hf_config

        check_tp(hf_config(cfg.train.model, model_config_path(cfg.train)), tp)
    if info.blocks is not None and stages > info.blocks:
        raise ValueError(f"stages must be at most the model's blocks (embedding, {info.blocks - 2} layers, head), "
                         f"got pp*virtual={stages} > {info.blocks}. Use fewer --pp or a model with more layers")
    if info.positions is not None and cfg.model.seq_len > info.positions:
        raise ValueError(f"seq_len must be at most the model's positions, got seq_len={cfg.model.seq_len} and "
                         f"{info.positions} positions in {info.label}. Pass --seq-len {info.positions}")
    return info


def check_vocab(info: ModelInfo, tokens: int, source: str = "the tokenizer makes") -> None:
    """The model's vocabulary must cover the ``tokens`` ids the data holds (``source`` says where from)."""
    if info.vocab_size is not None and info.vocab_size < tokens:
        fix = (f"Pass --vocab-size {tokens} (or more)" if info.label == "TinyGPT" else
               f"Build the model with a vocabulary of {tokens} (or more): its factory's keyword, in --model-config"
               if ":" in info.label else f"Set vocab_size to {tokens} (or more) in --model-config")
        raise ValueError(f"vocab_size must cover the data's tokens: {source} ids 0..{tokens - 1}, got "
                         f"vocab_size={info.vocab_size} in {info.label}. {fix}.")


def built_info(info: ModelInfo, model: nn.Module) -> ModelInfo:
    """``info`` with what only the built model tells: a model of your own's vocabulary (its config's, or its
    first nn.Embedding's)."""
    if info.vocab_size is not None:
        return info
    config = getattr(model, "config", None)
    if isinstance(getattr(config, "vocab_size", None), int):
        return replace(info, vocab_size=int(config.vocab_size))  # type: ignore[union-attr]
    first = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return replace(info, vocab_size=first.num_embeddings) if first is not None else info


def model_config_path(t: Any) -> str | None:
    """The JSON file that sizes a Hugging Face model: ``--model-config``, or ``--init-from``'s directory's
    ``config.json``."""
    if t.model_config is None and t.init_from is not None and os.path.isdir(t.init_from):
        return os.path.join(t.init_from, "config.json")
    return t.model_config


def build_model(cfg: Any, device: torch.device | str = "cpu", *, weights: bool = True) -> nn.Module:
    """The run's model, as every rank and the one-process reference build it (same config, same seed), with
    ``--init-from``'s weights loaded unless ``weights`` is False (an estimate's model) or it is built on the meta
    device (shapes only)."""
    model = _build(cfg, device)
    if cfg.train.init_from is not None and weights and torch.device(device).type != "meta":
        from fourfold.models.weights import load_weights

        load_weights(model, cfg.train.init_from)
    return model


def build_unfilled(cfg: Any, device: torch.device | str = "cpu") -> nn.Module:
    """The run's model for weights that come after a layout has cut it (``--init-from``'s, a checkpoint's, a
    fresh Hugging Face model's seeded ones: :func:`first_weights`, :meth:`~fourfold.engine.step.Engine.load_state_dict`):
    TinyGPT and the Hugging Face families built with their parameters on the meta device, then given zeros in
    memory untouched until written (:func:`~fourfold.models.weights.zero_pages`), so each rank's host memory holds
    the part it keeps, not the whole model (on a GPU the zeros are the device's, whole until the cut). A model of
    your own (``--model module:factory``, which may read its values as it builds) is built whole, as for a fresh
    run."""
    from fourfold.models.weights import zero_pages

    if cfg.train.model == "tinygpt":
        return zero_pages(_build(cfg, "meta"), device)
    if cfg.train.model in FAMILIES:
        return zero_pages(_build(cfg, None, filled=False), device)
    return _build(cfg, device)


def builds_unfilled(cfg: Any, resuming: bool) -> bool:
    """Whether a run builds its model unfilled (:func:`build_unfilled`) and fills it once the layout has cut it:
    from a checkpoint, from ``--init-from``, and a fresh Hugging Face model (:func:`first_weights`). TinyGPT,
    small by design, and a model of your own start as built."""
    return resuming or cfg.train.init_from is not None or cfg.train.model in FAMILIES


def first_weights(cfg: Any, model: nn.Module) -> contextlib.AbstractContextManager[Mapping[str, torch.Tensor]]:
    """What fills a model :func:`build_unfilled` made, not resumed, once a layout has cut it
    (``engine.load_state_dict``), as a context manager whose end lets go of what it held (StoredWeights' files,
    SeededInit's last unit): ``--init-from``'s stored weights, else a Hugging Face model's seeded ones
    (:func:`fourfold.models.hf.seeded`: each rank makes only the layers it keeps, the values one process makes).
    ``model``: the whole model, before anything cuts it."""
    if cfg.train.init_from is not None:
        from fourfold.models.weights import StoredWeights

        return StoredWeights(cfg.train.init_from, model)
    from fourfold.models.hf import seeded

    return seeded(model, cfg.train.seed)


def _build(cfg: Any, device: torch.device | str | None, filled: bool = True) -> nn.Module:
    """The model as configured, on ``device`` (None: where it was made). The global generator is left at the
    seed, however much the model's initialisation drew from it (nothing, built unfilled): a run's dropout then
    starts where ``--verify``'s one-process re-run, which builds it whole, starts."""
    model = _construct(cfg, device, filled)
    torch.manual_seed(cfg.train.seed)
    return model


def _construct(cfg: Any, device: torch.device | str | None, filled: bool) -> nn.Module:
    t = cfg.train
    dtype = DTYPES[t.dtype]
    if t.model == "tinygpt":
        return TinyGPT(cfg.model, seed=t.seed, dtype=dtype, device="cpu" if device is None else device)
    if t.model in FAMILIES:
        from fourfold.models.hf import build_hf

        filled = filled and (device is None or torch.device(device).type != "meta")  # shapes only: nothing made
        model = build_hf(t.model, model_config_path(t), seed=t.seed, dtype=dtype, filled=filled)
        return model if device is None else model.to(device)
    torch.manual_seed(t.seed)
    factory, kwargs = _factory(t.model), read_model_config(t.model_config)
    try:
        model = factory(**kwargs)
    except Exception as e:
        given = f" with --model-config {t.model_config}'s {kwargs}" if t.model_config else " with no arguments"
        raise ModelError(f"model {t.model!r}: building it{given} failed: {type(e).__name__}: {e}. Fix the factory's "
                         "arguments (--model-config is a JSON object of its keyword arguments).") from e
    if not isinstance(model, nn.Module):
        raise TypeError(f"model {t.model!r} must return an nn.Module, got {type(model).__name__}.")
    return _floating_to(model if device is None else model.to(device=device), dtype)


def _floating_to(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with its floating-point parameters and buffers in ``dtype``, as ``model.double()`` and
    ``model.float()`` cast; a complex buffer (a RoPE cache of ``freqs_cis``) and integer ones are left as they
    are. (``model.to(dtype)`` would cast the complex ones too, keeping only their real part: the model trained
    would not be the one you wrote, and ``--verify``'s reference, cast alike, could not tell.)"""
    return model.double() if dtype == torch.float64 else model.float()


def check_forward(model: nn.Module, cfg: Any) -> None:
    """Run ``model`` on one sequence of ``--seq-len`` tokens (id 0); a failure is the model's or its flags' (the
    sequence longer than its positions, a forward that needs other inputs): :class:`ModelError`."""
    n = cfg.model.seq_len
    try:
        with torch.no_grad():
            out = model(torch.zeros(1, n, dtype=torch.long, device=next(model.parameters()).device))
    except Exception as e:
        raise ModelError(f"model {cfg.train.model!r}: its forward on one sequence of --seq-len {n} tokens failed: "
                         f"{type(e).__name__}: {e}. Is --seq-len longer than the model's context (its positions)? "
                         "Pass a --seq-len it can take; fourfold calls model(ids) with ids of shape (batch, "
                         "seq_len).") from e
    _logits(out, cfg)


def _logits(out: Any, cfg: Any) -> torch.Tensor | None:
    """The logits ``out`` stands for (None: none, the engine's first step says what it got); an output with a loss
    beside them that fourfold's would drop is the model's refusal (:class:`ModelError`)."""
    from fourfold.parallel.pipeline.blocks import output_tensor

    try:
        return output_tensor(out)
    except TypeError:
        return None
    except ValueError as e:
        raise ModelError(f"model {cfg.train.model!r}: {e}.") from None


def check_causal(model: nn.Module, cfg: Any) -> None:
    """Refuse a model of yours whose logits at a position depend on later tokens (a bidirectional encoder, BERT's):
    fourfold train trains next-token prediction, through which such a model would see the token each position
    learns to predict, and train on without a word. Two forwards in eval mode (no dropout) on one sequence of
    ``--seq-len`` tokens, all 0, then the last one 1: every earlier position's logits must stay as they were."""
    n = cfg.model.seq_len
    if n < 2:
        return
    device = next(model.parameters()).device
    ids = torch.zeros(1, n, dtype=torch.long, device=device)
    changed = ids.clone()
    changed[0, -1] = 1
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            before, after = model(ids), model(changed)
    finally:
        model.train(was_training)
    before, after = _logits(before, cfg), _logits(after, cfg)
    if before is None or after is None or before.dim() < 2 or before.shape != after.shape:
        return  # not logits of shape (batch, seq, ...): the loss says what is wrong
    earlier = (before[0, :-1] - after[0, :-1]).abs()
    if earlier.max().item() > 1e-6 * max(1.0, before[0, :-1].abs().max().item()):
        first = int(earlier.flatten(1).amax(1).nonzero()[0, 0]) if earlier.dim() > 1 else 0
        raise ModelError(f"model {cfg.train.model!r} is not causal: its logits at position {first} changed by "
                         f"{earlier.max().item():.3g} when only the last of --seq-len {n} tokens did, so training it "
                         "to predict each next token would let every position see the token it predicts (a "
                         "bidirectional encoder, such as BERT). fourfold train trains causal language models: mask "
                         "attention to earlier positions (is_causal=True), or train it in a loop of your own with "
                         "your loss (docs/your-model.md).")


def num_parameters(model: nn.Module) -> int:
    """Scalar parameters, a tied weight once."""
    return sum(p.numel() for p in model.parameters())


def meta_model(cfg: Any) -> nn.Module | None:
    """The run's model built on the meta device (shapes, no memory, no weights) for the checks before launch;
    None for a model of your own that cannot be built there. :func:`preflight` builds it once for them all."""
    try:
        with on_meta():
            return build_model(cfg, "meta")
    except Exception:
        return None
