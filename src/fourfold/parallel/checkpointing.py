"""Activation checkpointing per block: keep a block's input, drop what its forward saved, recompute it in
backward. Memory for compute: a checkpointed block holds one tensor (its input) from forward to backward
instead of every intermediate, and runs its forward twice.

    checkpoint_blocks(model.blocks, parse_policy("every-2"))   # blocks 0, 2, 4, ...

Built on ``torch.utils.checkpoint`` (non-reentrant: keyword arguments, ``autograd.grad`` and the split backward
of zero-bubble schedules work; the RNG state is restored, so dropout draws the same mask twice). The block's
``forward`` is wrapped in place, so parameter names do not change. Each of ``captures``, called at forward
time, returns what re-enters the forward's context in the recompute (the engine passes the packed documents'
layout, which a context variable holds during forward only, and on several ranks the dropout streams,
:meth:`fourfold.parallel.rng.Streams.capture`). Tensor-parallel collectives inside a block run again in
the recompute, as in Megatron-LM: counted, and drawn, where they happen.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["POLICY_HELP", "Capture", "checkpoint_blocks", "parse_policy"]

POLICY_HELP = "none, full (every block), or every-N (blocks 0, N, 2N, ...)"
Capture = Callable[[], Callable[[], AbstractContextManager[Any]]]


def parse_policy(spec: str) -> int:
    """``"none"`` -> 0, ``"full"`` -> 1, ``"every-N"`` -> N (checkpoint blocks 0, N, 2N, ...)."""
    if spec == "none":
        return 0
    if spec == "full":
        return 1
    m = re.fullmatch(r"every-([1-9]\d*)", spec)
    if m is None:
        raise ValueError(f"activation_checkpointing must be {POLICY_HELP}, got {spec!r}. Pass e.g. full or every-2")
    return int(m.group(1))


def checkpoint_blocks(blocks: Sequence[nn.Module], every: int, *captures: Capture) -> list[int]:
    """Checkpoint blocks 0, ``every``, 2 ``every``, ... (none for 0); returns their indices. Idempotent."""
    chosen = [i for i in range(len(blocks)) if every and i % every == 0]
    for i in chosen:
        block = blocks[i]
        if not getattr(block, "_fourfold_checkpointed", False):
            block.forward = _checkpointed(block.forward, captures)  # type: ignore[method-assign]
            block._fourfold_checkpointed = True  # type: ignore[assignment]
    return chosen


def _checkpointed(inner: Callable[..., Any], captures: Sequence[Capture]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return inner(*args, **kwargs)
        agains = [capture() for capture in captures]

        def run(*a: Any, **k: Any) -> Any:
            with contextlib.ExitStack() as stack:
                for again in agains:
                    stack.enter_context(again())
                return inner(*a, **k)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    return forward

