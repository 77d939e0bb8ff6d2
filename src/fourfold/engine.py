"""``fourfold.parallelize``: one entry point for every layout, and the one training step every command runs.

    from fourfold import Mesh, launch, parallelize

    ctx = launch.init()                                        # torchrun's environment, or one process
    ranks = Mesh.for_world(ctx.world_size, tp=2, pp=2).build()  # dp = world / (tp * pp)
    engine = parallelize(TinyGPT(cfg, seed=0), ranks, schedule="1f1b", microbatches=4, sequence_parallel=True)
    opt = torch.optim.AdamW(engine.parameters(), lr=3e-3)
    for x, y in batches:                      # every rank: its data-parallel shard of the global batch
        loss = engine.step(x, y)              # forward, backward, micro-batches, gradient sync
        opt.step(); opt.zero_grad(set_to_none=True)
        print(loss.item())                    # the global batch's mean loss (waited for only now)
    full = engine.state_dict()                # the unsharded model's own names and shapes (a collective)

The strategies are applied in one fixed order, each only along an axis of size > 1:

1. **tensor** (``tp``): the model family's plan (TinyGPT's is :mod:`fourfold.models.gpt_plan`; or
   ``tp_plan={module: "column" | "row" | "vocab"}``) shards every big matmul over the tp group. The sharded
   model still computes the whole forward; its loss is the vocabulary-parallel one.
2. **pipeline** (``pp``): the (sharded) model's blocks are cut into ``pp * virtual`` stages and this rank
   keeps its own; the schedule (GPipe, 1F1B, interleaved, ZB-H1, or ``strategy="model"``: one micro-batch)
   runs them over the pp group. Each stage's tensor-parallel collectives run inside its F/B/W.
3. **data** (``dp``): this rank's parameters (its stages', its shards) are bucketed by
   :class:`~fourfold.parallel.data.DataParallel` over the dp group; under a pipeline a bucket's all-reduce
   starts when the last micro-batch's backward (or W) fills it, overlapping the rest of the schedule.

The engine owns the end of backward: after the last backward it waits for the buckets, then (pipelines) sums
tied copies across stages, then (sequence parallelism) sums partial gradients over tp. The loss all-reduce
over dp starts then and is waited for only by :meth:`Loss.item`, after the optimiser step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from fourfold.comm.compress import Compressor, make_compressor
from fourfold.comm.wait import bounded_wait, gather_objects
from fourfold.data.packing import capture_layout, document_layout
from fourfold.launch import DEFAULT_TIMEOUT_S
from fourfold.loss import IGNORE_INDEX, lm_loss, lm_loss_sum
from fourfold.mesh import Mesh, RankMesh
from fourfold.observe.memory import estimate_held, parameter_storages, saved_bytes_once
from fourfold.observe.trace import DATA_PARALLEL_SPANS, Span, Tracer
from fourfold.parallel.batchnorm import batchnorm_for_data_parallel, batchnorm_for_microbatches
from fourfold.parallel.checkpointing import checkpoint_blocks, parse_policy
from fourfold.parallel.data import DataParallel
from fourfold.parallel.pipeline import Pipeline, StepResult, build_pipeline
from fourfold.parallel.pipeline.blocks import (
    Chain,
    EvalMode,
    Split,
    block_paths,
    build_pieces,
    output_tensor,
    resolve_split,
)
from fourfold.parallel.pipeline.runtime import gather_stages
from fourfold.parallel.pipeline.split import Balance
from fourfold.parallel.schedule import pipeline_schedule
from fourfold.parallel.tensor import (
    ColumnParallelLinear,
    Layout,
    gather_full,
    heads,
    parameter_bytes,
    shard_layouts,
    sum_partial_grads,
    tensor_parallel,
    vocab_parallel_cross_entropy,
)
from fourfold.parallel.tensor.comm import wire_bytes
from fourfold.parallel.zero import ZERO_ALGORITHMS, ShardedDataParallel

__all__ = ["Engine", "Loss", "TensorPlan", "bytes_by_axis", "model_blocks", "parallelize"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
TensorPlan = Callable[..., nn.Module] | Mapping[str, str]
"""A model family's tensor-parallel plan: ``fn(model, group, *, sequence_parallel, tracer) -> sharded model``,
or ``{module name: "column" | "row" | "vocab"}`` for :func:`~fourfold.parallel.tensor.tensor_parallel`."""


@dataclass
class Loss:
    """The step's loss: the mean over the global batch once :meth:`item` has waited for the dp all-reduce."""

    value: torch.Tensor  # float64, (1,): this dp rank's share (then the sum over dp ranks)
    dp: int  # what the sum is divided by: dp for the mean of the ranks' means; 1 for a token-normalised loss
    work: Any = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    group_ranks: tuple[int, ...] = ()
    pipeline: StepResult | None = None  # the pipeline's figures for this step (bubble, memory), if any
    activation_bytes: int = 0  # this rank's peak of activations saved for backward (a pipeline's: its peak)

    def item(self) -> float:
        if self.work is not None:
            bounded_wait(self.work, self.timeout_s, rank=dist.get_rank(), op="loss all-reduce",
                         awaited="the data-parallel group of", group_ranks=self.group_ranks)
            self.work = None
        return self.value.item() / self.dp

    def __float__(self) -> float:
        return self.item()


class Engine:
    """One rank's share of a model under a layout; built by :func:`parallelize`. The loop drives :meth:`step`."""

    def __init__(self, model: nn.Module, ranks: RankMesh, *, pipeline: Pipeline | None, dp: DataParallel | None,
                 loss_fn: LossFn, layouts: dict[str, Layout], partial_grads: list[nn.Parameter],
                 tracer: Tracer, timeout_s: float, split_heads: Sequence[ColumnParallelLinear] = (),
                 sum_loss_fn: LossFn | None = None, reads_documents: bool = False, precision: str = "full") -> None:
        self.model, self.ranks, self.pipeline, self.dp = model, ranks, pipeline, dp
        self.sum_loss_fn, self.reads_documents = sum_loss_fn, reads_documents  # packed documents
        self._split_heads = tuple(split_heads)  # heads whose logits stay split inside step() only
        self.loss_fn, self.layouts, self.tracer, self.timeout_s = loss_fn, layouts, tracer, timeout_s
        self._partial_grads = partial_grads
        self.precision = precision
        self.zero = dp.zero if isinstance(dp, ShardedDataParallel) else 0
        group = ranks.dp_group
        self._dp_ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        self._param_storages = parameter_storages(self.parameters())  # weights are not activations
        self._activations: dict[Any, int] = {}  # input shapes -> bytes saved for backward, measured once
        first = next(iter(self.parameters()), None)
        self._device = first.device if first is not None else torch.device("cpu")  # where the loss is reduced

    @property
    def mesh(self) -> Mesh:
        return self.ranks.mesh

    # ------------------------------------------------------------------------------------------ one step

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *, documents: torch.Tensor | None = None,
             num_tokens: int | None = None) -> Loss:
        """Forward and backward of this rank's shard of the global batch; gradients synchronised in ``p.grad``.

        The loop branches here once: a pipeline runs its schedule's F/B/W over micro-batches; otherwise one
        forward and one backward. Gradients accumulate: zero them after the optimiser step.

        Packed documents (:mod:`fourfold.data.packing`): ``documents`` (B, T) names each position's document
        (-1: padding, whose targets are -100). Attention stays inside documents and positions restart at each.
        The loss is the sum of the real targets' losses divided by ``num_tokens``, the real targets of the whole
        global batch (counted here over dp when not given), so data-parallel gradients are summed and pipeline
        micro-batches added, not averaged: any split of the tokens over rows, micro-batches and ranks gives the
        one-process gradient.
        """
        with self._split_logits():
            if documents is None:
                return self._step(inputs, targets, self.loss_fn, None)
            return self._step(inputs, targets, self._token_loss(inputs, targets, documents, num_tokens), documents)

    def _token_loss(self, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor,
                    num_tokens: int | None) -> LossFn:
        if not self.reads_documents or self.sum_loss_fn is None:
            why = ("it passes a loss_fn of its own (packing needs fourfold's, summed over real tokens)"
                   if self.sum_loss_fn is None else "its attention does not read fourfold's document layout")
            raise ValueError(f"packed documents need a model that keeps them apart, got {type(self.model).__name__}: "
                             f"{why}. Use TinyGPT, GPT-2 or Llama, set fourfold_documents = True on a model whose "
                             "attention calls fourfold.models.attention.causal_attention, or train without packing")
        if documents.shape != inputs.shape or targets.shape != inputs.shape:
            raise ValueError(f"documents and targets must have the inputs' shape {tuple(inputs.shape)}, got "
                             f"{tuple(documents.shape)} and {tuple(targets.shape)}.")
        count = num_tokens if num_tokens is not None else self._count_tokens(targets)
        if count < 1:
            raise ValueError(f"num_tokens must be >= 1 (the global batch's real targets), got {count}.")
        sum_loss = self.sum_loss_fn

        def token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return sum_loss(logits, y) / count

        return token_loss

    def _count_tokens(self, targets: torch.Tensor) -> int:
        """The real targets of the global batch: this rank's, summed over dp before any forward."""
        n = (targets != IGNORE_INDEX).sum().reshape(1).to(torch.float64).to(self._device)
        if self.ranks.dp_group is not None and self.mesh.dp > 1:
            work = dist.all_reduce(n, group=self.ranks.dp_group, async_op=True)
            bounded_wait(work, self.timeout_s, rank=dist.get_rank(), op="token count all-reduce",
                         awaited="the data-parallel group of", group_ranks=self._dp_ranks)
        return int(n.item())

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

    def _step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn,
              documents: torch.Tensor | None) -> Loss:
        packed = documents is not None
        if self.dp is not None:  # a token-normalised loss is already the global batch's: sum, not average
            self.dp.grad_scale = 1.0 if packed else 1.0 / self.dp.size
        if self.pipeline is not None:  # F/B/W of every micro-batch; dp buckets and tied sums inside
            parts = self.pipeline.microbatches("documents", documents, need=False)  # as inputs are cut

            @contextlib.contextmanager
            def around(i: int) -> Iterator[None]:
                with self._compute(), document_layout(parts[i] if parts is not None else None):
                    yield

            result = self.pipeline.step(inputs, targets, loss_fn=loss_fn, mean=not packed, around=around)
            loss = torch.tensor([result.loss], dtype=torch.float64)
        else:
            result = None
            weights: set[int] | Callable[[], set[int]] = self._param_storages
            if isinstance(self.dp, ShardedDataParallel) and self.zero == 3:  # gathered afresh per unit
                dp = self.dp

                def moving() -> set[int]:
                    return self._param_storages | dp.storages()

                weights = moving

            key = (tuple(inputs.shape), documents is not None, torch.is_grad_enabled())
            with self.tracer.span("compute", "forward"), document_layout(documents), \
                    saved_bytes_once(self._activations, key, weights) as saved, self._compute():
                out = self.dp(inputs) if self.dp is not None else self.model(inputs)
                loss = loss_fn(output_tensor(out), targets)  # a Hugging Face output: its .logits
            with self.tracer.span("compute", "backward"):
                loss.backward()  # bucket all-reduces start inside, as gradients become ready
            if self.dp is not None:
                self.dp.finish()  # the engine owns the end of backward
            loss = loss.detach().to(torch.float64).reshape(1).cpu()
            if saved is not None:  # this shape's first step: measured (the same bytes every step after)
                self._activations[key] = sum(saved.values())
        if self._partial_grads and not self.zero:  # sequence parallelism: replicated parameters saw T/tp
            # positions each (under ZeRO summed before the reduce-scatter, as late parameters)
            sum_partial_grads(self._partial_grads, self.ranks.tp_group, tracer=self.tracer)
        out_loss = self._reduce_loss(loss, result, 1 if packed else self.mesh.dp)
        out_loss.activation_bytes = result.peak_activation_bytes if result is not None else self._activations[key]
        return out_loss

    def _compute(self) -> contextlib.AbstractContextManager[Any]:
        """Around every forward: bf16 autocast under mixed precision (the weights stay float32 masters)."""
        if self.precision == "bf16":
            return torch.autocast(self._device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _reduce_loss(self, loss: torch.Tensor, result: StepResult | None, divisor: int) -> Loss:
        group = self.ranks.dp_group
        if self.mesh.dp == 1 or group is None:
            return Loss(loss, 1, pipeline=result)
        value = loss.to(self._device)
        start = self.tracer.now_ns()
        work = dist.all_reduce(value, group=group, async_op=True)  # waited for in Loss.item()
        self.tracer.record("comm", "loss_all_reduce", start, self.tracer.now_ns(), tensor_bytes=8)  # not counted
        return Loss(value, divisor, work, self.timeout_s, self._dp_ranks, result)

    # --------------------------------------------------------------------------------- the model's view

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (its stages', its shards; a tied copy included), for the optimiser. Under
        ZeRO: this rank's flat segments of them (:meth:`ShardedDataParallel.shards`)."""
        if isinstance(self.dp, ShardedDataParallel):
            return self.dp.shards()
        if self.pipeline is not None:
            return self.pipeline.parameters()
        return list(self.model.parameters())

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the model's own names (shards are this rank's pieces)."""
        if self.pipeline is not None:
            yield from self.pipeline.named_parameters()
        else:
            yield from self.model.named_parameters()

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's part of the model's state, under the model's names (tensor-parallel pieces as held).
        Under ZeRO read it inside :meth:`gathered`: stage 3 holds only segments between steps."""
        return self.pipeline.state_dict() if self.pipeline is not None else self.model.state_dict()

    def gathered(self, write: bool = False) -> contextlib.AbstractContextManager[Any]:
        """Under ZeRO, every parameter whole inside the block (a collective over dp); ``write=True``: what is
        written into them becomes this rank's shards on exit (loading). Nothing to do otherwise."""
        if isinstance(self.dp, ShardedDataParallel):
            return self.dp.gathered(write)
        return contextlib.nullcontext()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
        """Each of this rank's parameters' optimiser state under the model's names, shaped like the parameter as
        held here (its tensor-parallel piece). Under ZeRO gathered from the dp ranks' segments: a collective."""
        if isinstance(self.dp, ShardedDataParallel):
            by_id = self.dp.full_state(optimizer)
            return {n: by_id[id(p)] for n, p in self.named_parameters() if id(p) in by_id}
        return {n: dict(optimizer.state[p]) for n, p in self.named_parameters() if p in optimizer.state}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, states: dict[str, dict[str, Any]]) -> None:
        """The inverse of :meth:`optimizer_state` (under ZeRO each rank keeps its segments' share)."""
        named = [(n, p) for n, p in self.named_parameters() if n in states]
        if isinstance(self.dp, ShardedDataParallel):
            self.dp.load_state(optimizer, {id(p): states[n] for n, p in named})
        else:
            for n, p in named:
                optimizer.state[p] = states[n]

    @torch.no_grad()
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole, unsharded state dict (CPU tensors, the model's names and key order), on every rank.

        A collective over tp (all-gather of each sharded tensor) and pp (the stages' parts, in stage order). It
        loads into the model as one process builds it, and is a snapshot: never a view of a live parameter.
        """
        with self.gathered():
            if self.pipeline is None:
                return self._whole(self.model.state_dict())
            mine = [(st.index, self._whole(st.model_state_dict())) for st in self.pipeline.stages]
        return gather_stages(mine, self.ranks.pp_group)

    def _whole(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.mesh.tp > 1:  # gather_full makes new tensors
            return {k: v.cpu() for k, v in gather_full(state, self.layouts, self.ranks.tp_group).items()}
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    def train(self, mode: bool = True) -> Engine:
        (self.pipeline if self.pipeline is not None else self.model).train(mode)
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
        return estimate_held(numel, itemsize, dp=self.mesh.dp, zero=self.zero, optimizer_slots=optimizer_slots)


def bytes_by_axis(spans: list[Span]) -> dict[str, int]:
    """Bytes this rank sent on each axis in ``spans`` (one step's, say).

    ``tp``: what a ring sends for each tensor-parallel collective (:func:`~fourfold.parallel.tensor.comm.wire_bytes`:
    the backend's own collectives are not counted, so they are counted as the ring would move them, and a
    sequence-parallel reduce-scatter + all-gather adds up to the all-reduce it replaces); ``pp``: activations,
    gradients and tied-weight gradients sent between stages (headers included); ``dp``: what fourfold's
    all-reduce algorithms put on the wire (``native`` counts none: the backend sends on its own).
    """
    out = {"dp": 0, "tp": 0, "pp": 0}
    for s in spans:
        if s.kind != "comm":
            continue
        if s.name.startswith("tp."):
            out["tp"] += wire_bytes(s.name.removeprefix("tp."), s.bytes, s.args.get("ranks", 2))
        elif s.name in ("send", "tied_grads"):
            out["pp"] += s.bytes
        elif s.name.startswith(DATA_PARALLEL_SPANS):  # ZeRO: the ring's halves
            out["dp"] += s.bytes
    return out


def parallelize(model: nn.Module, mesh: RankMesh | Mesh | None = None, *, tp_plan: TensorPlan | None = None,
                split: Split | None = None, example: torch.Tensor | None = None,
                sequence_parallel: bool = False, schedule: str = "1f1b", microbatches: int = 1, virtual: int = 2,
                strategy: Literal["pipeline", "model"] = "pipeline", allreduce: str = "native",
                bucket_mb: float = 25.0, sync_batchnorm: bool = False, loss_fn: LossFn | None = None,
                activation_checkpointing: str = "none", zero: int = 0, precision: str = "full",
                reduce_dtype: torch.dtype | None = None, compress: str | Compressor = "none",
                balance: Balance = "params",
                boundaries: list[int | str] | None = None, tracer: Tracer | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> Engine:
    """Apply tensor, then pipeline, then data parallelism to ``model`` along ``mesh``'s axes of size > 1.

    ``mesh``: this rank's :class:`RankMesh` (``Mesh(...).build()``), a :class:`Mesh` (built here: a
    collective), or None for one process. Every rank calls it alike, with a model built the same way (same
    config, same seed). ``model`` is taken apart: use the engine, not the model, afterwards.

    ``model``: TinyGPT, an ``nn.Sequential``, a Hugging Face GPT-2 / Llama causal LM (their plans and splits
    are fourfold's), or your own module with ``tp_plan`` (``{module path: style}``, wildcards allowed) and
    ``split`` (:class:`~fourfold.parallel.pipeline.blocks.Split`, checked on ``example`` against
    ``model(example)`` before anything is cut). ``loss_fn(logits, targets)``: default the mean cross-entropy;
    under tensor parallelism its vocabulary-parallel twin reads split logits, while a ``loss_fn`` of yours is
    given them whole (gathered).

    BatchNorm under dp > 1 normalises each rank's shard on its own (a warning names the layers);
    ``sync_batchnorm=True`` takes the statistics over the whole batch instead
    (:class:`~fourfold.parallel.batchnorm.SyncBatchNorm`, CPU and GPU), equal to one process.

    ``activation_checkpointing``: ``"none"``, ``"full"`` or ``"every-N"``: the model's blocks (TinyGPT's,
    the split's, an ``nn.Sequential``'s layers) drop their saved activations and recompute them in backward
    (:mod:`~fourfold.parallel.checkpointing`); the same numbers, less memory, one more forward per block.

    ``zero``: 1, 2 or 3 shards the optimiser state, then also the gradients, then also the parameters over the
    dp ranks (:mod:`~fourfold.parallel.zero`; ``allreduce`` ``"ring"`` or ``"native"``; nothing to shard when
    dp = 1). Give the optimiser ``engine.parameters()``: under ZeRO these are this rank's flat segments.

    ``precision="bf16"``: mixed precision. The parameters stay float32 (the master weights the optimiser
    updates, its state float32 too); every forward (each micro-batch's, and a checkpointed block's recompute)
    runs under ``torch.autocast(dtype=bfloat16)``, so matmuls take bf16 copies of the weights and make bf16
    activations, while norms, softmax and the loss stay float32; gradients arrive float32. ``reduce_dtype``:
    the dtype gradients cross the wire in under dp (default the parameters'; ``torch.bfloat16`` halves the
    bytes). ``compress``: ``"bf16"`` (the same as ``reduce_dtype=torch.bfloat16``), ``"int8"`` or ``"powersgd"``
    (or a :class:`~fourfold.comm.compress.PowerSGD` of your rank and warm-up): lossy gradient compression with
    error feedback under dp (:mod:`fourfold.comm.compress`), not with ZeRO.
    """
    from fourfold.models import family_of

    ranks = _rank_mesh(mesh, timeout_s)
    m = ranks.mesh
    tracer = tracer if tracer is not None else Tracer(ranks.rank, enabled=False)
    if precision not in ("full", "bf16"):
        raise ValueError(f"precision must be 'full' (the parameters' dtype throughout) or 'bf16' (mixed), got "
                         f"{precision!r}.")
    if precision == "bf16" and any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("precision='bf16' keeps float32 master weights, got a model with parameters of dtype "
                         f"{next(p.dtype for p in model.parameters() if p.dtype != torch.float32)}. Build the "
                         "model in float32 (--dtype float32).")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0 (off), 1, 2 or 3, got {zero}.")
    if zero and allreduce not in ZERO_ALGORITHMS:
        raise ValueError(f"ZeRO needs a reduce-scatter and an all-gather: allreduce {' or '.join(ZERO_ALGORITHMS)}, "
                         f"got {allreduce!r} (an all-reduce only). Pass allreduce='ring' or 'native' with zero.")
    compressor, reduce_dtype = _compression(compress, reduce_dtype, zero)
    if sequence_parallel and m.tp == 1:
        raise ValueError("sequence_parallel needs tensor parallelism, got tp=1. Pass tp >= 2, or drop "
                         "sequence_parallel.")
    if m.dp > 1:  # the batch a BatchNorm normalises over is split: sync it, or say so
        batchnorm_for_data_parallel(model, sync_batchnorm, ranks.dp_group, timeout_s)
    family = family_of(model)
    if m.tp > 1 and family is not None and family.check is not None:
        family.check(model, m.tp)  # whole heads per rank, and the like: before anything is cut
    if m.pp > 1 and microbatches > 1 and strategy != "model":
        batchnorm_for_microbatches(model, microbatches)
    with _untouched(model):  # the split's check and the pipeline's trace run the model on examples
        # 0. the pipeline's pieces, found and checked against model(example) on the whole model
        split = split if split is not None else (family.split(model) if family and family.split else None)
        pieces, examples = None, None
        if m.pp > 1:
            if split is not None:
                examples = _examples(model, example, family)
                if not examples:
                    raise ValueError("a split is checked on an example input, got example=None. Pass "
                                     "example=<one micro-batch of inputs> to parallelize")
                pieces = resolve_split(model, split, examples[0])
        # 1. tensor: shard the matmuls over tp; the sharded model's own loss is the vocabulary-parallel one.
        if m.tp > 1:
            model = _apply_tensor(model, ranks.tp_group, tp_plan, sequence_parallel, tracer)
            if family is not None and family.fixups is not None:
                family.fixups(model, m.tp)
        every = parse_policy(activation_checkpointing)
        if every:  # after sharding (the blocks hold their shards), before the pipeline cuts them into stages
            checkpoint_blocks(model_blocks(model, split), every, capture_layout)
        layouts = shard_layouts(model)
        partial_names = set(getattr(model, "partial_grad_names", ()))
        split_heads = heads(model) if loss_fn is None else []  # a loss_fn of yours reads gathered logits
        sum_loss_fn = None if loss_fn is not None else _split_logits_loss(split_heads, None, ranks.tp_group, tracer,
                                                                          "sum")
        own = getattr(model, "loss_fn", None)  # a family's sharded model computes its own (vocabulary-parallel)
        if own is not None:
            sum_loss_fn = functools.partial(own, reduction="sum")
        loss_fn = own or _split_logits_loss(split_heads, loss_fn, ranks.tp_group, tracer)
        if m.tp > 1 and own is None and not split_heads:  # each tp rank's loss reads its own logits: whole ones?
            was, tracer.enabled = tracer.enabled, False  # a check, not part of any step
            try:
                found = _examples(model, example, family)
                _check_whole_logits(model, found[0] if found else None, ranks)
            finally:
                tracer.enabled = was
        # 2. pipeline: cut the blocks (or the split's pieces) into stages; keep this rank's.
        pipe = None
        if m.pp > 1:
            sched = pipeline_schedule(strategy, schedule, m.pp, microbatches, virtual)
            blocks: nn.Module = Chain(build_pieces(model, pieces), examples or ()) if pieces is not None else model
            pipe = build_pipeline(blocks, sched, ranks.pp_group, balance=balance, boundaries=boundaries,
                                  example=example, loss_fn=loss_fn, tracer=tracer, timeout_s=timeout_s)
    named = dict(pipe.named_parameters()) if pipe is not None else dict(model.named_parameters())
    partial = [p for n, p in named.items() if n in partial_names]
    # 3. data: bucket this rank's parameters over dp (the engine calls finish(): auto_finish off).
    dp: DataParallel | None = None
    if m.dp > 1:
        held: nn.Module = nn.ModuleList(pipe.stages) if pipe is not None else model
        if zero:
            units = _units(model, split) if zero == 3 and pipe is None else []
            dp = _sharded(held, ranks, zero, allreduce, bucket_mb, pipe, partial, units, tracer, timeout_s,
                          reduce_dtype)
        else:
            dp = DataParallel(held, ranks.dp_group, allreduce, bucket_mb, tracer=tracer, timeout_s=timeout_s,
                              auto_finish=False, reduce_dtype=reduce_dtype, compress=compressor)
        if pipe is not None:
            pipe.grad_sync = dp
    reads = bool(getattr(model, "fourfold_documents", False))
    if family is not None and family.documents is not None:
        family.documents(model)  # hooks are no-ops until a packed batch makes its documents current
        reads = True
    return Engine(model, ranks, pipeline=pipe, dp=dp, loss_fn=loss_fn, layouts=layouts, partial_grads=partial,
                  tracer=tracer, timeout_s=timeout_s, split_heads=split_heads, sum_loss_fn=sum_loss_fn,
                  reads_documents=reads, precision=precision)


def _examples(model: nn.Module, example: torch.Tensor | None, family: Any) -> list[torch.Tensor] | None:
    """Inputs to run ``model`` on, first the one a check uses: ``example`` and a batch of two of it, its
    family's, or its own ``example_inputs()``; None when there is none."""
    if example is not None:
        return [example, torch.cat([example, example])]
    if family is not None and family.examples is not None:
        return list(family.examples(model))
    own = getattr(model, "example_inputs", None)
    return list(own()) if callable(own) else None


def _check_whole_logits(model: nn.Module, example: torch.Tensor | None, ranks: RankMesh) -> None:
    """Under tp with no 'head' in the plan the logits must be whole, the same on every tp rank, as each rank's
    loss reads them. A plan that leaves them split ("column" on the output layer) trains each rank on its own
    slice of the vocabulary: a loss that looks plausible and is wrong. The model (sharded, still whole in
    depth) runs once on ``example``, in eval mode, and the logits' shapes and sums are compared over tp; the
    run is refused if they differ. (With no example to run on, nothing is checked; ``--verify`` still shows
    it.)"""
    if example is None:
        return
    with torch.no_grad(), EvalMode(model):
        logits = output_tensor(model(example)).detach().double()
    weights = torch.arange(1, logits.numel() + 1, dtype=torch.float64, device=logits.device).reshape(logits.shape)
    mine = (tuple(logits.shape), float(logits.sum()), float((logits * weights).sum()))
    everyone = gather_objects(mine, ranks.tp_group, op="compare the logits across the tensor-parallel ranks")
    scale = max(1.0, *(abs(x) for _, *sums in everyone for x in sums))
    if any(shape != mine[0] or any(abs(a - b) > 1e-6 * scale for a, b in zip(sums, mine[1:], strict=True))
           for shape, *sums in everyone):
        raise ValueError(
            f"the tensor-parallel ranks of one replica compute different logits (shape {mine[0]} on this rank, "
            "sums differ), and with no 'head' in the plan each rank's loss reads its own: the plan leaves the "
            "output layer's logits split. Mark that layer 'head' (fourfold's vocabulary-parallel loss reads them "
            "split), or leave it out of the plan (replicated).")


@contextlib.contextmanager
def _untouched(model: nn.Module) -> Iterator[None]:
    """The split's check and the pipeline's shape trace run ``model`` on example inputs, in training mode: a
    BatchNorm's running statistics (and ``num_batches_tracked``) would count those runs, and dropout would draw
    from the random generator. Both are put back as they were, so training starts where one process starts."""
    saved = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        yield
    with torch.no_grad():
        for buffer, value in saved:
            buffer.copy_(value)


def _compression(compress: str | Compressor, reduce_dtype: torch.dtype | None,
                 zero: int) -> tuple[Compressor | None, torch.dtype | None]:
    """``compress`` as DataParallel takes it: a compressor, or bf16 as the reduce dtype."""
    compressor = compress if isinstance(compress, Compressor) else make_compressor(compress)
    name = compress.name if isinstance(compress, Compressor) else compress
    if name == "bf16":
        if reduce_dtype not in (None, torch.bfloat16):
            raise ValueError(f"compress='bf16' reduces in bfloat16, got reduce_dtype={reduce_dtype} too. Pass one.")
        reduce_dtype = torch.bfloat16
    if compressor is not None and zero:
        raise ValueError(f"compress={name!r} replaces the all-reduce; ZeRO {zero} reduce-scatters into shards "
                         "instead. Pass zero=0 with int8 or PowerSGD (compress='bf16' works with ZeRO).")
    return compressor, reduce_dtype


def _split_logits_loss(split_heads: Sequence[ColumnParallelLinear], loss_fn: LossFn | None,
                       group: dist.ProcessGroup | None, tracer: Tracer,
                       reduction: Literal["mean", "sum"] = "mean") -> LossFn:
    """The loss for a model whose plan has a ``"head"`` (and no ``loss_fn`` of the user's, which reads the
    logits gathered): fourfold's vocabulary-parallel cross-entropy reads them split (the engine's step stops
    the heads gathering them). ``reduction="sum"``: over real targets, for packed documents."""
    if not split_heads:
        return loss_fn or (lm_loss if reduction == "mean" else lm_loss_sum)

    widths = {h.out_features // h.tp: h for h in split_heads}

    def split_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.shape[-1] not in widths:  # the logits are not what a "head" layer makes: another layer's
            named = ", ".join(f"{h.site or 'a head'!r} ({w} wide per rank)" for w, h in widths.items())
            raise ValueError(f"the loss reads logits {logits.shape[-1]} wide, but the plan's 'head' layers make "
                             f"{named}: the layer that makes the logits must be the plan's 'head' (Hugging Face's "
                             "colwise_rep and colwise_gather_output mean 'head'). Mark the output layer 'head' and "
                             "other column-parallel layers 'column'.")
        return vocab_parallel_cross_entropy(logits, targets, group, tracer=tracer, reduction=reduction)

    return split_loss


def _sharded(held: nn.Module, ranks: RankMesh, zero: int, algorithm: str, bucket_mb: float, pipe: Pipeline | None,
             partial: list[nn.Parameter], units: Sequence[nn.Module], tracer: Tracer,
             timeout_s: float, reduce_dtype: torch.dtype | None) -> ShardedDataParallel:
    """ZeRO over dp. A pipeline's tied copies and sequence parallelism's partial gradients are summed (across
    stages, over tp) before their reduce-scatter, since afterwards each rank holds only a segment of them."""
    late = list(partial)
    if pipe is not None:
        for st in pipe.stages:
            named = dict(st.named_parameters())
            late += [named[name] for name in st.tied]

    def before_late() -> None:
        if pipe is not None:
            pipe.links.exchange_tied(pipe.stages)
        if partial:
            sum_partial_grads(partial, ranks.tp_group, tracer=tracer)

    dp = ShardedDataParallel(held, ranks.dp_group, algorithm, bucket_mb, zero=zero, units=units, late=late,
                             before_late=before_late, tracer=tracer, timeout_s=timeout_s, auto_finish=False,
                             reduce_dtype=reduce_dtype)
    dp.sums_tied = True
    return dp


def _units(model: nn.Module, split: Split | None) -> list[nn.Module]:
    """ZeRO-3's units, gathered and freed one at a time: the model's blocks, or none (the whole model is one)."""
    try:
        return model_blocks(model, split)
    except ValueError:
        return []


def model_blocks(model: nn.Module, split: Split | None) -> list[nn.Module]:
    """The model's repeated blocks: the split's (given, or the model family's), TinyGPT's ``blocks``, or an
    ``nn.Sequential``'s layers."""
    if split is not None:
        return [model.get_submodule(path) for path in block_paths(model, split.blocks)]
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    if isinstance(model, nn.Sequential):
        return list(model)
    raise ValueError(f"activation checkpointing needs the model's blocks, got a {type(model).__name__} with no "
                     "split and no blocks list. Pass split=fourfold.Split(blocks='path.to.ModuleList') (from "
                     "fourfold train --model MODULE:FACTORY: set model.fourfold_split), or "
                     "activation_checkpointing='none' (--activation-checkpointing none)")


def _rank_mesh(mesh: RankMesh | Mesh | None, timeout_s: float) -> RankMesh:
    if mesh is None:
        return RankMesh.single()
    if isinstance(mesh, Mesh):
        if mesh.world_size == 1:
            return RankMesh.single()
        return mesh.build(timeout_s)
    if isinstance(mesh, RankMesh):
        return mesh
    raise TypeError(f"mesh must be a RankMesh, a Mesh or None, got {type(mesh).__name__}. Pass "
                    "Mesh.for_world(world_size, tp=..., pp=...).build().")


def _apply_tensor(model: nn.Module, group: dist.ProcessGroup | None, plan: TensorPlan | None,
                  sequence_parallel: bool, tracer: Tracer) -> nn.Module:
    if plan is None:
        from fourfold.models import tensor_plan  # the model family's own plan, kept beside the model

        plan = tensor_plan(model)
    if callable(plan):
        return plan(model, group, sequence_parallel=sequence_parallel, tracer=tracer)
    if sequence_parallel:
        raise ValueError("sequence_parallel needs a model-family plan that runs its non-parallel parts on "
                         "sequence shards, got a {module: style} mapping. Drop sequence_parallel.")
    return tensor_parallel(model, dict(plan), group, tracer=tracer)  # type: ignore[arg-type]
