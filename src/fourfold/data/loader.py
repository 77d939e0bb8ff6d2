"""Per-rank shards of each global batch, a pure function of (seed, step).

    from fourfold.data import BatchLoader, load_corpus

    corpus = load_corpus()                                   # ~2 MiB of stdlib .py files, as bytes
    loader = BatchLoader(corpus, batch_size=8, seq_len=64, seed=0, dp_rank=1, dp_size=2)
    x, y = loader.shard(step=0)                              # (4, 64), (4, 64): rows 4..7 of the batch
    X, Y = loader.global_batch(step=0)                       # (8, 64): what one process would see

The corpus is cut into n = N // (T+1) windows of T+1 tokens, epoch e visits them in the order randperm(n) drawn
from seed*1_000_003 + e, and step s takes positions [s*B, (s+1)*B) of the endless concatenation of epochs.
Resuming is setting the step. Only the windows a batch takes are read (a memory-mapped corpus stays on disk).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from fourfold.data.corpus import Corpus
from fourfold.data.packing import Batch

__all__ = ["BatchLoader"]


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value >= high)
    ):
        rule = f"an integer in [{low}, {high})" if high is not None else f"an integer >= {low}"
        raise ValueError(f"{name} must be {rule}, got {name}={value!r}. Pass {name} as {rule}")


class BatchLoader:
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
    ) -> None:
        _check_int("batch_size", batch_size, 1)
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
        self.step = 0
        # Non-overlapping windows, stride T+1: window k is tokens[k(T+1) : (k+1)(T+1)].
        self._windows = corpus.tokens[: n * (seq_len + 1)].view(n, seq_len + 1)  # (n, T+1) uint8
        self._perms: dict[int, torch.Tensor] = {}

    def _permutation(self, epoch: int) -> torch.Tensor:
        """The order of windows in ``epoch``: randperm(n) from a generator seeded by (seed, epoch)."""
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a step spans at most a few epochs; keep the cache tiny
                self._perms.pop(next(iter(self._perms)))
            gen = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.num_windows, generator=gen)  # (n,)
        return self._perms[epoch]

    def window_indices(self, step: int) -> torch.Tensor:
        """Window ids of global batch ``step``: positions [step*B, (step+1)*B) of the epoch sequence, (B,)."""
        _check_int("step", step, 0)
        n, B = self.num_windows, self.batch_size
        start, stop = step * B, (step + 1) * B
        out = torch.empty(B, dtype=torch.long)
        for epoch in range(start // n, (stop - 1) // n + 1):  # a batch may span an epoch boundary
            lo, hi = max(start, epoch * n), min(stop, (epoch + 1) * n)
            out[lo - start : hi - start] = self._permutation(epoch)[lo - epoch * n : hi - epoch * n]
        return out

    def shard_indices(self, step: int) -> torch.Tensor:
        """This rank's window ids: rows [dp_rank*B/dp, (dp_rank+1)*B/dp) of :meth:`window_indices`."""
        lo = self.dp_rank * self.shard_size
        return self.window_indices(step)[lo : lo + self.shard_size]  # (B/dp,)

    def _batch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._windows[ids].long()  # (b, T+1)
        if self.vocab_size is not None and rows.numel() and (rows.max() >= self.vocab_size or rows.min() < 0):
            bad = int(rows.max()) if rows.max() >= self.vocab_size else int(rows.min())
            raise ValueError(f"token ids must lie in [0, vocab_size={self.vocab_size}), got {bad} in "
                             f"{self.corpus.name!r}. Pass a --vocab-size above the largest id (or a model config "
                             "whose vocab_size is), or the --data-dtype the file was written with")
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()  # (b, T), (b, T)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (B, T) int64: the whole batch of ``step``, as one process would train on it."""
        return self._batch(self.window_indices(step))

    def shard(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (B/dp, T) int64: this dp rank's contiguous rows of the global batch of ``step``."""
        return self._batch(self.shard_indices(step))

    def batch(self, step: int) -> Batch:
        """:meth:`shard` as a :class:`~fourfold.data.packing.Batch`: every position real, no documents."""
        x, y = self.shard(step)
        n = self.batch_size * self.seq_len
        return Batch(x, y, stats={"real_tokens": n, "slots": n, "padding_fraction": 0.0})

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        step = state.get("step") if isinstance(state, dict) else None
        _check_int("state['step']", step, 0)
        self.step = int(step)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.shard(self.step)
        self.step += 1
        return batch
