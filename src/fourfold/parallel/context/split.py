"""What the engine holds for the sequence axis: :class:`ContextParallel` cuts each batch's sequences into this
rank's positions and makes its :class:`~fourfold.parallel.context.attention.ContextShard` current while the
model runs; :data:`WHOLE` (cp = 1) leaves them whole. The engine calls both alike: no branch."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from fourfold.comm import auto as allreduce_auto
from fourfold.comm.p2p import Communicator
from fourfold.observe.trace import Tracer
from fourfold.parallel.context.auto import choose
from fourfold.parallel.context.shard import Algorithm, ContextShard, run_codes, using_shard

__all__ = ["WHOLE", "ContextParallel", "SequenceAxis", "WholeSequence"]

log = logging.getLogger("fourfold.context")


class SequenceAxis(Protocol):
    """How a step's sequences are held: cut for this rank, and current while the model runs on them."""

    size: int

    def cut(self, inputs: Any, targets: torch.Tensor, documents: torch.Tensor | None
            ) -> tuple[Any, torch.Tensor, torch.Tensor | None, ContextShard | None]: ...

    def running(self, shard: ContextShard | None) -> contextlib.AbstractContextManager[None]: ...


class WholeSequence:
    """cp = 1: every rank holds its rows' whole sequences."""

    size = 1

    def cut(self, inputs: Any, targets: torch.Tensor, documents: torch.Tensor | None
            ) -> tuple[Any, torch.Tensor, torch.Tensor | None, ContextShard | None]:
        return inputs, targets, documents, None

    def running(self, shard: ContextShard | None) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


WHOLE = WholeSequence()


class ContextParallel:
    """cp > 1: each sequence cut over ``group`` (head-tail when ``balanced``), attention by ``algorithm`` (``auto``:
    per layer shape from the cost model, :mod:`~fourfold.parallel.context.auto`; :attr:`picks` holds each choice
    and its reason)."""

    def __init__(self, group: dist.ProcessGroup | None, algorithm: Algorithm | Literal["auto"], balanced: bool,
                 tracer: Tracer | None, timeout_s: float) -> None:
        self.comm = Communicator(group, timeout_s)
        self.size = self.comm.size
        self.algorithm, self.balanced, self.tracer = algorithm, balanced, tracer
        self.picks: dict[tuple[int, ...], tuple[Algorithm, str]] = {}
        self._model = None
        if algorithm == "auto":  # rank 0's cost model, broadcast over cp once: every rank picks alike
            self._model = allreduce_auto.attach(self.comm)

    def pick(self, q: torch.Tensor, k: torch.Tensor) -> Algorithm:
        """``auto``'s algorithm for an attention call of these shapes (chosen once per shape; logged)."""
        item = q.element_size()
        key = (*q.shape, *k.shape, item)
        if key not in self.picks:
            assert self._model is not None
            name, reason = choose(self.size, self._model, q_bytes=q.numel() * item, kv_bytes=2 * k.numel() * item,
                                  grad_kv_bytes=2 * k.numel() * max(item, 4), heads=q.size(1), kv_heads=k.size(1))
            self.picks[key] = (name, reason)  # type: ignore[assignment]
            log.info("cp rank %d: auto chose %s: %s", self.comm.rank, name, reason)
        return self.picks[key][0]

    def cut(self, inputs: Any, targets: torch.Tensor, documents: torch.Tensor | None
            ) -> tuple[Any, torch.Tensor, torch.Tensor | None, ContextShard | None]:
        """This rank's positions of the rows' sequences (inputs, targets already shifted on the whole sequence);
        packed documents become their runs' codes (:func:`~fourfold.parallel.context.shard.run_codes`), which
        the runner makes current for each micro-batch as it does documents."""
        if not isinstance(inputs, torch.Tensor) or inputs.dim() != 2:
            raise ValueError(f"context parallelism cuts (B, T) token ids along T, got "
                             f"{type(inputs).__name__ if not isinstance(inputs, torch.Tensor) else tuple(inputs.shape)}.")
        codes = run_codes(documents) if documents is not None else None
        shard = ContextShard(self.comm, self.algorithm, inputs.size(1), self.balanced, self.tracer, codes,
                             self.pick if self.algorithm == "auto" else None)
        mine = shard.mine.to(inputs.device)
        return (inputs[:, mine], targets[:, mine.to(targets.device)],
                codes[:, mine.to(codes.device)] if codes is not None else None, shard)

    def running(self, shard: ContextShard | None) -> contextlib.AbstractContextManager[None]:
        return using_shard(shard)
