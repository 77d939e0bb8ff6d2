"""A batch as a model of yours takes it: a tensor, or a dict, list or tuple of them (nested), every tensor's
dim 0 the rows. The engine cuts such a batch into micro-batches, compares it across ranks and builds examples
of it through these few functions, so ``model(batch)`` may read ``batch["num"]`` and ``batch["cat"]``.

    rows({"num": x, "cat": c})        # x.size(0), checked equal to c.size(0)
    chunk({"num": x, "cat": c}, 2)    # [{"num": x[:n], "cat": c[:n]}, {"num": x[n:], "cat": c[n:]}]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = ["Batch", "cat", "chunk", "leaves", "pad", "rows"]

Batch = Any
"""A tensor, or a dict / list / tuple whose leaves are tensors (other leaves pass through untouched)."""


def leaves(batch: Batch) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``batch`` with its path (``"['num']"``, ``"[1]"``; ``""`` for a tensor alone)."""
    if isinstance(batch, torch.Tensor):
        yield "", batch
    elif isinstance(batch, Mapping):
        for k, v in batch.items():
            for path, t in leaves(v):
                yield f"[{k!r}]{path}", t
    elif isinstance(batch, list | tuple):
        for i, v in enumerate(batch):
            for path, t in leaves(v):
                yield f"[{i}]{path}", t


def _zip(batches: Sequence[Batch], fn: Callable[[list[torch.Tensor]], Any]) -> Any:
    """``batches`` of one structure made one of it: each tensor ``fn`` of the tensors at its place in them all
    (other leaves: the first batch's)."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return fn(list(batches))
    if isinstance(first, Mapping):
        return type(first)({k: _zip([b[k] for b in batches], fn) for k in first})  # type: ignore[call-arg]
    if isinstance(first, list | tuple):
        out = [_zip([b[i] for b in batches], fn) for i in range(len(first))]
        return type(first)(*out) if hasattr(first, "_fields") else type(first)(out)  # a NamedTuple, or not
    return first


def rows(batch: Batch, what: str = "inputs") -> int:
    """The rows of ``batch``: its tensors' common dim 0; refused when they differ or it holds no tensor."""
    sizes = {path: t.size(0) if t.dim() else 0 for path, t in leaves(batch)}
    if not sizes:
        raise TypeError(f"{what} must be a tensor, or a dict, list or tuple of tensors, got {type(batch).__name__}.")
    if len(set(sizes.values())) > 1:
        raise ValueError(f"every tensor of the {what} must have the batch's rows in dim 0, got "
                         f"{', '.join(f'{what}{p}: {n}' for p, n in sizes.items())}. Give each one row per sample.")
    return next(iter(sizes.values()))


def chunk(batch: Batch, k: int) -> list[Batch]:
    """``batch`` cut into ``k`` equal parts along dim 0 (its rows must divide by ``k``)."""
    if k == 1:
        return [batch]
    n = rows(batch) // k

    def part(i: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        return lambda ts: ts[0][i * n:(i + 1) * n]

    return [_zip([batch], part(i)) for i in range(k)]


def cat(batches: Sequence[Batch]) -> Batch:
    """Batches of one structure joined along dim 0."""
    return _zip(batches, torch.cat)


def pad(batch: Batch, extra: int, value: int | float = 0) -> Batch:
    """``batch`` with ``extra`` more rows, every tensor's filled with ``value``."""
    return _zip([batch], lambda ts: torch.cat([ts[0], ts[0].new_full((extra, *ts[0].shape[1:]), value)]))
