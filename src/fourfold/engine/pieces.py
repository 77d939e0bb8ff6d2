"""What ``parallelize`` reads off a model before it cuts it: its blocks, example inputs to check a split on, and a
guard that leaves the model as it was after those checks ran it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from fourfold.engine.batch import cat
from fourfold.parallel.pipeline.blocks import Split, block_paths

__all__ = ["TensorPlan", "examples_for", "model_blocks", "units", "untouched"]

TensorPlan = Callable[..., nn.Module] | Mapping[str, str]
"""A model family's tensor-parallel plan: ``fn(model, group, *, sequence_parallel, tracer) -> sharded model``,
or ``{module name: "column" | "row" | "vocab" | "head"}`` for :func:`~fourfold.parallel.tensor.tensor_parallel`."""


def model_blocks(model: nn.Module, split: Split | None) -> list[nn.Module]:
    """The model's repeated blocks: the split's (given, or the model family's), TinyGPT's ``blocks``, or an
    ``nn.Sequential``'s layers."""
    if split is not None:
        return [model.get_submodule(path) for path in block_paths(model, split.blocks)]
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    if isinstance(model, nn.Sequential):
        return list(model)
    raise ValueError(f"activation checkpointing needs the model's blocks, got a {type(model).__name__} with no "
                     "split and no blocks list. Pass split=fourfold.Split(blocks='path.to.ModuleList') (from "
                     "fourfold train --model MODULE:FACTORY: set model.fourfold_split), or "
                     "activation_checkpointing='none' (--activation-checkpointing none)")


def units(model: nn.Module, split: Split | None) -> list[nn.Module]:
    """ZeRO-3's units, gathered and freed one at a time: the model's blocks, or none (the whole model is one)."""
    try:
        return model_blocks(model, split)
    except ValueError:
        return []


def examples_for(model: nn.Module, example: torch.Tensor | None, family: Any,
                 multiple: int = 1) -> list[torch.Tensor] | None:
    """Inputs to run ``model`` on, first the one a check uses: ``example`` and a batch of two of it, its
    family's (cut to lengths of a ``multiple``: sequence parallelism's tp), or its own ``example_inputs()``; None
    when there is none."""
    if example is not None:
        return [example, cat([example, example])]
    if family is not None and family.examples is not None:
        return [x[:, :max(multiple, x.size(1) - x.size(1) % multiple)] for x in family.examples(model)]
    own = getattr(model, "example_inputs", None)
    return list(own()) if callable(own) else None


@contextlib.contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """The split's check and the pipeline's shape trace run ``model`` on example inputs, in training mode: a
    BatchNorm's running statistics (and ``num_batches_tracked``) would count those runs, and dropout would draw
    from the random generator. Both are put back as they were, so training starts where one process starts."""
    saved = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        yield
    with torch.no_grad():
        for buffer, value in saved:
            buffer.copy_(value)
