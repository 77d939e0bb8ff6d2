"""``fourfold.parallelize``: one entry point for every layout; it composes the strategies into an :class:`Engine`.

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

The step itself, and the end of backward it owns, are :class:`~fourfold.engine.Engine`'s (:mod:`fourfold.engine`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from fourfold.batch import Batch, cat
from fourfold.comm.compress import Compressor, make_compressor
from fourfold.comm.wait import default_timeout_s, gather_objects
from fourfold.data.packing import capture_layout
from fourfold.engine import Engine, LossFn
from fourfold.loss import lm_loss, lm_loss_sum
from fourfold.mesh import Mesh, RankMesh
from fourfold.model_checks import check_own_checkpointing, check_same_model, check_whole_logits
from fourfold.observe.trace import Tracer
from fourfold.parallel.batchnorm import batchnorm_for_data_parallel, batchnorm_for_microbatches
from fourfold.parallel.checkpointing import checkpoint_blocks, parse_policy
from fourfold.parallel.data import DataParallel, check_find_unused
from fourfold.parallel.pipeline import Pipeline, build_pipeline
from fourfold.parallel.pipeline.blocks import (
    Chain,
    Split,
    block_paths,
    build_pieces,
    resolve_split,
)
from fourfold.parallel.pipeline.runtime import PIPELINE_TENSOR
from fourfold.parallel.pipeline.split import Balance
from fourfold.parallel.rng import SEQUENCE_SHARDED, Streams
from fourfold.parallel.schedule import pipeline_schedule
from fourfold.parallel.tensor import (
    ColumnParallelLinear,
    heads,
    shard_layouts,
    shard_regions,
    sum_partial_grads,
    tensor_parallel,
    vocab_parallel_cross_entropy,
)
from fourfold.parallel.tensor.dropout import contain, draw_per_rank
from fourfold.parallel.zero import ZERO_ALGORITHMS, ShardedDataParallel

__all__ = ["TensorPlan", "model_blocks", "parallelize"]

TensorPlan = Callable[..., nn.Module] | Mapping[str, str]
"""A model family's tensor-parallel plan: ``fn(model, group, *, sequence_parallel, tracer) -> sharded model``,
or ``{module name: "column" | "row" | "vocab"}`` for :func:`~fourfold.parallel.tensor.tensor_parallel`."""


def parallelize(model: nn.Module, mesh: RankMesh | Mesh | None = None, *, tp_plan: TensorPlan | None = None,
                split: Split | None = None, example: Batch | None = None,
                sequence_parallel: bool = False, schedule: str = "1f1b", microbatches: int = 1, virtual: int = 2,
                strategy: Literal["pipeline", "model"] = "pipeline", allreduce: str = "native",
                bucket_mb: float = 25.0, sync_batchnorm: bool = False, find_unused_parameters: bool = False,
                loss_fn: LossFn | None = None,
                activation_checkpointing: str = "none", zero: int = 0, precision: str = "full",
                reduce_dtype: torch.dtype | None = None, compress: str | Compressor = "none",
                balance: Balance = "params", grad_accum: int = 1,
                boundaries: list[int | str] | None = None, seed: int | None = None, tracer: Tracer | None = None,
                timeout_s: float | None = None) -> Engine:
    """Apply tensor, then pipeline, then data parallelism to ``model`` along ``mesh``'s axes of size > 1.

    ``mesh``: this rank's :class:`RankMesh` (``Mesh(...).build()``), a :class:`Mesh` (built here: a
    collective), or None for one process. Every rank calls it alike, with a model built the same way (same
    config, same seed). ``model`` is taken apart: use the engine, not the model, afterwards.

    ``model``: TinyGPT, an ``nn.Sequential``, a Hugging Face GPT-2 / Llama causal LM (their plans and splits
    are fourfold's), or your own module with ``tp_plan`` (``{module path: style}``, wildcards allowed) and
    ``split`` (:class:`~fourfold.parallel.pipeline.blocks.Split`, checked on ``example`` against
    ``model(example)`` before anything is cut). ``loss_fn(logits, targets)``: default the cross-entropy over
    the real targets (-100 skipped), divided by the global batch's count of them whatever the layout (see
    :meth:`Engine.step`); under tensor parallelism its vocabulary-parallel twin reads split logits, while a
    ``loss_fn`` of yours, a mean over its rows, is given them whole (gathered).

    ``sequence_parallel`` (tp > 1): the norms, residuals and dropout between the tensor-parallel regions run on
    each rank's T/tp tokens (Megatron's): TinyGPT's plan runs it itself, a Hugging Face family's blocks get it
    around their attention and MLP (:func:`~fourfold.parallel.tensor.regions.shard_regions`); a ``{module:
    style}`` plan of your own refuses it.

    ``find_unused_parameters`` (dp > 1, no ZeRO, no pipeline): a model that leaves parameters unused in some
    steps (a branch taken now and then) trains as one process does: their gradient counts as zero on the ranks
    that did not use them and stays None where no rank did (the optimiser skips them). Without it such a step is
    an error naming them. One small all-reduce a step more.

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

    ``grad_accum`` (no pipeline): :meth:`Engine.step` cuts this rank's batch into that many equal micro-batches
    and runs their forward and backward one after another, the gradients accumulated and synchronised once,
    during the last backward: the step of the whole batch, holding one micro-batch's activations. (A pipeline
    cuts its batch into ``microbatches`` already.)

    ``seed``: dropout's base seed on several ranks (default: tp rank 0's ``torch.initial_seed()``). Each rank then
    draws from streams of its own (:mod:`~fourfold.parallel.rng`): one shared over its tp group, one per tp rank
    inside the tensor-parallel regions; both differ between pipeline stages and data-parallel replicas, and
    :meth:`Engine.step` draws from them only, leaving your own ``torch`` generator as it was. One process draws
    from your generator, as plain PyTorch does.

    ``timeout_s``: how long any collective or send/recv of the engine may wait before it fails naming the rank it
    waited for; None is the run's (``launch.init(timeout_s=...)``, ``fourfold train --timeout``, 120 s default).
    """
    from fourfold.models import family_of

    timeout_s = default_timeout_s() if timeout_s is None else timeout_s  # launch.init's (--timeout)
    ranks = _rank_mesh(mesh, timeout_s)
    m = ranks.mesh
    tracer = tracer if tracer is not None else Tracer(ranks.rank, enabled=False)
    if precision not in ("full", "bf16"):
        raise ValueError(f"precision must be 'full' (the parameters' dtype throughout) or 'bf16' (mixed), got "
                         f"{precision!r}.")
    if precision == "bf16" and any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("precision='bf16' keeps float32 master weights, got a model with parameters of dtype "
                         f"{next(p.dtype for p in model.parameters() if p.dtype != torch.float32)}. Build the "
                         "model in float32 (fourfold train: --dtype float32).")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0 (off), 1, 2 or 3, got {zero}.")
    if zero and allreduce not in ZERO_ALGORITHMS:
        raise ValueError(f"ZeRO needs a reduce-scatter and an all-gather: allreduce {' or '.join(ZERO_ALGORITHMS)}, "
                         f"got {allreduce!r} (an all-reduce only). Pass allreduce='ring' or 'native' with zero.")
    compressor, reduce_dtype = _compression(compress, reduce_dtype, zero)
    if not (isinstance(grad_accum, int) and grad_accum >= 1):
        raise ValueError(f"grad_accum must be an integer >= 1 (1: none), got {grad_accum!r}.")
    if grad_accum > 1 and m.pp > 1:
        raise ValueError(f"grad_accum={grad_accum} with a pipeline (pp={m.pp}): the pipeline cuts the batch into "
                         "micro-batches already. Pass microbatches= (fourfold train --microbatches) instead.")
    if grad_accum > 1:
        batchnorm_for_microbatches(model, grad_accum, accumulated=True)
    if sequence_parallel and m.tp == 1:
        raise ValueError("sequence_parallel needs tensor parallelism, got tp=1. Pass tp >= 2, or drop "
                         "sequence_parallel.")
    if find_unused_parameters:
        check_find_unused(zero, m.pp)
    if m.dp > 1:  # the batch a BatchNorm normalises over is split: sync it, or say so
        batchnorm_for_data_parallel(model, sync_batchnorm, ranks.dp_group, timeout_s)
    for axis, group in (("tp", ranks.tp_group), ("pp", ranks.pp_group)):
        if group is not None:  # each rank keeps its part of its own model: they must be the same model
            check_same_model(model, group, axis)
    family = family_of(model)
    if m.tp > 1:
        check_own_checkpointing(model)
    if (m.tp > 1 or m.pp > 1) and family is not None and family.check is not None:
        family.check(model, m.tp, m.pp)  # whole heads per rank, and the like: before anything is cut
    if m.pp > 1 and microbatches > 1 and strategy != "model":
        batchnorm_for_microbatches(model, microbatches)
    streams = _streams(ranks, seed) if m.world_size > 1 else None
    with _untouched(model):  # the split's check and the pipeline's trace run the model on examples
        # 0. the pipeline's pieces, found and checked against model(example) on the whole model
        split = split if split is not None else (family.split(model) if family and family.split else None)
        pieces, examples = None, None
        if m.pp > 1 and example is not None and not isinstance(example, torch.Tensor):
            raise TypeError(PIPELINE_TENSOR.format(what="inputs", got=type(example).__name__))
        if m.pp > 1:
            if split is not None:
                examples = _examples(model, example, family, m.tp if sequence_parallel else 1)
                if not examples:
                    raise ValueError("a split is checked on an example input, got example=None. Pass "
                                     "example=<one micro-batch of inputs> to parallelize")
                pieces = resolve_split(model, split, examples[0])
        # 1. tensor: shard the matmuls over tp; the sharded model's own loss is the vocabulary-parallel one.
        if m.tp > 1:
            # the family's own plan: its attention and MLP are regions (a plan of yours may split them otherwise)
            sites = family.regions(model) if tp_plan is None and family is not None and family.regions else None
            model = _apply_tensor(model, ranks.tp_group, tp_plan, sequence_parallel and not sites, tracer)
            if family is not None and family.fixups is not None:
                family.fixups(model, m.tp)
            if sites is not None:  # attention and MLP entered once each; sequence parallelism around them
                shard_regions(model, ranks.tp_group, blocks=sites[0], norm=sites[1], head=sites[2],
                              sequence_parallel=sequence_parallel, tracer=tracer)
            assert streams is not None  # several ranks; the sequence-parallel blocks draw per rank throughout
            if sequence_parallel and not hasattr(model, SEQUENCE_SHARDED):
                warnings.warn(f"the tensor plan ran sequence parallelism but named no modules that run on sequence "
                              f"shards (model.{SEQUENCE_SHARDED}): their dropout draws the same masks on every tp "
                              "rank. Set it to the blocks in your plan.", stacklevel=2)
            draw_per_rank(model, streams, getattr(model, SEQUENCE_SHARDED, ()))
        every = parse_policy(activation_checkpointing)
        if every:  # after sharding (the blocks hold their shards), before the pipeline cuts them into stages
            checkpoint_blocks(model_blocks(model, split), every, capture_layout,
                              *((streams.capture,) if streams is not None else ()))
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
            with tracer.paused():  # a check, not part of any step
                found = _examples(model, example, family)
                check_whole_logits(model, found[0] if found else None, ranks)
        # 2. pipeline: cut the blocks (or the split's pieces) into stages; keep this rank's.
        pipe = None
        if m.pp > 1:
            sched = pipeline_schedule(strategy, schedule, m.pp, microbatches, virtual)
            blocks: nn.Module = Chain(build_pieces(model, pieces), examples or ()) if pieces is not None else model
            pipe = build_pipeline(blocks, sched, ranks.pp_group, balance=balance, boundaries=boundaries,
                                  example=example, loss_fn=loss_fn, tracer=tracer, timeout_s=timeout_s)
            if m.tp > 1:  # the runtime calls the stages, not the model: each stage leaves the streams as it found them
                assert streams is not None
                contain(pipe.stages, streams)
    named = dict(pipe.named_parameters()) if pipe is not None else dict(model.named_parameters())
    partial = [p for n, p in named.items() if n in partial_names]
    # 3. data: bucket this rank's parameters over dp (the engine calls finish(): auto_finish off).
    dp: DataParallel | None = None
    if m.dp > 1:
        held: nn.Module = nn.ModuleList(pipe.stages) if pipe is not None else model
        # The communication thread's collectives (ZeRO's, fourfold's point-to-point algorithms, compression's)
        # and SyncBatchNorm's on the main thread, in forward and backward: each on a group of its own, or the
        # ranks could issue them in different orders (gloo aborts, or a hang)
        thread_group = ranks.duplicate("dp", timeout_s) if sync_batchnorm else None
        if zero:
            units = _units(model, split) if zero == 3 and pipe is None else []
            dp = _sharded(held, ranks, zero, allreduce, bucket_mb, pipe, partial, units, tracer, timeout_s,
                          reduce_dtype, thread_group)
        else:
            dp = DataParallel(held, ranks.dp_group, allreduce, bucket_mb, tracer=tracer, timeout_s=timeout_s,
                              auto_finish=False, reduce_dtype=reduce_dtype, compress=compressor,
                              comm_group=thread_group, find_unused_parameters=find_unused_parameters)
        if pipe is not None:
            pipe.grad_sync = dp
    reads = bool(getattr(model, "fourfold_documents", False))
    if family is not None and family.documents is not None:
        family.documents(model)  # hooks are no-ops until a packed batch makes its documents current
        reads = True
    return Engine(model, ranks, pipeline=pipe, dp=dp, loss_fn=loss_fn, layouts=layouts, partial_grads=partial,
                  tracer=tracer, timeout_s=timeout_s, split_heads=split_heads, sum_loss_fn=sum_loss_fn,
                  reads_documents=reads, precision=precision, grad_accum=grad_accum, streams=streams,
                  takes_ids=family is not None)


def _streams(ranks: RankMesh, seed: int | None) -> Streams:
    """This rank's dropout streams, from ``seed`` or else the tp group's first rank's ``torch.initial_seed()``
    (the replicated activations' masks must agree over tp, whether or not every rank seeded alike)."""
    if seed is None:
        seed = torch.initial_seed()
        if ranks.tp_group is not None:
            seed = gather_objects(seed, ranks.tp_group, op="agree on the dropout seed over tp")[0]
    return Streams(seed, ranks.coord)


def _examples(model: nn.Module, example: torch.Tensor | None, family: Any,
              multiple: int = 1) -> list[torch.Tensor] | None:
    """Inputs to run ``model`` on, first the one a check uses: ``example`` and a batch of two of it, its
    family's (cut to lengths of a ``multiple``: sequence parallelism's tp), or its own ``example_inputs()``; None
    when there is none."""
    if example is not None:
        return [example, cat([example, example])]
    if family is not None and family.examples is not None:
        return [x[:, :max(multiple, x.size(1) - x.size(1) % multiple)] for x in family.examples(model)]
    own = getattr(model, "example_inputs", None)
    return list(own()) if callable(own) else None


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
             timeout_s: float, reduce_dtype: torch.dtype | None,
             comm_group: dist.ProcessGroup | None = None) -> ShardedDataParallel:
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
                             reduce_dtype=reduce_dtype, comm_group=comm_group)
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
