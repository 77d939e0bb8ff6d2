"""The one training step every command runs: :class:`Engine`, built by :func:`fourfold.parallelize`.

The engine branches once, when it is built: its :class:`~fourfold.engine.runner.Runner` is a pipeline's
schedule (:class:`~fourfold.engine.runner.Piped`) or the model's own forward and backward
(:class:`~fourfold.engine.runner.Plain`), and the gradients' owner is plain data parallelism or ZeRO behind one
interface (:class:`~fourfold.parallel.data.DataParallel`). The engine owns the end of backward: after the last
backward the owner waits for its buckets, then (pipelines) tied copies are summed across stages, then (sequence
parallelism) partial gradients over tp. The loss all-reduce over dp starts then and is waited for only by
:meth:`Loss.item`, after the optimiser step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fourfold.comm.wait import Pending, group_ranks
from fourfold.engine import gradnorm
from fourfold.engine.batch import Batch, pad, rows
from fourfold.engine.checks import check_same_rows
from fourfold.engine.layout import Layout
from fourfold.engine.losses import LossFn, check_num_tokens, count_tokens
from fourfold.engine.runner import Piped, Plain, Runner
from fourfold.loss import IGNORE_INDEX
from fourfold.mesh import Mesh, RankMesh
from fourfold.observe.memory import estimate_held, parameter_storages
from fourfold.parallel.context import WHOLE, SequenceAxis
from fourfold.parallel.data import DataParallel
from fourfold.parallel.pipeline import Pipeline, StepResult
from fourfold.parallel.rng import Streams
from fourfold.parallel.tensor import (
    ColumnParallelLinear,
    ShardLayout,
    fill_pieces,
    gather_full,
    parameter_bytes,
)

__all__ = ["Engine", "Loss", "LossFn"]



@dataclass(eq=False)
class Loss:
    """The step's loss: the mean over the global batch once :meth:`item` has waited for the dp all-reduce."""

    value: torch.Tensor  # float64, (1,): this dp rank's share (then the sum over dp ranks)
    dp: int  # what the sum is divided by: dp for the mean of the ranks' means; 1 for a token-normalised loss
    work: Pending | None = None  # the all-reduce in flight (waited for once, here or when the Loss is dropped)
    pipeline: StepResult | None = None  # the pipeline's figures for this step (bubble, memory), if any
    activation_bytes: int = 0  # this rank's peak of activations saved for backward (a pipeline's: its peak)

    @classmethod
    def all_reduced(cls, value: torch.Tensor, divisor: int, group: dist.ProcessGroup | None, timeout_s: float,
                    pipeline: StepResult | None = None) -> Loss:
        """Start summing ``value`` (this rank's share) over ``group``; :meth:`item` waits for it."""
        work = dist.all_reduce(value, group=group, async_op=True)
        return cls(value, divisor, Pending(work, timeout_s, op="loss all-reduce", awaited="the data-parallel group of",
                                           group_ranks=group_ranks(group)), pipeline)

    def item(self) -> float:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.value.item() / self.dp

    def __float__(self) -> float:
        return self.item()


class Engine:
    """One rank's share of a model under a layout; built by :func:`fourfold.parallelize`. The loop drives :meth:`step`."""

    def __init__(self, model: nn.Module, ranks: RankMesh, layout: Layout, *, pipeline: Pipeline | None,
                 dp: DataParallel | None, loss_fn: LossFn, layouts: dict[str, ShardLayout],
                 sum_copies: Callable[[], None] | None, split_heads: Sequence[ColumnParallelLinear] = (),
                 sum_loss_fn: LossFn | None = None, reads_documents: bool = False, streams: Streams | None = None,
                 takes_ids: bool = False, sequence: SequenceAxis = WHOLE) -> None:
        self.model, self.ranks, self.pipeline, self.dp = model, ranks, pipeline, dp
        self.layout = layout  # what parallelize applied, its sizes the mesh's
        tracer, timeout_s = ranks.recorder, ranks.timeout
        self.sum_loss_fn, self.reads_documents = sum_loss_fn, reads_documents  # packed documents
        self.takes_ids = takes_ids  # a model family's (TinyGPT, Hugging Face): forward(ids), one tensor
        self._split_heads = tuple(split_heads)  # heads whose logits stay split inside step() only
        self.loss_fn, self.layouts, self.tracer, self.timeout_s = loss_fn, layouts, tracer, timeout_s
        self._sum_copies = sum_copies
        self.sequence = sequence  # cp > 1: each sequence cut for this rank, its attention across the others
        self.zero = dp.zero if dp is not None else 0
        # the one branch: a pipeline's schedule, or the model's forward and backward (in grad_accum parts)
        self.runner: Runner = (Piped(pipeline, self.gathered) if pipeline is not None else
                               Plain(model, dp, layout.grad_accum, tracer, parameter_storages(
                                   dp.optimizer_parameters() if dp is not None else model.parameters()),
                                   self.finish_backward))
        if pipeline is not None:
            pipeline.end_backward = self.finish_backward
        self._rows_checked = self._tokens_checked = False
        first = next(iter(self.parameters()), None)
        self._device = first.device if first is not None else torch.device("cpu")  # where the loss is reduced
        self.streams = streams  # several ranks: dropout's own streams (fourfold.parallel.rng); one: the caller's
        if streams is not None:
            streams.bind(self._device)

    def manual_seed(self, seed: int) -> Engine:
        """Seed the dropout streams of a layout of several ranks (:mod:`~fourfold.parallel.rng`) from ``seed``, as
        ``torch.manual_seed`` seeds one process's generator: every rank calls it alike, before the first step.
        On one process the engine draws from your own generator, so this changes nothing: seed that."""
        if self.streams is not None:
            self.streams.reseed(seed)
        return self

    @property
    def mesh(self) -> Mesh:
        return self.ranks.mesh

    @property
    def device(self) -> torch.device:
        """Where this rank's parameters live (and its losses and norms are reduced)."""
        return self._device

    # ------------------------------------------------------------------------------------------ one step

    def step(self, inputs: Batch, targets: torch.Tensor, *, documents: torch.Tensor | None = None,
             num_tokens: int | None = None) -> Loss:
        """Forward and backward of this rank's shard of the global batch; gradients synchronised in ``p.grad``.

        The runner runs it: a pipeline's schedule's F/B/W over micro-batches, or one forward and one backward
        (``grad_accum`` of them). Gradients accumulate: zero them after the optimiser step.

        With fourfold's own loss (no ``loss_fn`` given to :func:`~fourfold.parallelize`), the loss is the sum of
        the real targets' losses (``-100``, :data:`~fourfold.loss.IGNORE_INDEX`, skipped) divided by
        ``num_tokens``, the real targets of the whole global batch (counted here over dp when not given), so
        data-parallel gradients are summed and micro-batches added, not averaged: any split of the tokens over
        rows, micro-batches and ranks gives the one-process loss and gradient, padded targets included. A
        ``loss_fn`` of the user's must be a mean over its rows; the replicas' and micro-batches' are averaged.

        Packed documents (:mod:`fourfold.data.packing`): ``documents`` (B, T) names each position's document
        (-1: padding, whose targets are -100). Attention stays inside documents and positions restart at each.
        """
        self.check_rows(inputs, targets)
        with self._split_logits(), self._drawing():
            loss_fn, tokens = self._loss(inputs, targets, documents, num_tokens)  # counted on whole sequences
            inputs, targets, documents, shard = self.sequence.cut(inputs, targets, documents)
            with self.sequence.running(shard):
                return self._step(inputs, targets, loss_fn, documents, tokens)

    def check_rows(self, inputs: Batch | None, targets: torch.Tensor | None) -> None:
        """Refuse, naming the ranks, a replica whose tp and pp ranks were given other rows than each other
        (:func:`~fourfold.engine.checks.check_same_rows`). :meth:`step` runs it on its first call, a collective
        over the tp and pp groups; call it first where a step's collectives are counted."""
        if not self._rows_checked:
            check_same_rows(inputs, targets, self.ranks)
            self._rows_checked = True

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor, *, documents: torch.Tensor | None = None,
                 num_tokens: int | None = None) -> Loss:
        """The loss of this rank's shard of a global batch without training on it: forward only, in eval mode
        (no dropout; BatchNorm reads its running statistics), no gradient, nothing changed. The same loss as
        ``model.eval()`` on one process, reduced like :meth:`step`'s; a collective like it (every rank calls
        it). It holds no more than a training step: the forward runs in ``grad_accum`` parts (or the pipeline's
        micro-batches) as step's does, and under ZeRO-3 each block is gathered and freed in turn (a pipeline's
        stages gathered once, as in a step).

        A validation set's last, partial batch needs no special care with fourfold's own loss: a shard whose
        rows the parts do not divide (even none, or replicas of unequal rows) is padded with rows of targets
        ``-100``, which add nothing to the loss nor to its count (in eval mode no row sees another)."""
        was = self.runner.training
        self.eval()
        try:
            with self._split_logits(), self._drawing():  # no dropout, but the streams' hooks still switch
                loss_fn, tokens = self._loss(inputs, targets, documents, num_tokens)
                inputs, targets, documents = self._whole_parts(inputs, targets, documents, tokens)
                inputs, targets, documents, shard = self.sequence.cut(inputs, targets, documents)
                with self.sequence.running(shard):
                    loss = self.runner.evaluate(inputs, targets, loss_fn, documents, tokens, self._compute)
        finally:
            self.train(was)
        return self._reduce_loss(loss, None, 1 if tokens else self.mesh.dp)

    def _whole_parts(self, inputs: Batch, targets: torch.Tensor, documents: torch.Tensor | None, tokens: bool
                     ) -> tuple[Batch, torch.Tensor, torch.Tensor | None]:
        """The batch padded to a multiple of the parts evaluate cuts it into (the pipeline's micro-batches, or
        ``grad_accum``), with rows nothing is predicted from: targets ``-100``, inputs 0, documents -1 (padding).
        A token-normalised loss is unchanged by them; a mean over rows (a loss_fn of the user's) would be, so
        such a batch is refused, naming the fix."""
        m = self.runner.parts
        n = rows(inputs)
        extra = -n % m if n or not tokens else m  # an empty shard: padded, or (a loss_fn of yours) as before
        if not extra:
            return inputs, targets, documents
        if not tokens:
            raise ValueError(f"evaluate cuts this rank's batch into {m} equal parts, as step does, got {n} rows; "
                             "with a loss_fn of your own (a mean over rows) padding rows would change the mean. "
                             f"Pass a multiple of {m} rows per rank, or drop loss_fn: fourfold's own loss pads a "
                             "partial batch exactly")
        return (pad(inputs, extra), pad(targets.long(), extra, IGNORE_INDEX),  # uint8 ids cannot hold -100
                pad(documents, extra, -1) if documents is not None else None)

    def _loss(self, inputs: Batch, targets: torch.Tensor, documents: torch.Tensor | None,
              num_tokens: int | None) -> tuple[LossFn, bool]:
        """This step's loss and whether it is token-normalised (the global batch's already: summed over dp and
        micro-batches) or a mean over rows (a loss_fn of the user's: averaged)."""
        if self.takes_ids and not isinstance(inputs, torch.Tensor):
            keys = f" with keys {sorted(inputs)}" if isinstance(inputs, dict) else ""
            raise ValueError(f"{type(self.model).__name__} is called model(ids): inputs must be one (B, T) tensor of "
                             f"token ids, got a {type(inputs).__name__}{keys}. Right padding needs no attention "
                             "mask (its targets -100); left padding goes through documents= (docs/your-model.md)")
        if self.sum_loss_fn is None:  # the user's loss_fn
            if documents is not None or num_tokens is not None:
                raise ValueError(f"packed documents and num_tokens need fourfold's own loss, summed over real "
                                 f"tokens, got a loss_fn of your own for {type(self.model).__name__}. Drop loss_fn "
                                 "(fourfold's is next-token cross-entropy, skipping -100 targets) or train without "
                                 "packing")
            return self.loss_fn, False
        if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
            raise TypeError(f"targets must be integer token ids (-100: none), got a {targets.dtype} tensor of shape "
                            f"{tuple(targets.shape)}. Pass them as int64 or int32 (tokenizer ids as they come), or "
                            "give parallelize a loss_fn of your own for other targets")
        if isinstance(inputs, torch.Tensor) and _unshifted(inputs, targets):
            raise ValueError(f"targets equal the inputs (shape {tuple(targets.shape)}): fourfold's loss predicts "
                             "targets[:, t] from inputs[:, :t+1], so the targets are the inputs shifted by one "
                             "(inputs = ids[:, :-1], targets = ids[:, 1:]); with targets = inputs the model learns to "
                             "copy its input. Hugging Face's labels = input_ids relies on the model's own loss to "
                             "shift them; fourfold's does not")
        if documents is not None:
            if not self.reads_documents:
                raise ValueError(f"packed documents need a model that keeps them apart, got "
                                 f"{type(self.model).__name__}: its attention does not read fourfold's document "
                                 "layout. Use TinyGPT, GPT-2 or Llama, set fourfold_documents = True on a model whose "
                                 "attention calls fourfold.models.attention.causal_attention, or train without packing")
            shape = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__
            if tuple(documents.shape) != shape or tuple(targets.shape) != shape:
                raise ValueError(f"documents and targets must have the inputs' shape {shape}, got "
                                 f"{tuple(documents.shape)} and {tuple(targets.shape)}.")
        if num_tokens is not None:
            if num_tokens < 0:
                raise ValueError(f"num_tokens must be >= 0 (the global batch's real targets), got {num_tokens}.")
            if not self._tokens_checked:
                self._tokens_checked = True
                check_num_tokens(int(num_tokens), self._device, self.timeout_s)
            count: int | torch.Tensor = max(int(num_tokens), 1)  # none: loss 0, as when counted here
        else:
            count = count_tokens(targets, self.ranks, self._device, self.timeout_s)
        sum_loss = self.sum_loss_fn

        def token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return sum_loss(logits, y.long()) / count  # int32 ids (numpy's, a tokenizer's) as int64

        return token_loss, True

    @contextlib.contextmanager
    def _split_logits(self) -> Iterator[None]:
        """Inside the engine's step the head leaves its logits split for the vocabulary-parallel loss; any other
        caller (``engine.model(ids, labels=...)``, generation) gets them whole."""
        for head in self._split_heads:
            head.gather_output = False
        try:
            yield
        finally:
            for head in self._split_heads:
                head.gather_output = True

    def _drawing(self) -> contextlib.AbstractContextManager[Any]:
        """Several ranks: the step draws from this rank's dropout streams, and puts the caller's back after."""
        return self.streams.stepping() if self.streams is not None else contextlib.nullcontext()

    def _step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn,
              documents: torch.Tensor | None, tokens: bool) -> Loss:
        if self.dp is not None:  # a token-normalised loss is already the global batch's: sum, not average
            self.dp.grad_scale = 1.0 if tokens else 1.0 / self.dp.size
        loss, result, activation_bytes = self.runner.step(inputs, targets, loss_fn, documents, tokens, self._compute)
        out_loss = self._reduce_loss(loss, result, 1 if tokens else self.mesh.dp)
        out_loss.activation_bytes = activation_bytes
        return out_loss

    def finish_backward(self) -> None:
        """The end of backward, in every layout, owned here: the data-parallel sync waited for (its buckets
        started inside backward) and a gradient's copies outside dp summed (a pipeline's tied weights across
        stages, sequence parallelism's partial gradients over tp), which dp runs where that is exact: after its
        average, or before ZeRO's reduce-scatter (:attr:`~fourfold.parallel.data.DataParallel.sum_copies`).
        The runner calls it once per step: after the last backward, or after the pipeline's last action."""
        if self.dp is not None:
            self.dp.finish()
        elif self._sum_copies is not None:
            self._sum_copies()

    def _compute(self) -> contextlib.AbstractContextManager[Any]:
        """Around every forward: bf16 autocast under mixed precision (the weights stay float32 masters)."""
        if self.layout.precision == "bf16":
            return torch.autocast(self._device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _reduce_loss(self, loss: torch.Tensor, result: StepResult | None, divisor: int) -> Loss:
        group = self.ranks.replica_group  # dp x cp: each rank's share of the token-normalised loss
        if self.mesh.replicas == 1 or group is None:
            return Loss(loss, 1, pipeline=result)
        start = self.tracer.now_ns()
        out = Loss.all_reduced(loss.to(self._device), divisor, group, self.timeout_s, result)  # waited: Loss.item
        self.tracer.record("comm", "loss_all_reduce", start, self.tracer.now_ns(), tensor_bytes=8)  # not counted
        return out

    # --------------------------------------------------------------------------------- the model's view

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (its stages', its shards; a tied copy included), for the optimiser. Under
        ZeRO: this rank's flat segments of them (:meth:`ShardedDataParallel.shards`)."""
        return self.dp.optimizer_parameters() if self.dp is not None else self.runner.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the model's own names (shards are this rank's pieces)."""
        yield from self.runner.named_parameters()

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's part of the model's state, under the model's names (tensor-parallel pieces as held).
        Under ZeRO read it inside :meth:`gathered`: stage 3 holds only segments between steps."""
        return self.runner.state_dict()

    def gathered(self, write: bool = False) -> contextlib.AbstractContextManager[Any]:
        """Under ZeRO, every parameter whole inside the block (a collective over dp); ``write=True``: what is
        written into them becomes this rank's shards on exit (loading). Nothing to do otherwise."""
        return self.dp.gathered(write) if self.dp is not None else contextlib.nullcontext()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
        """Each of this rank's parameters' optimiser state under the model's names, shaped like the parameter as
        held here (its tensor-parallel piece). Under ZeRO gathered from the dp ranks' segments: a collective."""
        if self.dp is not None:
            by_id = self.dp.full_state(optimizer)
            return {n: by_id[id(p)] for n, p in self.named_parameters() if id(p) in by_id}
        return {n: dict(optimizer.state[p]) for n, p in self.named_parameters() if p in optimizer.state}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, states: dict[str, dict[str, Any]]) -> None:
        """The inverse of :meth:`optimizer_state` (under ZeRO each rank keeps its segments' share)."""
        named = [(n, p) for n, p in self.named_parameters() if n in states]
        if self.dp is not None:
            self.dp.load_state(optimizer, {id(p): states[n] for n, p in named})
        else:
            for n, p in named:
                optimizer.state[p] = states[n]

    @torch.no_grad()
    def state_dict(self, to: int | None = None) -> dict[str, torch.Tensor]:
        """The whole, unsharded state dict (CPU tensors, the model's names and key order), on every rank, or on
        global rank ``to`` alone (the others return ``{}`` and never hold the whole model: what a writer needs).

        A collective over tp (all-gather of each sharded tensor) and pp (the stages' parts, in stage order). It
        loads into the model as one process builds it, and is a snapshot: never a view of a live parameter.
        """
        there, here = (self.mesh.coord(to) if to is not None else None), self.ranks.coord
        with self.gathered():  # every dp rank enters it: ZeRO's gather is a collective over dp
            if there is not None and (there.dp, there.cp) != (here.dp, here.cp):
                return {}  # another replica's copy: its ranks need not gather anything
            keep = there is None or there.tp == here.tp  # with ``to``, its pipeline group keeps; its tp peers help
            return self.runner.whole_state(self._whole, keep, to, self.timeout_s, self.device)

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """The inverse of :meth:`state_dict`: write each tensor this rank holds from its whole value,
        ``state[name]`` under the model's own name, cut for this layout (its tensor-parallel piece). Only those
        names are read, one at a time, so ``state`` may be a mapping that reads each from a file when asked
        (:class:`fourfold.models.weights.StoredWeights`, a checkpoint's pieces). Every rank calls it alike (under
        ZeRO it is a collective over dp)."""
        with self.gathered(write=True):  # ZeRO: written whole, kept as this rank's segments
            fill_pieces(self.local_state_dict(), state, self.layouts, self.ranks.coord.tp, self.mesh.tp)

    def _whole(self, state: dict[str, torch.Tensor], keep: bool = True) -> dict[str, torch.Tensor]:
        """``state`` made whole over tp, on the CPU; with ``keep`` False only the collectives (``{}``)."""
        if self.mesh.tp > 1:  # gather_full makes new tensors
            return {k: v.cpu() for k, v in gather_full(state, self.layouts, self.ranks.tp_group, keep=keep,
                                                       timeout_s=self.timeout_s).items()}
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()} if keep else {}

    @functools.cached_property
    def grad_copies(self) -> dict[int, int]:
        """How many ranks of one replica hold each of this rank's parameters (:func:`fourfold.engine.gradnorm.copies`):
        fixed once the model is cut, so found once."""
        return gradnorm.copies(self)

    def grad_norm(self, norm_type: float = 2.0) -> float:
        """The whole model's gradient norm, as one process computes it (:mod:`fourfold.engine.gradnorm`): every copy
        of a value counted once, summed over the world. A collective: every rank calls it, after :meth:`step`."""
        return gradnorm.grad_norm(self, norm_type)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """``torch.nn.utils.clip_grad_norm_`` for the whole model under this layout: scale every rank's
        gradients so the global norm is at most ``max_norm``; the norm before clipping. A collective; call it
        after :meth:`step` and before the optimiser step. (torch's on ``engine.parameters()`` would see only
        this rank's pieces, and clip each rank differently.)"""
        return gradnorm.clip_grad_norm_(self, max_norm, norm_type)

    def train(self, mode: bool = True) -> Engine:
        self.runner.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    # ------------------------------------------------------------------------------------------ figures

    def counters(self) -> dict[str, Any]:
        """This rank's parameter memory (sharded / replicated / total bytes) and the bytes its data-parallel
        algorithm has sent so far."""
        pb = parameter_bytes(self.model, self.named_parameters())
        # "sharded" + "replicated" (over tp) = "before_zero3"; "total": what this rank holds between steps, which
        # under ZeRO-3 is its 1/dp segments of those
        held = sum(p.numel() * p.element_size() for p in self.parameters()) if self.zero >= 3 else pb.total
        out: dict[str, Any] = {"parameter_bytes": {**pb._asdict(), "before_zero3": pb.total, "total": held}}
        if self.dp is not None:
            out["dp_sent_bytes"] = self.dp.stats.sent_bytes
        return out

    def memory_estimate(self, optimizer_slots: int = 2) -> dict[str, int]:
        """This rank's parameters, gradients and optimiser state between steps, from the formula
        (:func:`~fourfold.observe.memory.estimate_held`) with this rank's own parameter count and dtype."""
        params = {id(p): p for _, p in self.named_parameters() if p.requires_grad}
        numel = sum(p.numel() for p in params.values())
        itemsize = next(iter(params.values())).element_size() if params else 4
        return estimate_held(numel, itemsize, dp=self.mesh.replicas, zero=self.zero, optimizer_slots=optimizer_slots)


def _unshifted(inputs: torch.Tensor, targets: torch.Tensor) -> bool:
    """Whether ``targets`` are ``inputs`` unshifted: equal at every real (not -100) target, in some row that is not
    one token repeated (for which shifted and unshifted are the same)."""
    if inputs.shape != targets.shape or inputs.dim() != 2 or inputs.shape[1] < 2:
        return False
    real = targets != IGNORE_INDEX
    same = torch.where(real, inputs == targets.to(inputs.dtype), True)
    return bool(real.any()) and bool(same.all()) and bool(((inputs != inputs[:, :1]) & real).any())
