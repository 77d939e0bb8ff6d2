"""Dropout inside tensor-parallel regions draws per tp rank: the hooks that switch a sharded model between its
rank's two dropout streams (:mod:`fourfold.parallel.rng`).

    draw_per_rank(model, streams)                                  # after tensor_parallel / shard_regions

A column layer's output (heads, MLP columns) differs on every tp rank until its row layer sums it: dropout there
(attention's on its probabilities, an MLP's between its layers) draws from the rank's sharded stream. The row
layer's all-reduced output is the same on every rank again, and so are its masks (the shared stream). Under
sequence parallelism the whole of every block runs on this rank's positions or heads: sharded throughout.

A recompute must re-enter the streams as its forward found them: fourfold's activation checkpointing does
(:meth:`~fourfold.parallel.rng.Streams.capture`); a checkpoint of the model's own (Hugging Face's
``activation_checkpointing_enable()``) restores torch's generator only, and would draw other masks inside the
regions: :func:`fourfold.parallelize` refuses it under tp where the model has dropout. A pipeline stage that
starts between a column layer and its row layer (a boundary of your own) starts in the sharded stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from fourfold.parallel.rng import Streams
from fourfold.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["contain", "draw_per_rank"]


def draw_per_rank(model: nn.Module, streams: Streams, sequence_sharded: Sequence[nn.Module] = ()) -> None:
    """Hooks on a tensor-parallel ``model`` that draw its sharded activations' masks from the sharded stream:
    from a column layer's output (not gathered) to its row layer's output (unless that is sequence-sharded),
    and through each module of ``sequence_sharded`` (under sequence parallelism, the blocks: everything in them
    is split by head or by position). ``model``'s own forward leaves the streams as it found them."""
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear):
            module.register_forward_hook(_after_column(streams))
        elif isinstance(module, RowParallelLinear):
            module.register_forward_hook(_after_row(streams))
    for module in sequence_sharded:
        _around(module, streams, shard=True)
    contain([model], streams)


def contain(modules: Sequence[nn.Module], streams: Streams) -> None:
    """Each of ``modules``' forwards leaves the streams as it found them: a pipeline's stages, which its runtime
    calls one by one (a stage ending in a column layer, a vocabulary-split head, would leave the next call in the
    sharded stream). A stage that starts inside a region (its first tensor-parallel layer a row layer: the
    boundary fell between a column layer and its row layer) starts in the sharded stream."""
    for module in modules:
        _around(module, streams, shard=_starts_in_region(module))


def _starts_in_region(module: nn.Module) -> bool:
    first = next((m for m in module.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))), None)
    return isinstance(first, RowParallelLinear) and not first.sequence_parallel


def _around(module: nn.Module, streams: Streams, shard: bool) -> None:
    marks: list[int] = []
    module.register_forward_pre_hook(_enter(streams, marks, shard))
    module.register_forward_hook(_leave(streams, marks), always_call=True)  # also when its forward raises


def _after_column(streams: Streams) -> Callable[..., None]:
    def hook(module: ColumnParallelLinear, args: Any, out: Any) -> None:
        if not module.gather_output:  # gathered (a head's logits made whole): the same on every tp rank
            streams.into_shard()
    return hook


def _after_row(streams: Streams) -> Callable[..., None]:
    def hook(module: RowParallelLinear, args: Any, out: Any) -> None:
        if not module.sequence_parallel:  # all-reduced: the same on every tp rank
            streams.out_of_shard()
    return hook


def _enter(streams: Streams, marks: list[int], shard: bool) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        marks.append(streams.depth)
        if shard:
            streams.into_shard()
    return hook


def _leave(streams: Streams, marks: list[int]) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, out: Any) -> None:
        if marks:
            streams.unwind(marks.pop())
    return hook
