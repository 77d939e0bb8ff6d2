"""Data parallelism: every rank holds the whole model, sees its own shard of the batch, and averages gradients.

With the global batch split into equal shards, the mean of the ranks' mean losses is the mean loss over the
global batch, so the averaged gradient is exactly the single-process gradient::

    grad L = 1/G * sum_r grad L_r        (L_r: mean loss over rank r's B/G sequences)

Two implementations, side by side:

* :func:`sync_gradients` — the naive one: after backward, one all-reduce per parameter. The teaching version
  and the oracle.
* :class:`DataParallel` — the fast one: gradients are copied into fixed-size buckets as backward produces them
  (``register_post_accumulate_grad_hook``), and each bucket's all-reduce starts as soon as the bucket is full,
  so communication overlaps the rest of backward::

      dp = DataParallel(model, group, algorithm="ring", bucket_mb=25)
      loss = lm_loss(dp(x), y)
      loss.backward()          # buckets reduce while backward goes on
      dp.finish()              # (idempotent) every bucket done, averaged gradients in p.grad
      optimizer.step()

  Buckets are launched in bucket order on every rank (a bucket that fills early waits for the ones before it),
  so all ranks issue the same collectives in the same order. ``native`` buckets run on the backend's own
  asynchronous all-reduce; fourfold's point-to-point algorithms run one bucket at a time on one communication
  thread.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fourfold.comm import ALGORITHMS, CommStats, Communicator, allreduce, counted_span
from fourfold.comm.compress import Compressor
from fourfold.comm.wait import bounded_wait, collective, gather_objects
from fourfold.launch import on_close
from fourfold.observe.trace import Tracer
from fourfold.parallel.buckets import Bucket, group_params, make_bucket

__all__ = ["DataParallel", "check_find_unused", "sync_gradients"]



def check_find_unused(zero: int, pp: int) -> None:
    """``find_unused_parameters`` is plain data parallelism's: refused with ZeRO (its optimiser steps flat shards,
    which cannot leave one parameter without a gradient) and with a pipeline (not covered yet)."""
    if zero or pp > 1:
        raise ValueError(f"find_unused_parameters works with plain data parallelism, got zero={zero}, pp={pp}: "
                         "ZeRO's optimiser steps flat shards, which cannot leave one parameter without a gradient, "
                         "and a pipeline's stages are not covered yet. Drop zero or pp (fourfold train: --zero, "
                         "--pp), or use every parameter in each step (or freeze those you do not: "
                         "requires_grad=False).")


def sync_gradients(params: Iterable[nn.Parameter], group: dist.ProcessGroup | None = None,
                   tracer: Tracer | None = None, algorithm: str = "native", comm: Communicator | None = None,
                   check: bool = True) -> None:
    """Average every parameter's ``.grad`` over ``group``: one all-reduce per parameter, after backward.

    ``algorithm`` is any of :data:`fourfold.comm.ALGORITHMS`; pass a ``comm`` to reuse its buffers and count
    bytes across steps, and ``check=False`` once the shapes are known to agree on every rank (the first step
    checked them). A parameter without a gradient is refused by name: silently skipping it would let the
    replicas drift apart.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return
    comm = comm if comm is not None else Communicator(group)
    for i, p in enumerate(params):
        if p.grad is None:
            raise RuntimeError(
                f"parameter #{i} (shape {tuple(p.shape)}) got no gradient on rank {dist.get_rank()}: every rank "
                "must use every parameter in each step, or the replicas drift apart.")
        allreduce(p.grad, algorithm, comm=comm, tracer=tracer, check=check)
        p.grad.div_(size)


_WITH_THREAD: weakref.WeakSet[DataParallel] = weakref.WeakSet()  # (weak: a DataParallel dropped is not kept)


def _end_comm_threads() -> None:
    """The process group is gone, and with it what the communication threads were for: end them (waiting for
    each whose last collective finished; one that failed may still be stuck in it). A thread left idle would
    outlive the run in a process that goes on (a notebook, a test calling ``train.main`` again)."""
    for dp in list(_WITH_THREAD):
        if dp._executor is not None:
            dp._executor.shutdown(wait=dp._comm_failed is None, cancel_futures=True)
            dp._executor = None
    _WITH_THREAD.clear()


on_close(_end_comm_threads)


class DataParallel(nn.Module):
    """Replicate ``module`` over ``group``; average gradients bucket by bucket, overlapped with backward.

    ``auto_finish`` (standalone use, like DDP): the last bucket's launch waits for every bucket, so gradients
    are averaged when backward returns. The engine passes False and calls :meth:`finish` itself: it owns the
    end of backward (after the last micro-batch, before tied weights are summed across stages).

    ``comm_group``: the same ranks as ``group`` in a group of their own (:meth:`fourfold.mesh.RankMesh.duplicate`)
    for what runs on the communication thread, when the main thread runs collectives over those ranks meanwhile
    (SyncBatchNorm's, beside ZeRO's reduce-scatters): one group's collectives issued from two threads could meet in
    different orders on different ranks.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None, algorithm: str = "native",
                 bucket_mb: float = 25.0, *, tracer: Tracer | None = None, timeout_s: float = 120.0,
                 find_unused_parameters: bool = False, auto_finish: bool = True,
                 reduce_dtype: torch.dtype | None = None, compress: Compressor | None = None,
                 comm_group: dist.ProcessGroup | None = None, sum_copies: Callable[[], None] | None = None) -> None:
        super().__init__()
        # sums a gradient's copies outside dp (a pipeline's tied weights across stages, sequence parallelism's
        # partial gradients over tp); finish() runs it where that is exact: here after the average (sums and the
        # average commute), under ZeRO before the reduce-scatter (after it each rank holds a segment only)
        self.sum_copies = sum_copies
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}.")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}. 25 (MB) is a good default.")
        self.module = module
        self.group, self.algorithm, self.tracer = group, algorithm, tracer
        self.reduce_dtype = reduce_dtype  # e.g. bfloat16: buckets cross the wire in it (half the bytes)
        self.compress = compress  # int8 or PowerSGD (fourfold.comm.compress): lossy, errors fed back
        if compress is not None and reduce_dtype is not None:
            raise ValueError(f"compress={compress.name!r} sends its own format; reduce_dtype={reduce_dtype} would "
                             "round the gradients first. Pass one of them.")
        self.timeout_s, self.find_unused_parameters = timeout_s, find_unused_parameters
        self.size = dist.get_world_size(group)
        self.grad_scale = 1.0 / self.size  # the mean of the ranks' mean losses; 1.0 sums (a loss already global)
        # what the communication thread reduces over: ``group``, or a duplicate of it (RankMesh.duplicate) when the
        # main thread runs collectives of its own on those ranks meanwhile (SyncBatchNorm's, beside ZeRO)
        self._comm = Communicator(group if comm_group is None else comm_group, timeout_s=timeout_s)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]  # tied weights appear once
        _check_same_layout(named, self._comm)
        _broadcast_state(module, self._comm)
        self.buckets = self._make_buckets(named, int(bucket_mb * 2**20))
        # each parameter's bucket, and its slice of it shaped as the parameter: made once, not per gradient per step
        self._where = {id(p): (b, b.flat[o:o + p.numel()].view_as(p)) for b in self.buckets
                       for p, o in zip(b.params, b.offsets, strict=True)}
        self._names = {id(p): n for n, p in named}
        self._sync = True
        self.auto_finish = auto_finish
        self._gate: set[int] | None = None  # pipelines: only these parameters' next gradients are final
        self._launched = 0
        self._finished = True
        self._checked = False
        self._executor: ThreadPoolExecutor | None = None
        self._comm_failed: BaseException | None = None  # the communication thread's first error
        if self.size > 1:
            for _, p in named:
                p.register_post_accumulate_grad_hook(self._on_grad)

    @property
    def stats(self) -> CommStats:
        """Bytes and messages this rank sent through fourfold's algorithms (``native`` counts none)."""
        return self._comm.stats

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._sync and self.size > 1:
            self.begin()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates gradients locally; the next synchronised backward reduces their sum."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # ------------------------------------------------------------------ the interface ZeRO shares
    # What the engine, the gradient norm and checkpoints ask of the gradients' owner, whichever it is: plain
    # data parallelism answers here; ShardedDataParallel (fourfold.parallel.zero) overrides each.

    zero = 0  # the ZeRO stage: plain data parallelism shards nothing

    def optimizer_parameters(self) -> list[nn.Parameter]:
        """What the optimiser steps: this rank's parameters (under ZeRO, its flat segments of them)."""
        return [p for p in self.module.parameters()]

    def microbatch(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Around one micro-batch's forward and backward (gradient accumulation): only the last reduces."""
        return contextlib.nullcontext() if last else self.no_sync()

    def forward_only(self) -> contextlib.AbstractContextManager[Any]:
        """Forwards that train nothing (evaluation): nothing is reduced."""
        return self.no_sync()

    def gathered(self, write: bool = False) -> contextlib.AbstractContextManager[Any]:
        """Every parameter whole inside the block: they are already (ZeRO gathers them)."""
        return contextlib.nullcontext()

    def storages(self) -> set[int]:
        """Parameter storages allocated afresh at every step (ZeRO-3's gathers); none here."""
        return set()

    def grad_pieces(self, copies: dict[int, int]) -> Iterator[tuple[torch.Tensor, int]]:
        """This rank's gradients, each with the number of ranks in the world holding the same values: its
        ``copies`` in one replica (tensor-parallel and tied copies) times the replicas, which all hold it."""
        for p in self.module.parameters():
            if p.grad is not None:
                yield p.grad, copies.get(id(p), 1) * self.size

    def full_state(self, optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
        """Each parameter's optimiser state (by ``id``), as held: every replica holds all of it."""
        return {id(p): dict(optimizer.state[p]) for p in self.module.parameters() if p in optimizer.state}

    def load_state(self, optimizer: torch.optim.Optimizer, states: dict[int, dict[str, Any]]) -> None:
        """The inverse of :meth:`full_state`."""
        for p in self.module.parameters():
            if id(p) in states:
                optimizer.state[p] = states[id(p)]

    def begin(self, gated: bool = False) -> None:
        """Start collecting this step's gradients (``forward`` calls it). ``gated``: several backwards
        accumulate into each gradient (a pipeline's micro-batches), and a parameter's gradient is packed only
        after :meth:`release` names it, on its next accumulation (the last micro-batch's B, or W)."""
        if not self._finished:
            self.finish()  # a backward whose gradients were never collected: settle it before starting over
        for b in self.buckets:
            b.ready.clear()
            b.handle = None
        self._launched, self._finished = 0, False
        self._gate = set() if gated else None

    def release(self, params: Iterable[nn.Parameter]) -> None:
        """Gated steps: the next accumulation into these parameters' gradients is their last of the step."""
        if self._gate is not None:
            self._gate.update(id(p) for p in params)

    def _on_grad(self, p: torch.Tensor) -> None:
        """After ``p``'s gradient is accumulated: pack it; launch the buckets it completes. It runs once per
        parameter per backward, in Python, so it does no more than that (DDP does the same in C++)."""
        key = id(p)
        if not self._sync or self._finished or (self._gate is not None and key not in self._gate):
            return
        bucket = self._pack(p)
        if len(bucket.ready) < len(bucket.params):
            return
        self._launch_in_order()
        if self._launched == len(self.buckets) and self.auto_finish:
            self.finish()  # the last gradient of this backward: wait here, as backward ends

    def _make_buckets(self, named: list[tuple[str, nn.Parameter]], cap_bytes: int) -> list[Bucket]:
        return [make_bucket(i, members) for i, members in enumerate(group_params(named, cap_bytes))]

    def _pack(self, p: torch.Tensor) -> Bucket:
        """Copy ``p``'s gradient, scaled, into its bucket (the hook runs after accumulation); its bucket."""
        bucket, slot = self._where[id(p)]
        # Scale while packing (grad_scale: 1/G, or 1 when the loss is already the global batch's), so finish()
        # has no separate pass over the buckets on the critical path. A gradient that is already its bucket
        # slice (last step's, zeroed in place) is scaled where it lies.
        torch.mul(p.grad, self.grad_scale, out=slot)  # type: ignore[arg-type]
        bucket.ready.add(id(p))
        return bucket

    def _launch_in_order(self) -> None:
        while self._launched < len(self.buckets):
            b = self.buckets[self._launched]
            if len(b.ready) < len(b.params):
                return
            self._launch(b)
            self._launched += 1

    def _wire(self, b: Bucket) -> torch.Tensor:
        """What the bucket's collective reduces: its buffer, or a copy in ``reduce_dtype`` (read back in
        :meth:`_wait`)."""
        b.wire = b.flat if self.reduce_dtype in (None, b.flat.dtype) else b.flat.to(self.reduce_dtype)
        return b.wire

    def _launch(self, b: Bucket) -> None:
        flat = self._wire(b)
        if self.compress is not None:
            b.handle = self._submit(self._compressed, b, flat)
            return
        if self.algorithm == "native":
            start = self.tracer.now_ns() if self.tracer is not None else 0
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            b.handle = work
            if self.tracer is not None and self.tracer.enabled:
                tracer, numel = self.tracer, b.numel
                work.get_future().then(lambda _: tracer.record(
                    "comm", "allreduce:native", start, tracer.now_ns(), bucket=b.index, numel=numel))
            return
        b.handle = self._submit(allreduce, flat, self.algorithm, comm=self._comm, tracer=self.tracer,
                                check=not self._checked)

    def _compressed(self, b: Bucket, flat: torch.Tensor) -> None:
        """Reduce a bucket through the compressor, traced as one ``allreduce:<name>`` span with its bytes."""
        assert self.compress is not None
        shapes = [(o, p.shape) for p, o in zip(b.params, b.offsets, strict=True)]
        with counted_span(self._comm, self.tracer, f"allreduce:{self.compress.name}", bucket=b.index,
                          numel=flat.numel()):
            self.compress.reduce(self._comm, b.index, flat, shapes, self.algorithm)

    def _submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        """Run ``fn`` on the one communication thread: collectives go in the order issued, the same on every
        rank. Once one has failed, those queued behind it fail at once with its error: each would otherwise wait
        out the timeout for a stuck peer, and the interpreter's exit waits for the thread's queue."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fourfold-dp-comm")
            _WITH_THREAD.add(self)

        def run() -> Any:
            if self._comm_failed is not None:
                raise self._comm_failed
            try:
                return fn(*args, **kwargs)
            except BaseException as e:
                self._comm_failed = e
                raise

        return self._executor.submit(run)

    def finish(self) -> None:
        """Wait for every bucket and write the averaged gradients into ``p.grad`` (idempotent)."""
        if self._finished or self.size == 1:
            return
        missing = [(b, p) for b in self.buckets for p in b.params if id(p) not in b.ready]
        if missing and not self.find_unused_parameters:
            names = ", ".join(self._names[id(p)] for _, p in missing[:8])
            raise RuntimeError(
                f"rank {dist.get_rank()}: {len(missing)} parameter(s) got no gradient this step: {names}. Every "
                "rank must use every parameter in each step; pass find_unused_parameters=True "
                "(fourfold.parallelize(..., find_unused_parameters=True), fourfold train --find-unused-parameters) "
                "to take their gradient as zero on the ranks that did not use them, or freeze them "
                "(requires_grad=False).")
        for b, p in missing:  # unused in this backward: every rank still reduces every bucket
            if p.grad is not None:  # accumulated under no_sync (or zeroed in place): that goes
                self._pack(p)
            else:  # nothing: zero
                self._where[id(p)][1].zero_()
                b.ready.add(id(p))
        self._launch_in_order()
        waiting = self.tracer.span("wait", "grad_sync") if self.tracer is not None else contextlib.nullcontext()
        with waiting:  # the communication backward could not hide
            for b in self.buckets:
                self._wait(b)  # then unpack it at once, while later buckets are still in flight
                if not self.find_unused_parameters:
                    self._unpack(b)
            if self.find_unused_parameters:  # after every bucket: the group is free for one more collective
                unused = self._unused_everywhere()
                for b in self.buckets:
                    self._unpack(b, unused)
        self._finished, self._checked = True, True
        self._copies_after_sync()

    def _copies_after_sync(self) -> None:
        if self.sum_copies is not None:
            self.sum_copies()

    def _unused_everywhere(self) -> set[int]:
        """The parameters no rank has a gradient for (a collective over the group): they keep ``grad = None``,
        as one process leaves a parameter its forward never used (the optimiser then skips it: no weight decay,
        no moments), where DDP's ``find_unused_parameters`` does the same."""
        params = [p for b in self.buckets for p in b.params]
        held = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                            device=self.buckets[0].flat.device)  # where the backend reduces (NCCL: the GPU)
        self._bounded(dist.all_reduce(held, group=self._comm.group, async_op=True),
                      "all-reduce of which parameters have gradients")
        return {id(p) for p, n in zip(params, held.tolist(), strict=True) if n == 0}

    def _unpack(self, b: Bucket, unused: set[int] | frozenset[int] = frozenset()) -> None:
        """Each ``p.grad`` becomes a view of its slice of the bucket (as DDP's ``gradient_as_bucket_view``): no
        copy back, and the gradient autograd produced is freed. ``zero_grad()`` then zeroes the bucket in place
        (or drops the view), and the next backward accumulates into it; the hook packs it again either way.
        ``unused``: parameters no rank has a gradient for, left at None."""
        for p in b.params:
            if id(p) not in unused:
                p.grad = self._where[id(p)][1]

    def _bounded(self, work: Any, op: str) -> None:
        """Wait for a collective over the group, bounded, naming ``op`` and the group's ranks."""
        bounded_wait(work, self.timeout_s, rank=dist.get_rank(), op=op, awaited="the data-parallel group of",
                     group_ranks=self._comm.global_ranks, hint="A peer is dead, stuck, or skipped a backward.")

    def _wait(self, b: Bucket) -> None:
        if isinstance(b.handle, Future):
            b.handle.result()  # the algorithm bounds its own waits and raises CommError naming the peer
        else:
            self._bounded(b.handle, f"native all-reduce of bucket {b.index}")
        if b.wire is not None and b.wire is not b.flat:
            b.flat.copy_(b.wire)  # reduced in reduce_dtype, kept in the parameters' dtype
        b.wire = None


def _check_same_layout(named: list[tuple[str, nn.Parameter]], comm: Communicator) -> None:
    """Refuse, on every rank, replicas whose parameters differ in name, shape or dtype."""
    if comm.size == 1:
        return
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
    everyone = gather_objects(mine, comm.group, op="compare the replicas' parameters")
    reference = dict((n, rest) for n, *rest in everyone[0])
    for r, layout in enumerate(everyone[1:], start=1):
        theirs = dict((n, rest) for n, *rest in layout)
        for name in sorted(set(reference) | set(theirs)):
            a, b = reference.get(name), theirs.get(name)
            if a != b:
                def show(x: Any) -> str:
                    return "missing" if x is None else f"shape {x[0]} {x[1].replace('torch.', '')}"

                raise ValueError(
                    f"every data-parallel replica must hold the same parameters, got {name!r}: {show(a)} on rank "
                    f"{comm.global_ranks[0]} but {show(b)} on rank {comm.global_ranks[r]}. Build the same model "
                    "(same config) on every rank.")


def _broadcast_state(module: nn.Module, comm: Communicator) -> None:
    """Copy group rank 0's parameters and buffers to every rank, so all replicas start equal."""
    if comm.size == 1:
        return
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            collective(dist.broadcast(t.data, src=comm.global_ranks[0], group=comm.group, async_op=True), comm.group,
                       op="broadcast of the initial weights", awaited=f"rank {comm.global_ranks[0]} to the group of",
                       timeout_s=comm.timeout_s, tensor=t)
