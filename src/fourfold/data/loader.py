"""Per-rank shards of each global batch, a pure function of (seed, step), and what every loader shares (the
epoch order, the id check, the step as the whole state, :class:`Batch`).

    from fourfold.data import BatchLoader, load_corpus

    corpus = load_corpus()                                   # ~2 MiB of stdlib .py files, as bytes
    loader = BatchLoader(corpus, batch_size=8, seq_len=64, seed=0, dp_rank=1, dp_size=2)
    x, y = loader.shard(step=0)                              # (4, 64), (4, 64): rows 4..7 of the batch
    X, Y = loader.global_batch(step=0)                       # (8, 64): what one process would see

The corpus is cut into n = N // (T+1) windows of T+1 tokens, epoch e visits them in the order randperm(n) drawn
from seed*1_000_003 + e, and step s takes positions [s*B, (s+1)*B) of the endless concatenation of epochs.
Resuming is setting the step. Only the windows a batch takes are read (a memory-mapped corpus stays on disk).
With ``eval_batches=E``, E*B windows spread evenly through the corpus are held out (:class:`HeldOut`): training
visits the others, and ``eval_batch(i)`` reads held-out batch i.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fourfold.data.corpus import Corpus

__all__ = ["HELD_OUT", "Batch", "BatchLoader", "EpochOrder", "HeldOut", "StepLoader", "check_eval_batch", "check_ids", "held_out"]


HELD_OUT = "spread"
"""How a run records which data evaluation holds out (:class:`HeldOut`): every
``stride``-th item. Runs before 2026-11-24 held out the data's end and recorded nothing."""


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value >= high)
    ):
        rule = f"an integer in [{low}, {high})" if high is not None else f"an integer >= {low}"
        raise ValueError(f"{name} must be {rule}, got {name}={value!r}. Pass {name} as {rule}")


@dataclass
class Batch:
    """What one rank trains on in a step. ``documents`` (B, T): which document each position belongs to (-1:
    padding), None for windows of a stream; ``num_tokens``: real targets in the whole global batch (every rank,
    every micro-batch), the loss's divisor. ``stats``: the global batch's figures."""

    inputs: torch.Tensor
    targets: torch.Tensor
    documents: torch.Tensor | None = None
    num_tokens: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    def step_args(self, device: torch.device | str) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, Any]]:
        """``engine.step(*args, **kwargs)`` on ``device``."""
        docs = None if self.documents is None else self.documents.to(device)
        return ((self.inputs.to(device), self.targets.to(device)),
                {"documents": docs, "num_tokens": self.num_tokens} if docs is not None else {})


class HeldOut:
    """Which of ``n`` items (windows or documents) evaluation holds out: ``count`` of them spread evenly through
    the data, the middle item of each of ``count`` equal stretches (every ``stride``-th), not its end, so the
    held-out loss reads every part of a corpus ordered by source or time. Training numbers the others
    0..n-count-1 in their order; :meth:`trained` maps those numbers to items, :meth:`held` the held-out ones'.
    Arithmetic only: nothing of size n is made."""

    def __init__(self, n: int, count: int) -> None:
        self.n, self.count = n, count
        self.stride = n // count if count else 0  # >= 2: held_out() keeps count <= n / 2
        self.offset = self.stride // 2

    def held(self, k: torch.Tensor) -> torch.Tensor:
        """Held-out item ``k`` (0 <= k < count) of each element."""
        return k * self.stride + self.offset

    def trained(self, position: torch.Tensor) -> torch.Tensor:
        """The item training numbers ``position`` (0 <= position < n - count) of each element."""
        if not self.count:
            return position
        per = self.stride - 1  # training items in each stretch; after the last stretch, all are
        block, r = position // per, position % per
        inside = block * self.stride + r + (r >= self.offset).long()
        return torch.where(position < self.count * per, inside, position + self.count)


class EpochOrder:
    """The endless sequence of epochs over ``n`` items: epoch e visits them in ``randperm(n)`` drawn from
    seed*1_000_003 + e, so any position's item is a pure function of (seed, position). With ``held`` (n its
    training items), the items are its training items (:meth:`HeldOut.trained`)."""

    def __init__(self, n: int, seed: int, held: HeldOut | None = None) -> None:
        self.n, self.seed, self.held = n, seed, held
        self._perms: dict[int, torch.Tensor] = {}

    @classmethod
    def training(cls, held: HeldOut, seed: int) -> EpochOrder:
        """The epochs over ``held``'s training items: the held-out ones are never visited."""
        return cls(held.n - held.count, seed, held)

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of ``epoch``, (n,)."""
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a step spans at most a few epochs; keep the cache tiny
                self._perms.pop(next(iter(self._perms)))
            gen = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.n, generator=gen)  # (n,)
        return self._perms[epoch]

    def take(self, start: int, stop: int) -> torch.Tensor:
        """Items at positions [start, stop), (stop - start,) int64; a range may span epoch boundaries."""
        n = self.n
        out = torch.empty(stop - start, dtype=torch.long)
        for epoch in range(start // n, (stop - 1) // n + 1):
            lo, hi = max(start, epoch * n), min(stop, (epoch + 1) * n)
            out[lo - start : hi - start] = self.permutation(epoch)[lo - epoch * n : hi - epoch * n]
        return self.held.trained(out) if self.held is not None else out

    def __getitem__(self, position: int) -> int:
        number = self.permutation(position // self.n)[position % self.n]
        return int(self.held.trained(number) if self.held is not None else number)


def check_ids(ids: torch.Tensor, vocab_size: int | None, name: str) -> None:
    """Refuse token ids outside [0, vocab_size) in a batch read from ``name`` (None: no check)."""
    if vocab_size is None or not ids.numel():
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = high if high >= vocab_size else low
        raise ValueError(f"token ids must lie in [0, vocab_size={vocab_size}), got {bad} in {name!r}. Pass a "
                         "--vocab-size above the largest id (or a model config whose vocab_size is), or the "
                         "tokenizer / --data-dtype the data was made with")


def held_out(n: int, batches: int, size: int, what: str, name: str) -> HeldOut:
    """The items (windows or documents) of ``name``'s ``n`` held out for evaluation: ``batches`` of ``size``,
    refused when that would leave training fewer than half of them."""
    wanted = batches * size
    if wanted and wanted > n // 2:
        most = n // 2 // size
        fix = f"--eval-batches {most} at most" if most else f"a --batch-size of {n // 2} at most"
        raise ValueError(f"evaluation would hold out {wanted} of the {n} {what}s of {name!r} (--eval-batches "
                         f"{batches} x {size}), more than half of them. Pass {fix}, or more data.")
    return HeldOut(n, wanted)


def check_eval_batch(i: int, batches: int) -> None:
    if batches < 1:
        raise ValueError("eval_batch reads held-out data, got none held out. Pass eval_batches >= 1 to the loader "
                         "(fourfold train --eval-every N).")
    _check_int("i", i, 0, batches)


class StepLoader:
    """What every loader shares: the step it is at (its whole state: batches are pure functions of (seed,
    step), so resuming is setting it) and iteration over :meth:`shard`."""

    step = 0
    split: HeldOut  # what evaluation holds out (--eval-every), which training never reads

    @property
    def held_out(self) -> int:
        """How many items (windows or documents) evaluation holds out."""
        return self.split.count

    def shard(self, step: int) -> Any:
        raise NotImplementedError

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        step = state.get("step") if isinstance(state, dict) else None
        _check_int("state['step']", step, 0)
        self.step = int(step)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        batch = self.shard(self.step)
        self.step += 1
        return batch


class BatchLoader(StepLoader):
    """Global batch (x, y), each (B, T) int64 with y[b, t] = x[b, t+1] in the corpus, and this dp rank's rows.

    Rank r of dp holds rows [r*B/dp, (r+1)*B/dp) of the global batch, so concatenating the shards of all
    ranks in rank order gives exactly the batch one process would train on.
    """

    def __init__(
        self,
        corpus: Corpus,
        batch_size: int,
        seq_len: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        vocab_size: int | None = None,
        eval_batches: int = 0,
    ) -> None:
        _check_int("batch_size", batch_size, 1)
        _check_int("eval_batches", eval_batches, 0)
        _check_int("seq_len", seq_len, 1)
        _check_int("seed", seed, 0, 2**32)
        _check_int("dp_size", dp_size, 1)
        _check_int("dp_rank", dp_rank, 0, dp_size)
        if batch_size % dp_size != 0:
            fix = -(-batch_size // dp_size) * dp_size
            raise ValueError(
                f"batch_size must be divisible by dp, got batch_size={batch_size}, dp={dp_size}. "
                f"Pass --batch-size {fix} (a multiple of {dp_size})"
            )
        n = len(corpus) // (seq_len + 1)
        if n < 1:
            raise ValueError(
                f"corpus must hold at least seq_len+1={seq_len + 1} tokens, got {len(corpus)} in "
                f"{corpus.name!r}. Pass a longer corpus or a smaller --seq-len"
            )
        self.corpus = corpus
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.vocab_size = vocab_size  # ids at or above it are refused as a batch is read
        self.shard_size = batch_size // dp_size
        self.num_windows = n
        # Non-overlapping windows, stride T+1: window k is tokens[k(T+1) : (k+1)(T+1)].
        self._windows = corpus.tokens[: n * (seq_len + 1)].view(n, seq_len + 1)  # (n, T+1) uint8
        self.eval_batches = eval_batches
        self.split = held_out(n, eval_batches, batch_size, "window", corpus.name)
        self.order = EpochOrder.training(self.split, seed)  # training never reads the held-out windows

    def eval_batch(self, i: int) -> Batch:
        """Held-out batch ``i`` (this rank's rows) of the ``eval_batches * batch_size`` windows spread through the
        corpus (:class:`HeldOut`), in order, which training never takes."""
        check_eval_batch(i, self.eval_batches)
        first = i * self.batch_size + self.dp_rank * self.shard_size
        return self._windows_batch(self.split.held(torch.arange(first, first + self.shard_size)))

    def window_indices(self, step: int) -> torch.Tensor:
        """Window ids of global batch ``step``: positions [step*B, (step+1)*B) of the epoch sequence, (B,)."""
        _check_int("step", step, 0)
        return self.order.take(step * self.batch_size, (step + 1) * self.batch_size)

    def shard_indices(self, step: int) -> torch.Tensor:
        """This rank's window ids: rows [dp_rank*B/dp, (dp_rank+1)*B/dp) of :meth:`window_indices`."""
        lo = self.dp_rank * self.shard_size
        return self.window_indices(step)[lo : lo + self.shard_size]  # (B/dp,)

    def _batch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._windows[ids].long()  # (b, T+1)
        check_ids(rows, self.vocab_size, self.corpus.name)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()  # (b, T), (b, T)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (B, T) int64: the whole batch of ``step``, as one process would train on it."""
        return self._batch(self.window_indices(step))

    def shard(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (B/dp, T) int64: this dp rank's contiguous rows of the global batch of ``step``."""
        return self._batch(self.shard_indices(step))

    def batch(self, step: int) -> Batch:
        """:meth:`shard` as a :class:`Batch`: every position real, no documents."""
        return self._windows_batch(self.shard_indices(step))

    def _windows_batch(self, ids: torch.Tensor) -> Batch:
        """Windows ``ids`` (this rank's rows) as a :class:`Batch`, with the global batch's figures."""
        x, y = self._batch(ids)
        n = self.batch_size * self.seq_len
        return Batch(x, y, stats={"real_tokens": n, "slots": n, "padding_fraction": 0.0})
