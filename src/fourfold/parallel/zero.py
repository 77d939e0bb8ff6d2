"""ZeRO: data parallelism that shards what every replica would otherwise hold whole.

Each data-parallel bucket (:class:`~fourfold.parallel.data.Bucket`) is padded to a multiple of the group size
G and cut into G equal segments; rank r owns segment r of every bucket. The optimiser is given the owned
segments (:attr:`~fourfold.parallel.shards.ZeroBucket.shard`, flat parameters) instead of the model's parameters, so its state is
1/G of the model's on each rank (stage 1). The gradient sync is the ring all-reduce's first half: a
**reduce-scatter** leaves each rank the sum of its own segment only, written into ``shard.grad``; the other
half, an **all-gather** of the updated segments, runs before the next forward and rebuilds every parameter
(the model's parameters are views of one flat buffer per bucket, so the gather writes them in place). Both
phases are :mod:`fourfold.comm.ring`'s (counted and drawn like the all-reduce), or the backend's own
``reduce_scatter_single`` / ``all_gather_single`` with ``algorithm="native"``.

* stage 1: the bucket's gradient buffer stays allocated between steps (the whole gradient is held);
* stage 2: it is freed once reduced, so a rank holds 1/G of the gradients between steps;
* stage 3: the parameters' buffer is freed too. Without a pipeline each unit (a block of the model) is gathered
  before its forward, freed after it, gathered again when its backward starts and freed once its gradients are
  packed; the next unit's gather is started before the current unit runs (prefetch). The rest of the model
  (embeddings, head, final norm) is gathered at the step's start and before backward. Under a pipeline every
  bucket is gathered once per step, before the first micro-batch, and freed after the last (the micro-batches
  reuse the gathered weights).

Per rank and step, with Ψ the parameters' elements (each bucket padded to a multiple of G): the reduce-scatter
and the all-gather each send (G-1)Ψ/G elements, so stages 1-2 send 2(G-1)Ψ/G (the all-reduce's volume) and
stage 3 3(G-1)Ψ/G (one more gather, for backward); :func:`~fourfold.parallel.shards.theory_bytes` is the exact figure.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fourfold.parallel.buckets import Bucket, allocate, flat_of, group_params, make_bucket, release
from fourfold.parallel.data import DataParallel
from fourfold.parallel.shards import flatten, gather_flat, reduce_scatter

__all__ = ["ZERO_ALGORITHMS", "ShardedDataParallel"]

ZERO_ALGORITHMS = ("ring", "native")
"""The algorithms that have a reduce-scatter and an all-gather half (the others are all-reduce only)."""


class ShardedDataParallel(DataParallel):
    """:class:`~fourfold.parallel.data.DataParallel` with ZeRO stage ``zero`` (1, 2 or 3) over ``group``.

    Give the optimiser :meth:`shards` (the engine's ``parameters()`` does), not the model's parameters: after
    :meth:`finish` each shard's ``.grad`` holds the averaged gradient of this rank's segment, and the model's own
    parameters have none. The next forward all-gathers the updated segments; :meth:`gathered` does it for
    reading or loading the whole parameters between steps.

    ``units`` (stage 3, no pipeline): the modules gathered and freed one at a time, in forward order (the
    model's blocks). ``late``: parameters whose gradient is not final when backward produces it (a pipeline's
    tied copies, summed across stages; sequence parallelism's partial gradients, summed over tp):
    ``sum_copies()`` runs at :meth:`finish`, then they are packed, in buckets of their own, launched last.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None, algorithm: str = "ring",
                 bucket_mb: float = 25.0, *, zero: int = 1, units: Sequence[nn.Module] = (),
                 late: Iterable[nn.Parameter] = (), **kwargs: Any) -> None:
        if zero not in (1, 2, 3):
            raise ValueError(f"zero must be 1, 2 or 3 (0 is plain data parallelism), got {zero}.")
        if algorithm not in ZERO_ALGORITHMS:
            raise ValueError(f"ZeRO needs a reduce-scatter and an all-gather: algorithm {' or '.join(ZERO_ALGORITHMS)}, "
                             f"got {algorithm!r} (an all-reduce only). Pass algorithm='ring' or 'native' "
                             "(fourfold train: --allreduce) with ZeRO.")
        self.zero = zero
        self._units = list(units) if zero == 3 else []
        self._late = {id(p) for p in late}
        self._late_open = False
        self._fresh = False
        self._unit_bucket: dict[int, int] = {}  # id(unit module) -> bucket index
        super().__init__(module, group, algorithm, bucket_mb, **kwargs)
        rank, size = dist.get_rank(group), self.size
        for b in self.buckets:
            b.zero = flatten(b.params, b.offsets, b.flat.numel(), rank, size, zero)
            if zero >= 2:
                release(b.flat)  # allocated when backward packs into it, freed once reduced
        for b in self.buckets:
            b.zero.free()  # stage 3: from here on a rank holds its segments only
        self._order = [self.buckets[self._unit_bucket[id(u)]] for u in self._units if id(u) in self._unit_bucket]
        for k, b in enumerate(self._order):
            unit = self._units_by_bucket[b.index]
            unit.register_forward_pre_hook(functools.partial(self._before_unit, k))
            unit.register_forward_hook(functools.partial(self._after_unit, k))

    # ---------------------------------------------------------------------------------------- buckets

    def _make_buckets(self, named: list[tuple[str, nn.Parameter]], cap_bytes: int) -> list[Bucket]:
        """Stage 3: one bucket per unit, in backward order; then the rest; the late parameters last. Each
        bucket padded to a multiple of G."""
        taken: set[int] = set(self._late)
        groups: list[list[tuple[str, nn.Parameter]]] = []
        owners: list[nn.Module | None] = []
        names = {id(p): n for n, p in named}
        for unit in reversed(self._units):
            mine = [(names[id(p)], p) for p in unit.parameters() if id(p) in names and id(p) not in taken]
            taken.update(id(p) for _, p in mine)
            for g in group_params(mine, 2**62, 2**62):  # one per dtype
                groups.append(g)
                owners.append(unit)
        for subset in ([(n, p) for n, p in named if id(p) not in taken],
                       [(n, p) for n, p in named if id(p) in self._late]):
            for g in group_params(subset, cap_bytes):
                groups.append(g)
                owners.append(None)
        self._units_by_bucket = {i: u for i, u in enumerate(owners) if u is not None}
        self._unit_bucket = {id(u): i for i, u in self._units_by_bucket.items()}
        return [make_bucket(i, g, self.size) for i, g in enumerate(groups)]

    def shards(self) -> list[nn.Parameter]:
        """This rank's segments, one flat parameter per bucket: what the optimiser updates."""
        return [b.zero.shard for b in self.buckets]

    def optimizer_parameters(self) -> list[nn.Parameter]:
        return self.shards()

    def microbatch(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """ZeRO-1 accumulates as plain data parallelism does; ZeRO-2 and -3 reduce-scatter every micro-batch's
        gradients into the shards, so no rank ever holds the whole gradient (nor, at stage 3, the model)."""
        return super().microbatch(last) if self.zero < 2 or last else self._into_shards()

    @contextlib.contextmanager
    def _into_shards(self) -> Iterator[None]:
        yield
        self.finish(stale=False)  # the weights are unchanged for the next micro-batch

    def grad_pieces(self, copies: dict[int, int]) -> Iterator[tuple[torch.Tensor, int]]:
        """The segments' gradients (``shard.grad``), each a run of several parameters: a segment is this rank's
        alone over dp, so only the run's own tp and tied copies count."""
        for b in self.buckets:
            grad = b.zero.shard.grad
            if grad is None:
                continue
            lo, hi = b.zero.offset, b.zero.offset + b.zero.length  # this rank's segment of the bucket
            for p, start in zip(b.params, b.offsets, strict=True):
                a, z = max(start, lo), min(start + p.numel(), hi, b.numel)
                if a < z:
                    yield grad[a - lo:z - lo], copies[id(p)]

    # ----------------------------------------------------------------------------- gradients: reduce

    def _on_grad(self, p: torch.Tensor) -> None:
        if id(p) in self._late and not self._late_open:
            return  # packed in finish(), once sum_copies() has made it final
        super()._on_grad(p)

    def _pack(self, p: torch.Tensor) -> Bucket:
        bucket, _ = self._where[id(p)]
        if bucket.flat.untyped_storage().nbytes() == 0:  # stages 2-3: this step's first gradient in it
            allocate(bucket.flat)
            bucket.flat[bucket.numel:].zero_()  # padding: adds nothing
        super()._pack(p)
        p.grad = None  # the bucket holds it; the model's parameters keep no gradient of their own
        if self.zero == 3 and self._gate is None and len(bucket.ready) == len(bucket.params) \
                and bucket.index in self._units_by_bucket:
            bucket.zero.free()  # its backward is done: the unit's weights are not needed again this step
        return bucket

    def _launch(self, b: Bucket) -> None:
        b.handle = self._submit(reduce_scatter, self._comm, self._wire(b), self.algorithm, tracer=self.tracer,
                                index=b.index)

    def finish(self, stale: bool = True) -> None:
        """Wait for every bucket's reduce-scatter and accumulate each segment into its shard's gradient; free what
        the stage frees. ``stale=False``: no optimiser step follows before the next forward (another micro-batch
        of gradient accumulation), so stages 1-2 need not gather the unchanged parameters again."""
        if self._finished:
            return
        if self._late:
            if self.sum_copies is not None:
                self.sum_copies()
            self._late_open = True
            for b in self.buckets:
                for p in b.params:
                    if id(p) in self._late and p.grad is not None and id(p) not in b.ready:
                        self._pack(p)
        for b in self.buckets:
            if b.flat.untyped_storage().nbytes() == 0:  # no gradient packed (find_unused_parameters): zeros
                allocate(b.flat)
                b.flat.zero_()
        super().finish()
        for b in self.buckets:
            if self.zero >= 2:
                release(b.flat)
            b.zero.free()
        self._fresh = self._fresh and not stale  # an optimiser step may follow: the next forward gathers again

    def _copies_after_sync(self) -> None:
        pass  # summed before the late buckets' reduce-scatter (finish)

    def _unpack(self, b: Bucket, unused: set[int] | frozenset[int] = frozenset()) -> None:
        # ``unused`` is not for ZeRO: its optimiser steps flat shards, whose gradient cannot be None in part
        seg = b.handle.result()  # the reduce-scatter bounds its own waits and names the peer
        shard, b.wire = b.zero.shard, None
        if seg.dtype != shard.dtype:  # reduced in reduce_dtype (bfloat16, say): back to the master's dtype
            seg = seg.to(shard.dtype)
        if self.zero == 1 and seg.data_ptr() != b.flat[b.zero.offset:].data_ptr():
            seg = b.flat[b.zero.offset:b.zero.offset + b.zero.length].copy_(seg)  # stage 1 keeps it in the bucket
        if shard.grad is None:  # stage 1: a view of the bucket (kept whole); 2-3: its own (the bucket is freed)
            shard.grad = seg if self.zero == 1 or self.algorithm == "native" else seg.clone()
        elif shard.grad.data_ptr() != seg.data_ptr():
            shard.grad.add_(seg)  # gradients accumulate until zero_grad, as the model's would

    def _wait(self, b: Bucket) -> None:
        pass  # _unpack waits for the reduce-scatter's result

    # ---------------------------------------------------------------------------- parameters: gather

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._sync:
            self.begin()
        elif not self._fresh:
            self._gather([b for b in self.buckets if b.index not in self._units_by_bucket])
            self._fresh = True
        out = self.module(*args, **kwargs)
        if self.zero == 3 and torch.is_grad_enabled():
            rest = [b for b in self.buckets if b.index not in self._units_by_bucket]
            if self._units:  # without units every bucket is the rest, and stays gathered through the step
                for b in rest:
                    b.zero.free()
                _on_backward(out, lambda: self._gather(rest))
        return out

    def begin(self, gated: bool = False) -> None:
        super().begin(gated)
        self._late_open = False
        # Under a pipeline (gated) every bucket is gathered once for all micro-batches; otherwise the units
        # gather themselves as forward reaches them.
        self._gather([b for b in self.buckets if gated or b.index not in self._units_by_bucket])
        self._fresh = True

    def _start(self, b: Bucket, force: bool = False) -> None:
        """Start ``b``'s all-gather unless it is running or its parameters are current (stage 3: gathered since
        they were last freed; stages 1-2: gathered since the last step)."""
        zb = b.zero
        if zb.handle is not None or (not force and (zb.gathered if self.zero == 3 else self._fresh)):
            return
        zb.allocate()  # this rank's segment in place; the gather brings every other rank's
        zb.handle = self._submit(gather_flat, self._comm, zb.params, self.algorithm, tracer=self.tracer,
                                 index=b.index)

    def _gather(self, buckets: Sequence[Bucket], force: bool = False) -> None:
        for b in buckets:
            self._start(b, force)
        for b in buckets:
            zb = b.zero
            if zb.handle is not None:
                zb.handle.result()
                zb.handle, zb.gathered = None, True

    def _before_unit(self, k: int, module: nn.Module, args: Any) -> None:
        self._gather([self._order[k]])
        if k + 1 < len(self._order) and torch.is_grad_enabled():
            self._start(self._order[k + 1])  # prefetch: the next unit's gather runs while this one computes

    def _after_unit(self, k: int, module: nn.Module, args: Any, out: Any) -> None:
        if self._gate is not None:
            return
        b = self._order[k]
        b.zero.free()

        def before_backward() -> None:
            self._gather([b])
            if k > 0:
                self._start(self._order[k - 1])  # backward runs the units in reverse

        if torch.is_grad_enabled():
            _on_backward(out, before_backward)

    @contextlib.contextmanager
    def forward_only(self) -> Iterator[None]:
        """Forwards that train nothing (evaluation) inside: gathered as a step's forward gathers them (stage 3:
        one block at a time), nothing reduced; afterwards freed and marked stale, as after a step, so an
        optimiser step may come before the next forward."""
        with self.no_sync():
            try:
                yield
            finally:
                for b in self.buckets:
                    b.zero.free()
                self._fresh = False

    @contextlib.contextmanager
    def gathered(self, write: bool = False) -> Iterator[None]:
        """Between steps: every parameter whole (gathered from the shards) inside the block; ``write=True``
        copies what was written into the whole parameters back into this rank's shards on exit."""
        if not self._finished:
            self.finish()
        self._gather(self.buckets, force=self.zero < 3)  # stages 1-2: the shards may have moved since
        try:
            yield
        finally:
            for b in self.buckets:
                if write:
                    b.zero.shard.data.copy_(b.zero.own)
                b.zero.free()

    def full_state(self, optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
        """Each model parameter's optimiser state (by ``id``), whole: the segments' state gathered over dp and
        cut like the parameters (a collective; for checkpoints). State that is not shaped like the segment
        (AdamW's ``step``) is the same for every parameter of the bucket."""
        if not self._finished:
            self.finish()
        out: dict[int, dict[str, Any]] = {}
        for b in self.buckets:
            zb = b.zero
            for key, value in sorted(optimizer.state.get(zb.shard, {}).items()):
                whole = None
                if isinstance(value, torch.Tensor) and value.shape == zb.shard.shape:
                    whole = torch.zeros(b.flat.numel(), dtype=value.dtype, device=value.device)
                    whole[zb.offset:zb.offset + zb.length] = value
                    self._submit(gather_flat, self._comm, whole, self.algorithm, index=b.index).result()
                for p, offset in zip(b.params, b.offsets, strict=True):
                    out.setdefault(id(p), {})[key] = value if whole is None else \
                        whole[offset:offset + p.numel()].view_as(p).clone()
        return out

    def load_state(self, optimizer: torch.optim.Optimizer, states: dict[int, dict[str, Any]]) -> None:
        """The inverse of :meth:`full_state`: each bucket's segment of its parameters' whole state becomes its
        shard's state. Parameters without state leave their bucket's shard without."""
        for b in self.buckets:
            got = [states.get(id(p)) for p in b.params]
            if any(g is None for g in got):
                continue
            zb, state = b.zero, {}
            for key, first in got[0].items():  # type: ignore[union-attr]
                if isinstance(first, torch.Tensor) and first.shape == b.params[0].shape:
                    whole = flat_of([g[key].to(zb.shard.device) for g in got], b.offsets,  # type: ignore[index]
                                     b.flat.numel())
                    state[key] = whole[zb.offset:zb.offset + zb.length].clone()
                else:
                    state[key] = first
            optimizer.state[zb.shard] = state

    def storages(self) -> set[int]:
        """The parameters' storages as they are now (stage 3 allocates them afresh at every gather)."""
        return {b.zero.params.untyped_storage().data_ptr() for b in self.buckets}



def _on_backward(out: Any, fn: Callable[[], None]) -> None:
    """Call ``fn`` once, when backward reaches ``out`` (the first gradient of any of its tensors)."""
    done = [False]

    def hook(grad: torch.Tensor) -> None:
        if not done[0]:
            done[0] = True
            fn()

    for t in _tensors(out):
        if t.requires_grad:
            t.register_hook(hook)


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for x in out:
            yield from _tensors(x)
    elif isinstance(out, dict):  # a Hugging Face ModelOutput is a dict
        for x in out.values():
            yield from _tensors(x)
