"""One rank's share of a batch's sequences under context parallelism, current while the engine runs a step:
:class:`ContextShard` (its positions, the masks between its queries and any rank's keys, the tiles worth
computing), and :func:`run_codes` for packed documents (each position's run: its row and the run's start, so a
rank knows, for any other rank's positions of the same rows, which keys share a query's document)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch

from fourfold.comm.p2p import Communicator
from fourfold.data.packing import DocumentLayout, current_layout
from fourfold.observe.trace import Tracer
from fourfold.parallel.context.chunks import check_length, pieces, positions
from fourfold.parallel.context.kernel import visible

__all__ = ["ALGORITHMS", "Algorithm", "ContextShard", "Tile", "capture_shard", "current_shard", "run_codes",
           "using_shard"]

Algorithm = Literal["allgather", "ring", "ulysses"]
ALGORITHMS: tuple[Algorithm, ...] = ("allgather", "ring", "ulysses")


class Tile(NamedTuple):
    """Queries [qa, qb) of this rank's chunk against keys [ka, kb) of a block; ``seen`` the mask (None: all)."""

    qa: int
    qb: int
    ka: int
    kb: int
    seen: torch.Tensor | None


def _runs(runs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """[(start, stop)] global runs -> [(local start, local stop, global start)] within the chunk."""
    out, at = [], 0
    for a, b in runs:
        out.append((at, at + b - a, a))
        at += b - a
    return out


@dataclass(eq=False)
class ContextShard:
    """One rank's share of one batch's sequences: its positions among ``T``, and how its attention reaches the
    others' (``comm`` over the cp group, ``algorithm``). Made by :class:`~fourfold.parallel.context.ContextParallel`
    for each batch; current while the engine runs the model on it."""

    comm: Communicator
    algorithm: Algorithm | Literal["auto"]
    T: int
    balanced: bool
    tracer: Tracer | None = None
    codes: torch.Tensor | None = None  # packed documents: (B, T) run codes of the whole rows (run_codes)
    pick: Callable[[torch.Tensor, torch.Tensor], Algorithm] | None = None  # "auto": the call's algorithm
    everyone: list[torch.Tensor] = field(init=False)  # each rank's positions
    _tiles: dict[int, list[Tile]] = field(init=False, default_factory=dict)  # per block, without documents

    def __post_init__(self) -> None:
        check_length(self.T, self.size, self.balanced)
        self.everyone = [positions(self.T, self.size, r, self.balanced) for r in range(self.size)]

    def local_codes(self) -> torch.Tensor | None:
        """Packed documents: the running micro-batch's codes of this rank's positions (rows, T/cp), as the runner
        made them current; None without documents."""
        if self.codes is None:
            return None
        layout = current_layout()
        if layout is None:
            raise RuntimeError("context parallelism with packed documents runs the model inside the engine's step, "
                               "which makes each micro-batch's documents current; got none current")
        return layout.documents

    def seen(self, j: int, local: torch.Tensor | None, keys: torch.Tensor | None = None) -> torch.Tensor:
        """Which keys at rank ``j``'s positions (or at ``keys``, global positions) this rank's queries see:
        (Tq, Tk) causal, or (rows, Tq, Tk) with packed documents (``local``: :meth:`local_codes`)."""
        kpos = self.everyone[j] if keys is None else keys
        causal = visible(self.mine, kpos)
        if local is None or self.codes is None:
            return causal
        other = self.codes[rows_of(local, self.T)][:, kpos.to(self.codes.device)]
        return causal.to(local.device)[None] & (local[:, :, None] == other[:, None, :])

    def tiles(self, j: int, local: torch.Tensor | None) -> list[Tile]:
        """This rank's queries against rank ``j``'s block as the tiles worth computing: each pair of contiguous
        runs (the head-tail cut gives a rank two), skipped where the causal mask hides every key, unmasked where
        it hides none, masked on the diagonal. With packed documents, one tile with the block's mask."""
        if local is not None and self.codes is not None:
            n_q, n_k = self.mine.numel(), self.everyone[j].numel()
            return [Tile(0, n_q, 0, n_k, self.seen(j, local))]
        if j not in self._tiles:  # the same for every layer, forward and backward: made once per step
            self._tiles[j] = self._causal_tiles(j)
        return self._tiles[j]

    def _causal_tiles(self, j: int) -> list[Tile]:
        out = []
        for qa, qb, q0 in _runs(self.pieces_of(self.rank)):
            for ka, kb, k0 in _runs(self.pieces_of(j)):
                first_q, last_q, first_k, last_k = q0, q0 + qb - qa - 1, k0, k0 + kb - ka - 1
                if first_k > last_q:
                    continue  # every key after every query: nothing to compute
                mask = None if last_k <= first_q else visible(self.mine[qa:qb], self.everyone[j][ka:kb])
                out.append(Tile(qa, qb, ka, kb, mask))
        return out

    def pieces_of(self, rank: int) -> list[tuple[int, int]]:
        return pieces(self.T, self.size, rank, self.balanced)

    def document_positions(self, first: int, n: int) -> torch.Tensor:
        """Positions [first, first + n) of this rank's chunk: global ones (n,), or with packed documents each
        token's offset in its document (rows, n)."""
        mine = self.mine[first:first + n]
        local = self.local_codes()
        if local is None:
            return mine
        return mine.to(local.device)[None] - _starts(local[:, first:first + n], self.T)

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def mine(self) -> torch.Tensor:
        """This rank's global positions (T / cp,)."""
        return self.everyone[self.rank]

    @contextlib.contextmanager
    def counted(self, op: str) -> Iterator[None]:
        """A comm span ``cp.<op>`` holding the bytes this rank sent inside it (``bytes_by_axis``'s cp row)."""
        tracer, before = self.tracer, self.comm.stats.sent_bytes
        start = tracer.now_ns() if tracer is not None else 0
        try:
            yield
        finally:
            if tracer is not None:
                tracer.record("comm", f"cp.{op}", start, tracer.now_ns(), bytes=self.comm.stats.sent_bytes - before,
                              ranks=self.size)


_current: contextvars.ContextVar[ContextShard | None] = contextvars.ContextVar("fourfold_context", default=None)


def current_shard() -> ContextShard | None:
    """The context-parallel shard the model runs on now (set by the engine around each step), or None."""
    return _current.get()


@contextlib.contextmanager
def using_shard(shard: ContextShard | None) -> Iterator[None]:
    token = _current.set(shard)
    try:
        yield
    finally:
        _current.reset(token)


def capture_shard() -> Callable[[], contextlib.AbstractContextManager[None]]:
    """What re-enters the current shard later (activation checkpointing's recompute runs in backward)."""
    shard = _current.get()
    return lambda: using_shard(shard)


# -------------------------------------------------------------------------------------- packed documents


def run_codes(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids (-1: padding) -> (B, T) int64 codes, one per run of a row: ``row * T + start`` for a
    document's run starting at ``start``, ``-(row * T + start) - 1`` for padding. Equal codes share a run, so the
    mask needs no more than the codes of the keys' positions, and a code says its row and where its run starts."""
    B, T = documents.shape
    start = torch.arange(T, device=documents.device)[None] - DocumentLayout(documents).positions
    code = torch.arange(B, device=documents.device)[:, None] * T + start
    return torch.where(documents >= 0, code, -code - 1)


def _decode(codes: torch.Tensor) -> torch.Tensor:
    """A run code's ``row * T + start``, whether the run is a document's or padding."""
    return torch.where(codes >= 0, codes, -codes - 1)


def rows_of(local: torch.Tensor | None, T: int) -> torch.Tensor:
    """The rows of the whole batch a micro-batch's codes (rows, T/cp) come from."""
    assert local is not None
    return _decode(local[:, 0]) // T


def _starts(local: torch.Tensor, T: int) -> torch.Tensor:
    """Each position's run start (its document's first position in the row)."""
    return _decode(local) % T
