"""Padding-free packing: a step's documents laid into rows of ``seq_len`` positions, none attending across.

    from fourfold.data import DocumentLoader, builtin_documents

    loader = DocumentLoader(builtin_documents(), seq_len=256, seed=0, docs_per_step=64, packing="bfd")
    batch = loader.shard(step=0)   # inputs, targets (-100 where nothing is predicted), documents (-1: padding)
    loss = engine.step(batch.inputs, batch.targets, documents=batch.documents, num_tokens=batch.num_tokens)

A document of n+1 ids fills n positions (inputs ids[:-1], targets ids[1:]), so no position ever predicts the
next document's first token. One longer than a row is split at row boundaries into pieces of at most
``seq_len`` positions (recorded: ``stats["split"]`` counts the documents cut), each trained as a document of its own, unless
``truncate=True`` keeps only the first. Arrangements:

* ``pad``: one piece per row, every row padded to the longest piece of the step (the baseline);
* ``first-fit``: pieces in the step's order, each into the first row with room;
* ``bfd``: best-fit decreasing: longest first, each into the fullest row it fits (fewest rows, in practice).

All three arrange the same pieces, so their losses are equal. While a batch runs, :func:`document_layout` makes
its documents current: models read :func:`current_layout` for position ids that restart at every document and
causal attention inside each document (a token attends to earlier tokens of its own document only): run by run
(:attr:`DocumentLayout.runs`), or through one block-diagonal mask (:attr:`DocumentLayout.mask`, what Hugging
Face attention is given).
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import functools
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal, NamedTuple

import torch

from fourfold.data.documents import Documents
from fourfold.data.loader import Batch, EpochOrder, StepLoader, check_eval_batch, check_ids, held_out
from fourfold.loss import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "PACKINGS", "Batch", "DocumentLayout", "DocumentLoader", "Piece", "capture_layout",
           "current_layout", "document_layout", "pack", "pieces", "using_layout"]

PACKINGS = ("pad", "first-fit", "bfd")
Packing = Literal["pad", "first-fit", "bfd"]


class Piece(NamedTuple):
    """Positions [start, start + length) of document ``doc``: ids[start : start + length + 1] of it."""

    doc: int
    start: int
    length: int


def pieces(lengths: Sequence[int], seq_len: int, *, truncate: bool = False) -> list[Piece]:
    """Documents of ``lengths`` ids cut into pieces of at most ``seq_len`` positions (the first only with
    ``truncate``)."""
    out = []
    for k, ids in enumerate(lengths):
        for start in range(0, ids - 1, seq_len):
            out.append(Piece(k, start, min(seq_len, ids - 1 - start)))
            if truncate:
                break
    return out


def pack(lengths: Sequence[int], capacity: int, packing: Packing) -> list[list[int]]:
    """Rows of item indices: items of ``lengths`` (each <= capacity) arranged by ``packing``."""
    if packing == "pad":
        return [[i] for i in range(len(lengths))]
    if packing == "first-fit":
        rows: list[list[int]] = []
        room: list[int] = []
        for i, n in enumerate(lengths):
            r = next((r for r, left in enumerate(room) if left >= n), len(rows))
            if r == len(rows):
                rows.append([])
                room.append(capacity)
            rows[r].append(i)
            room[r] -= n
        return rows
    if packing == "bfd":
        rows = []
        free: list[tuple[int, int]] = []  # sorted (room left, row) pairs
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep the step's order
            n = lengths[i]
            at = bisect.bisect_left(free, (n, -1))  # the fullest row with room for n
            if at == len(free):
                rows.append([i])
                bisect.insort(free, (capacity - n, len(rows) - 1))
            else:
                left, r = free.pop(at)
                rows[r].append(i)
                bisect.insort(free, (left - n, r))
        return rows
    raise ValueError(f"packing must be one of {', '.join(PACKINGS)}, got {packing!r}.")


def _balance(fills: list[int], parts: int) -> list[int]:
    """Row indices reordered so that each of ``parts`` equal contiguous runs holds about the same tokens: the
    fullest row first, each to the run with the fewest tokens that still has room (longest processing time)."""
    per = len(fills) // parts
    runs: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(fills)), key=lambda i: -fills[i]):
        r = min((r for r in range(parts) if len(runs[r]) < per), key=lambda r: (load[r], r))
        runs[r].append(i)
        load[r] += fills[i]
    return [i for run in runs for i in run]


class DocumentLoader(StepLoader):
    """Each step's documents, a pure function of (seed, step), packed into rows; this dp rank's rows of them.

    The documents of step s are positions [s*D, (s+1)*D) of the endless sequence of epochs, epoch e visiting
    them in ``randperm(n)`` from seed*1_000_003 + e (``docs_per_step=D``); or, with ``tokens_per_step``, the
    next documents while their targets fit the budget (at least one). The global batch's rows are padded with
    empty rows to a multiple of ``dp_size * row_multiple`` and, under dp, ordered so that every rank's rows
    hold about the same real tokens (the fullest row to the emptiest rank); rank r holds rows
    [r R/dp, (r+1) R/dp): the shards concatenated in rank order are the global batch.
    """

    def __init__(self, documents: Documents, seq_len: int, seed: int, dp_rank: int = 0, dp_size: int = 1, *,
                 docs_per_step: int | None = None, tokens_per_step: int | None = None, packing: Packing = "bfd",
                 row_multiple: int = 1, width_multiple: int = 1, truncate: bool = False,
                 vocab_size: int | None = None, eval_batches: int = 0, eval_docs: int = 0) -> None:
        if (docs_per_step is None) == (tokens_per_step is None):
            raise ValueError(f"pass one of docs_per_step and tokens_per_step, got docs_per_step={docs_per_step}, "
                             f"tokens_per_step={tokens_per_step}.")
        budget = docs_per_step if docs_per_step is not None else tokens_per_step
        if not isinstance(budget, int) or budget < 1:
            raise ValueError(f"docs_per_step / tokens_per_step must be a positive integer, got {budget!r}.")
        if packing not in PACKINGS:
            raise ValueError(f"packing must be one of {', '.join(PACKINGS)}, got {packing!r}. Pass one of those")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}.")
        self.documents, self.seq_len, self.seed = documents, seq_len, seed
        self.dp_rank, self.dp_size, self.packing, self.truncate = dp_rank, dp_size, packing, truncate
        self.docs_per_step, self.tokens_per_step = docs_per_step, tokens_per_step
        self.row_multiple, self.width_multiple, self.vocab_size = row_multiple, width_multiple, vocab_size
        self._lengths = documents.lengths.tolist()
        self._starts = [0]  # with tokens_per_step: where each step begins in the endless sequence
        if eval_batches and eval_docs < 1:
            raise ValueError(f"eval_docs must be >= 1 (documents per held-out batch) with eval_batches="
                             f"{eval_batches}, got {eval_docs}.")
        self.eval_batches, self.eval_docs = eval_batches, eval_docs  # held-out batches, documents in each
        self.split = held_out(len(documents), eval_batches, eval_docs, "document", documents.name)
        self.order = EpochOrder.training(self.split, seed)  # training never reads the held-out documents

    def doc_indices(self, step: int) -> list[int]:
        """The documents of global batch ``step``, in the step's order."""
        if self.docs_per_step is not None:
            return self.order.take(step * self.docs_per_step, (step + 1) * self.docs_per_step).tolist()
        assert self.tokens_per_step is not None
        while len(self._starts) <= step + 1:  # greedy: each step takes documents while their targets fit
            p, used = self._starts[-1], 0
            while True:
                cost = self._lengths[self.order[p]] - 1
                if self.truncate:
                    cost = min(cost, self.seq_len)
                if used and used + cost > self.tokens_per_step:
                    break
                used, p = used + cost, p + 1
            self._starts.append(p)
        return self.order.take(self._starts[step], self._starts[step + 1]).tolist()

    def global_batch(self, step: int) -> Batch:
        """Every row of global batch ``step``, as one process trains on it."""
        return self._packed(self.doc_indices(step))

    def eval_batch(self, i: int) -> Batch:
        """Held-out batch ``i`` (this rank's rows): ``eval_docs`` of the documents spread through the data
        (:class:`~fourfold.data.loader.HeldOut`), in order, packed as a step's are; training never takes them."""
        check_eval_batch(i, self.eval_batches)
        ks = torch.arange(i * self.eval_docs, (i + 1) * self.eval_docs)
        return self._shard(self._packed(self.split.held(ks).tolist()))

    def _packed(self, docs: list[int]) -> Batch:
        """The documents ``docs`` packed into the rows of one global batch."""
        parts = pieces([self._lengths[d] for d in docs], self.seq_len, truncate=self.truncate)
        rows = pack([p.length for p in parts], self.seq_len, self.packing)
        multiple = self.dp_size * self.row_multiple
        R = -(-len(rows) // multiple) * multiple
        rows += [[] for _ in range(R - len(rows))]  # empty rows: padding only
        fills = [sum(parts[i].length for i in row) for row in rows]
        width = -(-max(fills) // self.width_multiple) * self.width_multiple  # sequence parallelism: k * tp
        if self.dp_size > 1:  # rank r's rows are the r-th R/dp of the batch: give each rank its share of tokens
            rows = [rows[i] for i in _balance(fills, self.dp_size)]
        inputs = torch.zeros(R, width, dtype=torch.int64)
        targets = torch.full((R, width), IGNORE_INDEX, dtype=torch.int64)
        documents = torch.full((R, width), -1, dtype=torch.int64)
        for r, row in enumerate(rows):
            t = 0
            for i in row:
                doc, start, n = parts[i]
                ids = self.documents[docs[doc]][start:start + n + 1].long()
                inputs[r, t:t + n], targets[r, t:t + n], documents[r, t:t + n] = ids[:-1], ids[1:], i
                t += n
        check_ids(inputs, self.vocab_size, self.documents.name)
        real = sum(fills)
        split = len({p.doc for p in parts if p.start > 0})  # documents cut at row boundaries
        stats = {"documents": len(docs), "pieces": len(parts), "split": split,
                 "rows": R, "width": width, "real_tokens": real, "slots": R * width,
                 "padding_fraction": 1.0 - real / (R * width)}
        return Batch(inputs, targets, documents, real, stats)

    def shard(self, step: int) -> Batch:
        """This dp rank's rows of global batch ``step``; ``num_tokens`` is still the whole batch's."""
        return self._shard(self.global_batch(step))

    def _shard(self, g: Batch) -> Batch:
        n = g.inputs.size(0) // self.dp_size
        rows = slice(self.dp_rank * n, (self.dp_rank + 1) * n)
        return Batch(g.inputs[rows], g.targets[rows], g.documents[rows] if g.documents is not None else None,
                     g.num_tokens, g.stats)

    batch = shard


# ------------------------------------------------------------------------------- the layout models read


class DocumentLayout:
    """Which document each position of a (B, T) batch belongs to (-1: padding), and what follows from it."""

    def __init__(self, documents: torch.Tensor) -> None:
        if documents.dim() != 2:
            raise ValueError(f"documents must have shape (B, T), got {tuple(documents.shape)}.")
        self.documents = documents

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """(B, T) int64: each position's offset from its document's start (restarting at every document)."""
        d = self.documents
        T = d.size(1)
        t = torch.arange(T, device=d.device).expand_as(d)
        change = torch.ones_like(d, dtype=torch.bool)
        change[:, 1:] = d[:, 1:] != d[:, :-1]
        start = torch.where(change, t, torch.zeros_like(t)).cummax(dim=1).values
        return t - start

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """(B, 1, T, T) bool, True where query i may attend to key j: same document, j <= i (padding positions
        attend to earlier padding, so no row is empty)."""
        d = self.documents
        T = d.size(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=d.device).tril()
        return ((d.unsqueeze(2) == d.unsqueeze(1)) & causal).unsqueeze(1)

    @functools.cached_property
    def runs(self) -> list[tuple[int, torch.Tensor]]:
        """The batch's runs (a document's positions in a row, or a row's padding), grouped by length: ``[(length,
        starts)]``, ``starts`` the (n,) flat indices ``row * T + first`` of the n runs of that length. Attention
        run by run costs what the documents cost, the sum of their lengths squared, with no (T, T) mask."""
        d = self.documents
        B, T = d.shape
        change = torch.ones_like(d, dtype=torch.bool)
        change[:, 1:] = d[:, 1:] != d[:, :-1]
        starts = torch.nonzero(change.reshape(-1)).reshape(-1)  # flat: every row's first position starts a run
        ends = torch.cat([starts[1:], starts.new_tensor([B * T])])
        ends = torch.minimum(ends, (starts // T + 1) * T)  # a run ends at its row's end
        lengths = ends - starts
        return [(int(n), starts[lengths == n]) for n in torch.unique(lengths).tolist()]

    @functools.cached_property
    def run_gathers(self) -> tuple[list[tuple[int, torch.Tensor]], torch.Tensor]:
        """What attention run by run indexes, made once per batch (every layer, forward and recompute, reads it):
        per run length n the flat positions of its runs in order, (runs * n,), and the permutation that puts
        outputs gathered in that order back in place."""
        d = self.documents
        gathers = [(n, (starts[:, None] + torch.arange(n, device=d.device)).reshape(-1)) for n, starts in self.runs]
        return gathers, torch.argsort(torch.cat([idx for _, idx in gathers]))

    @functools.cached_property
    def score_elements(self) -> int:
        """The (query, key) pairs causal attention computes run by run: sum of l (l + 1) / 2 (the dense mask's
        computes B T^2 whatever the documents)."""
        return sum(n * (n + 1) // 2 * starts.numel() for n, starts in self.runs)

    def derived(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """What ``make`` makes of this layout (its mask within a window, in the form an attention reads), made once
        and kept as long as the layout: every layer, and a recompute, asking for the same ``key`` reuses it."""
        made = self.__dict__.setdefault("_derived", {})
        if key not in made:
            made[key] = make()
        return made[key]

    def check(self, shape: torch.Size | tuple[int, ...], what: str) -> None:
        if tuple(shape) != tuple(self.documents.shape):
            raise ValueError(f"{what} must match the documents' shape (B, T)={tuple(self.documents.shape)}, got "
                             f"{tuple(shape)}. Pass documents= of the inputs' shape")


_current: contextvars.ContextVar[DocumentLayout | None] = contextvars.ContextVar("fourfold_documents", default=None)


def document_layout(documents: torch.Tensor | None) -> AbstractContextManager[DocumentLayout | None]:
    """Make ``documents`` (B, T) the layout models read while the block runs (None: plain causal windows)."""
    return using_layout(DocumentLayout(documents) if documents is not None else None)


@contextlib.contextmanager
def using_layout(layout: DocumentLayout | None) -> Iterator[DocumentLayout | None]:
    """Make ``layout`` current again (a recompute in backward re-enters its forward's layout this way)."""
    token = _current.set(layout)
    try:
        yield layout
    finally:
        _current.reset(token)


def capture_layout() -> Callable[[], AbstractContextManager[DocumentLayout | None]]:
    """What re-enters the current layout later (activation checkpointing's recompute runs in backward)."""
    layout = _current.get()
    return lambda: using_layout(layout)


def current_layout() -> DocumentLayout | None:
    """The documents of the batch running now (set by the engine around each forward), or None."""
    return _current.get()
