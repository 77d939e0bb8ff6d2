"""Each process's ledger of the operation it is waiting in: what the hang doctor reads and heartbeats.

Every bounded wait (:func:`fourfold.comm.wait.bounded_wait`) and every blocking object collective
(:func:`fourfold.comm.wait.gather_objects`) enters the ledger before it waits and leaves it after::

    entry = LEDGER.enter("loss all-reduce", "the data-parallel group of", group=(0, 1))
    ...  # wait
    LEDGER.leave(entry)

An entry names the operation, the peer (point-to-point, with the direction: a rank receiving from its peer
waits for that peer's send, not for its receive) or the group's global ranks (collective), this rank's
sequence number on that group or pair, the tensor's shape and dtype, and when the wait began. Two ranks waiting
in the same collective hold entries with the same group and sequence number; that is how the doctor tells a rank
that arrived from one that never did. Entering and leaving are a few attribute writes: nothing is sent.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

__all__ = ["LEDGER", "Direction", "Entry", "Ledger", "describe"]

Direction = Literal["send", "recv"]
"""Which end of a point-to-point transfer a wait is."""


@dataclass(frozen=True)
class Entry:
    """One wait: ``op`` and ``awaited`` as in :class:`~fourfold.comm.wait.CommError`'s message."""

    op: str
    awaited: str
    peer: int | None
    group: tuple[int, ...] | None
    seq: int
    shape: tuple[int, ...] | None
    dtype: str | None
    since: float  # time.time() when the wait began
    direction: Direction | None = None  # point-to-point: which end this rank is (None: a collective, or not said)
    message: str | None = None  # point-to-point: which message ("0F3"), the same at both ends (None: not said)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe(entry: Mapping[str, Any]) -> str:
    """``'loss all-reduce' (collective #7 of ranks [0, 1])`` or ``'1B2' (receive the gradient of 2B2 from rank 2)``,
    from an entry's dict."""
    where = (f"collective #{entry['seq']} of ranks {list(entry['group'])}" if entry.get("group") is not None
             else f"{entry['awaited']} rank {entry['peer']}" if entry.get("peer") is not None else f"#{entry['seq']}")
    shape = f", {entry['dtype']}{list(entry['shape'])}" if entry.get("shape") is not None else ""
    return f"'{entry['op']}' ({where}{shape})"


class Ledger:
    """This process's waits: the one in progress (``current``), the one before it (``last``), and the step."""

    def __init__(self, rank: int = 0) -> None:
        self.reset(rank)

    def reset(self, rank: int) -> None:
        """Start a new run's ledger (a process group was created): nothing waited yet."""
        self.rank = rank
        self.current: Entry | None = None
        self.last: Entry | None = None
        self.idle_since = time.time()
        self.step: int | None = None
        self._counts: dict[tuple[Any, ...], int] = {}

    def enter(self, op: str, awaited: str, *, peer: int | None = None, group: Sequence[int] | None = None,
              tensor: torch.Tensor | None = None, direction: Direction | None = None,
              message: str | None = None) -> Entry:
        ranks = tuple(group) if group is not None else None
        key: tuple[Any, ...] = ranks if ranks is not None else ("pair", *sorted((self.rank, -1 if peer is None
                                                                                   else peer)))
        seq = self._counts[key] = self._counts.get(key, 0) + 1
        entry = Entry(op, awaited, peer, ranks, seq, tuple(tensor.shape) if tensor is not None else None,
                      str(tensor.dtype).removeprefix("torch.") if tensor is not None else None, time.time(),
                      direction, message)
        self.current = entry
        return entry

    def leave(self, entry: Entry) -> None:
        if self.current is entry:
            self.current = None
        self.last = entry
        self.idle_since = time.time()


LEDGER = Ledger()
"""The ledger of this process (one rank per process)."""
