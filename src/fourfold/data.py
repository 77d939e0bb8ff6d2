"""The built-in corpus, a byte-level tokenizer, and per-rank shards of each global batch.

Nothing to download: the default corpus is the Python standard library's own source, read in a fixed order
and fingerprinted, so every run can record exactly which text it trained on::

    from fourfold.data import BatchLoader, load_corpus

    corpus = load_corpus()                                   # ~2 MiB of stdlib .py files, as bytes
    loader = BatchLoader(corpus, batch_size=8, seq_len=64, seed=0, dp_rank=1, dp_size=2)
    x, y = loader.shard(step=0)                              # (4, 64), (4, 64): rows 4..7 of the batch
    X, Y = loader.global_batch(step=0)                       # (8, 64): what one process would see

A batch is a pure function of (seed, step): the corpus is cut into n = N // (T+1) windows of T+1 tokens,
epoch e visits them in the order randperm(n) drawn from seed*1_000_003 + e, and step s takes positions
[s*B, (s+1)*B) of the endless concatenation of epochs. Resuming is setting the step.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["DEFAULT_MAX_BYTES", "BatchLoader", "ByteTokenizer", "Corpus", "load_corpus"]

DEFAULT_MAX_BYTES = 2 * 1024 * 1024
"""Bytes of standard-library source taken by :func:`load_corpus` unless told otherwise (2 MiB)."""

_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def _as_uint8(data: bytes) -> torch.Tensor:
    """bytes -> uint8 tensor (N,), copying (torch.frombuffer refuses empty buffers and aliases memory)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


@dataclass(frozen=True, eq=False)
class Corpus:
    """A text as byte tokens, with the name and SHA-256 fingerprint a run records."""

    tokens: torch.Tensor  # (N,) uint8
    name: str
    sha256: str

    @classmethod
    def from_bytes(cls, data: bytes, name: str) -> Corpus:
        """Wrap raw bytes; the fingerprint is sha256(data)."""
        return cls(_as_uint8(data), name, hashlib.sha256(data).hexdigest())

    def __len__(self) -> int:
        return self.tokens.numel()

    def __repr__(self) -> str:
        return f"Corpus(name={self.name!r}, tokens={len(self)}, sha256={self.sha256[:12]}...)"


def _stdlib_files() -> list[Path]:
    """Every .py file under the stdlib directory, test and site-packages folders skipped, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(path: str | os.PathLike[str] | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
    """The first ``max_bytes`` bytes of a file, or of the concatenated stdlib sources when ``path`` is None."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(
            f"max_bytes must be a positive integer, got max_bytes={max_bytes!r}. Pass e.g. 2**21"
        )
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"corpus path must be a readable file, got {str(file)!r}. Check the path")
        with file.open("rb") as f:
            data = f.read(max_bytes)
        name = file.name
    else:
        chunks, size = [], 0
        for file in _stdlib_files():
            if size >= max_bytes:
                break
            chunk = file.read_bytes() + b"\n"  # raw UTF-8 bytes; the newline keeps files apart
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)[:max_bytes]
        name = f"python{sys.version_info.major}.{sys.version_info.minor}-stdlib"
    if not data:
        raise ValueError(
            f"corpus must hold at least one byte, got 0 bytes from {name!r}. Pass a non-empty file"
        )
    return Corpus.from_bytes(data, name)


class ByteTokenizer:
    """Text <-> its UTF-8 bytes: token t in [0, 256) is one byte."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        """str -> int64 tensor (N,) of its UTF-8 bytes."""
        return _as_uint8(text.encode("utf-8")).long()  # (N,)

    def decode(self, tokens: torch.Tensor) -> str:
        """int tensor (N,) of bytes -> str; invalid UTF-8 becomes U+FFFD."""
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}. Decode one row at a time")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError(
                f"tokens must lie in [0, 256), got min={int(tokens.min())}, max={int(tokens.max())}. "
                "Decode only byte tokens"
            )
        return bytes(tokens.tolist()).decode("utf-8", errors="replace")


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
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()  # (b, T), (b, T)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (B, T) int64: the whole batch of ``step``, as one process would train on it."""
        return self._batch(self.window_indices(step))

    def shard(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (B/dp, T) int64: this dp rank's contiguous rows of the global batch of ``step``."""
        return self._batch(self.shard_indices(step))

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
