"""``fourfold.parallelize``: one entry point for every layout; it applies the strategies in one stated order.

    from fourfold import Layout, launch, parallelize

    ctx = launch.init()                                        # torchrun's environment, or one process
    layout = Layout(tp=2, pp=2, schedule="1f1b", microbatches=4, sequence_parallel=True)
    engine = parallelize(TinyGPT(cfg, seed=0), layout.mesh(ctx.world_size).build(), layout)
    opt = torch.optim.AdamW(engine.parameters(), lr=3e-3)
    for x, y in batches:                      # every rank: its data-parallel shard of the global batch
        loss = engine.step(x, y)              # forward, backward, micro-batches, gradient sync
        opt.step(); opt.zero_grad(set_to_none=True)
        print(loss.item())                    # the global batch's mean loss (waited for only now)
    full = engine.state_dict()                # the unsharded model's own names and shapes (a collective)

The steps, in this order, each only along an axis of size > 1 and each a function of its own:

0. **checks and the split** (:func:`resolve`): the model is the same on every rank, its family's rules hold
   (whole heads per tp rank, ...), and the pipeline's pieces are found and checked against ``model(example)``
   on the whole model, before anything is cut.
1. :func:`apply_tp` (``tp``): the plan (the model family's, beside the model in :mod:`fourfold.models`; or
   ``plan={module: "column" | "row" | "vocab" | "head"}``) shards every big matmul over the tp group.
1b. :func:`apply_cp` (``cp``): each step's sequences are cut over the cp group (head-tail balanced) and the
   model's attention (fourfold's ``causal_attention``) reaches the other chunks by ring, all-gather or Ulysses;
   the weights stay whole, replicated over dp x cp.
2. :func:`apply_ac`: activation checkpointing of the (sharded) blocks.
3. :func:`apply_pp` (``pp``): the blocks are cut into ``pp * virtual`` stages and this rank keeps its own; the
   schedule runs them over the pp group.
4. :func:`apply_dp` (``dp`` x ``cp``): this rank's parameters are bucketed over the replicas (dp x cp), by
   :class:`~fourfold.parallel.data.DataParallel` or, with ZeRO, :class:`~fourfold.parallel.zero.ShardedDataParallel`
   (behind one interface); under a pipeline a bucket starts when the last micro-batch's backward fills it.

Expert parallelism (``ep`` in the :class:`~fourfold.engine.layout.Layout`) will be a step of its own after 1b.
The step, and the end of backward it owns, are :class:`~fourfold.engine.step.Engine`'s.
Until the next release the keywords of the older signature (``schedule=``, ``zero=``, ``tp_plan=``, ...) still
work, each with a DeprecationWarning naming its new home (:data:`MOVED`; docs/architecture.md has the table).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fourfold.comm.compress import COMPRESSIONS, Compressor
from fourfold.comm.wait import gather_objects
from fourfold.data.packing import capture_layout
from fourfold.engine.batch import Batch
from fourfold.engine.checks import (
    check_own_checkpointing,
    check_same_function,
    check_same_model,
    check_whole_logits,
    logits_on,
)
from fourfold.engine.layout import Layout
from fourfold.engine.losses import LossFn, losses
from fourfold.engine.optimizers import mark
from fourfold.engine.pieces import TensorPlan, examples_for, model_blocks, units, untouched
from fourfold.engine.step import Engine
from fourfold.mesh import Mesh, RankMesh
from fourfold.models import Family, family_of, split_of, tensor_plan
from fourfold.parallel.batchnorm import BATCHNORMS, batchnorm_for_data_parallel, batchnorm_for_microbatches
from fourfold.parallel.checkpointing import checkpoint_blocks, parse_policy
from fourfold.parallel.context import WHOLE, ContextParallel, SequenceAxis, capture_shard
from fourfold.parallel.data import DataParallel
from fourfold.parallel.pipeline import Pipeline, build_pipeline
from fourfold.parallel.pipeline.blocks import Chain, Split, build_pieces, resolve_split
from fourfold.parallel.pipeline.runtime import PIPELINE_TENSOR
from fourfold.parallel.rng import SEQUENCE_SHARDED, Streams
from fourfold.parallel.schedule import pipeline_schedule
from fourfold.parallel.tensor import (
    REPLICATED,
    shard_layouts,
    shard_regions,
    sum_partial_grads,
    tensor_parallel,
)
from fourfold.parallel.tensor.dropout import contain, draw_per_rank
from fourfold.parallel.zero import ShardedDataParallel

__all__ = ["MOVED", "TensorPlan", "apply_ac", "apply_cp", "apply_dp", "apply_pp", "apply_tp", "model_blocks",
           "parallelize", "resolve"]

MOVED = {
    **{name: f"Layout({name}=...)" for name in (
        "sequence_parallel", "schedule", "microbatches", "virtual", "strategy", "allreduce", "bucket_mb",
        "sync_batchnorm", "find_unused_parameters", "activation_checkpointing", "zero", "precision", "reduce_dtype",
        "compress", "balance", "grad_accum", "boundaries")},
    "tp_plan": "plan=",
    "seed": "engine.manual_seed(seed)",
    "tracer": "Mesh(...).build(tracer=...) (or RankMesh.single(tracer=...))",
    "timeout_s": "Mesh(...).build(timeout_s=...) (or launch.init(timeout_s=...))",
}
"""Each keyword of the older ``parallelize`` signature and where it lives now."""


def parallelize(model: nn.Module, mesh: RankMesh | Mesh | None = None, layout: Layout | None = None, *,
                plan: TensorPlan | None = None, split: Split | None = None, example: Batch | None = None,
                loss_fn: LossFn | None = None, **moved: Any) -> Engine:
    """Apply ``layout`` to ``model`` along ``mesh``: tensor, then pipeline, then data parallelism, each along an axis
    of size > 1. Returns this rank's :class:`~fourfold.engine.step.Engine`.

    ``mesh``: this rank's :class:`RankMesh` (``layout.mesh(world_size).build()``; it carries the run's timeout
    and tracer), a :class:`Mesh` (built here: a collective), or None for one process. It must be the layout's
    (a layout's ``dp`` left None takes the mesh's). Every rank calls it alike, with a model built the same way
    (same config, same seed). ``model`` is taken apart: use the engine, not the model, afterwards.

    ``layout``: the :class:`~fourfold.engine.layout.Layout` (every setting, checked as it is made); None is
    ``Layout()`` with one micro-batch per pipeline (``microbatches=1``), the older signature's default.

    ``model``: TinyGPT, an ``nn.Sequential``, a Hugging Face causal LM of a family fourfold has a plan and a split
    for, or your own module with ``plan`` (``{module path: style}``, wildcards allowed) and ``split``
    (:class:`~fourfold.parallel.pipeline.blocks.Split`, checked on ``example`` against ``model(example)`` before
    anything is cut). ``loss_fn(logits, targets)``: default the cross-entropy over the real targets (-100 skipped),
    divided by the global batch's count of them whatever the layout (see :meth:`Engine.step`); under tensor
    parallelism its vocabulary-parallel twin reads split logits, while a ``loss_fn`` of yours, a mean over its
    rows, is given them whole (gathered).

    What each setting does is the Layout's field's doc (``Layout.zero``, ``Layout.sequence_parallel``, ...).
    BatchNorm under dp > 1 normalises each rank's shard on its own (a warning names the layers) unless
    ``sync_batchnorm``. Dropout on several ranks draws from streams of the engine's own
    (:mod:`~fourfold.parallel.rng`), seeded from tp rank 0's ``torch.initial_seed()`` or
    :meth:`Engine.manual_seed`; one process draws from your generator, as plain PyTorch does.
    """
    ranks, layout, compressor, seed = _resolve_arguments(mesh, layout, moved)
    if "tp_plan" in moved and plan is not None:
        raise TypeError("parallelize() got plan= and the older tp_plan= together. Pass plan= alone.")
    plan = moved.get("tp_plan", plan)
    m, tracer = ranks.mesh, ranks.recorder
    family = family_of(model)
    _check_model(model, ranks, layout, family)
    streams = _streams(ranks, seed) if m.world_size > 1 else None
    split = split if split is not None else split_of(model, family)
    with untouched(model):  # the split's check and the pipeline's trace run the model on examples
        pieces, examples = resolve(model, ranks, layout, split, example, family)
        # a plan of yours: the sharded model must compute what the whole one does (on the example, if any)
        probe = examples_for(model, example, None) if m.tp > 1 and family is None else None
        whole = None
        if probe:
            with tracer.paused():
                whole = logits_on(model, probe[0])
        model = apply_tp(model, ranks, layout, plan, family, streams)
        sequence = apply_cp(model, ranks, layout, family, loss_fn)
        apply_ac(model, layout, split, streams)
        layouts = shard_layouts(model)
        partial_names = set(getattr(model, "partial_grad_names", ()))
        loss = losses(model, ranks, loss_fn, tracer)
        if m.tp > 1:
            with tracer.paused():  # checks, not part of any step
                if loss.own is None and not loss.split_heads:  # each tp rank reads its own logits: whole?
                    found = examples_for(model, example, family)
                    check_whole_logits(model, found[0] if found else None, ranks)
                if probe and whole is not None:
                    check_same_function(model, probe[0], whole, ranks)
        pipe = apply_pp(model, ranks, layout, pieces, examples, example, loss.loss_fn, streams)
    named = dict(pipe.named_parameters()) if pipe is not None else dict(model.named_parameters())
    partial = [p for n, p in named.items() if n in partial_names]
    dp = apply_dp(model, ranks, layout, pipe, partial, split, compressor)
    copies = dp.sum_copies if dp is not None else copy_sums(pipe, partial, ranks)  # one, dp's where it has one
    reads = bool(getattr(model, "fourfold_documents", False))
    if family is not None and family.documents is not None:
        family.documents(model)  # hooks are no-ops until a packed batch makes its documents current
        reads = True
    engine = Engine(model, ranks, layout, pipeline=pipe, dp=dp, loss_fn=loss.loss_fn, layouts=layouts,
                    sum_copies=copies, split_heads=loss.split_heads, sum_loss_fn=loss.sum_loss_fn,
                    reads_documents=reads, streams=streams, takes_ids=family is not None, sequence=sequence)
    if layout.zero > 0 and m.replicas > 1:  # the optimiser holds pieces: elementwise ones only (engine/optimizers.py)
        mark(engine.parameters(), f"ZeRO-{layout.zero} segments (flat pieces that cross parameters)")
    elif m.tp > 1:
        mark((p for n, p in engine.named_parameters() if layouts.get(n, REPLICATED) != REPLICATED),
             "tensor-parallel slices of weights")
    return engine


# ------------------------------------------------------------------------------------------------ step 0


def resolve(model: nn.Module, ranks: RankMesh, layout: Layout, split: Split | None, example: Batch | None,
            family: Family | None) -> tuple[list[Any] | None, list[torch.Tensor] | None]:
    """The pipeline's pieces (the split's: given, or the model family's), checked against ``model(example)`` on
    the whole model before anything is cut; with the example inputs they were checked on. (None, None) without a
    pipeline, or for a model whose blocks the pipeline finds itself."""
    if ranks.mesh.pp == 1:
        return None, None
    if example is not None and not isinstance(example, torch.Tensor):
        raise TypeError(PIPELINE_TENSOR.format(what="inputs", got=type(example).__name__))
    if split is None:
        return None, None
    examples = examples_for(model, example, family, ranks.mesh.tp if layout.sequence_parallel else 1)
    if not examples:
        raise ValueError("a split is checked on an example input, got example=None. Pass example=<one micro-batch "
                         "of inputs> to parallelize")
    return resolve_split(model, split, examples[0]), examples


def _check_model(model: nn.Module, ranks: RankMesh, layout: Layout, family: Family | None) -> None:
    """What the layout asks of this model, checked before anything is cut; BatchNorm told of the batches it
    will see."""
    m = ranks.mesh
    if layout.precision == "bf16" and any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("precision='bf16' keeps float32 master weights, got a model with parameters of dtype "
                         f"{next(p.dtype for p in model.parameters() if p.dtype != torch.float32)}. Build the "
                         "model in float32 (fourfold train: --dtype float32).")
    if layout.grad_accum > 1:
        batchnorm_for_microbatches(model, layout.grad_accum, accumulated=True)
    if m.dp > 1:  # the batch a BatchNorm normalises over is split: sync it, or say so
        batchnorm_for_data_parallel(model, layout.sync_batchnorm, ranks.dp_group, ranks.timeout)
    for axis, group in (("tp", ranks.tp_group), ("pp", ranks.pp_group)):
        if group is not None:  # each rank keeps its part of its own model: they must be the same model
            check_same_model(model, group, axis)
    if m.tp > 1:
        check_own_checkpointing(model)
    if (m.tp > 1 or m.pp > 1) and family is not None and family.check is not None:
        family.check(model, m.tp, m.pp)  # whole heads per rank, and the like: before anything is cut
    if m.pp > 1 and layout.microbatches > 1 and layout.strategy != "model":
        batchnorm_for_microbatches(model, layout.microbatches)


# ------------------------------------------------------------------------------------------- the steps


def apply_tp(model: nn.Module, ranks: RankMesh, layout: Layout, plan: TensorPlan | None, family: Family | None,
             streams: Streams | None) -> nn.Module:
    """Shard the model's matmuls over tp by ``plan`` (default its family's); the family's attention and MLP
    become regions entered once each, with sequence parallelism around them. Dropout inside the regions draws
    per tp rank. The sharded model (a plan may return a new one)."""
    if ranks.mesh.tp == 1:
        return model
    group, tracer, sp = ranks.tp_group, ranks.recorder, layout.sequence_parallel
    # the family's own plan: its attention and MLP are regions (a plan of yours may split them otherwise)
    sites = family.regions(model) if plan is None and family is not None and family.regions else None
    plan = plan if plan is not None else tensor_plan(model)
    if callable(plan):
        model = plan(model, group, sequence_parallel=sp and not sites, tracer=tracer)
    elif sp and not sites:
        raise ValueError("sequence_parallel needs a model-family plan that runs its non-parallel parts on "
                         "sequence shards, got a {module: style} mapping. Drop sequence_parallel.")
    else:
        model = tensor_parallel(model, dict(plan), group, tracer=tracer)
    if family is not None and family.fixups is not None:
        family.fixups(model, ranks.mesh.tp)
    if sites is not None:  # attention and MLP entered once each; sequence parallelism around them
        shard_regions(model, group, blocks=sites[0], norm=sites[1], head=sites[2], sequence_parallel=sp,
                      tracer=tracer)
    assert streams is not None  # several ranks; the sequence-parallel blocks draw per rank throughout
    if sp and not hasattr(model, SEQUENCE_SHARDED):
        warnings.warn(f"the tensor plan ran sequence parallelism but named no modules that run on sequence shards "
                      f"(model.{SEQUENCE_SHARDED}): their dropout draws the same masks on every tp rank. Set it to "
                      "the blocks in your plan.", stacklevel=3)
    draw_per_rank(model, streams, getattr(model, SEQUENCE_SHARDED, ()))
    return model


def apply_cp(model: nn.Module, ranks: RankMesh, layout: Layout, family: Family | None,
             loss_fn: LossFn | None) -> SequenceAxis:
    """What holds each step's sequences: cut over cp (:class:`~fourfold.parallel.context.ContextParallel`), or
    whole (cp = 1). The model's attention and positions read the shard the engine makes current: TinyGPT's
    (:mod:`fourfold.models.attention`) as they are, a Hugging Face family's once its family hook registers
    fourfold's attention (:mod:`fourfold.models.hf_context`); what cannot be exact is refused here, before any
    step."""
    cp = ranks.mesh.cp
    if cp == 1:
        return WHOLE
    name = type(model).__name__
    if family is not None and family.context is not None:
        family.context(model, cp)  # its attention reads the shard: TinyGPT's itself, Hugging Face's registered
    elif not getattr(model, "fourfold_documents", False):
        raise ValueError(f"context parallelism (cp={cp}) needs a model whose attention and positions are "
                         f"fourfold's (fourfold.models.attention.causal_attention and position_ids), got {name}. "
                         "Use TinyGPT or a Hugging Face family, or set fourfold_documents = True on a model of "
                         "yours that calls them")
    if loss_fn is not None:
        raise ValueError(f"context parallelism (cp={cp}) needs fourfold's own loss, summed over each rank's tokens "
                         "and divided by the global batch's count; a loss_fn of yours is a mean over its chunk. "
                         "Drop loss_fn, or --cp 1")
    for what, m in model.named_modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            raise ValueError(f"dropout under context parallelism is not built (each rank would draw masks for its "
                             f"own chunk, not one process's), got {what or name} with p={m.p}. Build the model "
                             "with dropout 0, or --cp 1")
        if isinstance(m, BATCHNORMS):
            raise ValueError(f"a BatchNorm under context parallelism would normalise over this rank's chunk only, "
                             f"got {what or name}. Use --cp 1")
    return ContextParallel(ranks.cp_group, layout.cp_algorithm, layout.cp_balance == "head-tail", ranks.recorder,
                           ranks.timeout)


def apply_ac(model: nn.Module, layout: Layout, split: Split | None, streams: Streams | None) -> None:
    """Activation checkpointing of the model's blocks: after sharding (the blocks hold their shards), before the
    pipeline cuts them into stages. Its recompute re-enters the step's documents, context shard and streams."""
    every = parse_policy(layout.activation_checkpointing)
    if every:
        checkpoint_blocks(model_blocks(model, split), every, capture_layout, capture_shard,
                          *((streams.capture,) if streams is not None else ()))


def apply_pp(model: nn.Module, ranks: RankMesh, layout: Layout, pieces: list[Any] | None,
             examples: list[torch.Tensor] | None, example: Batch | None, loss_fn: LossFn,
             streams: Streams | None) -> Pipeline | None:
    """Cut the blocks (or the split's pieces) into ``pp * virtual`` stages and keep this rank's, run by the
    layout's schedule over the pp group; None without a pipeline."""
    if ranks.mesh.pp == 1:
        return None
    sched = pipeline_schedule(layout.strategy, layout.schedule, ranks.mesh.pp, layout.microbatches, layout.virtual)
    blocks: nn.Module = Chain(build_pieces(model, pieces), examples or ()) if pieces is not None else model
    pipe = build_pipeline(blocks, sched, ranks.pp_group, balance=layout.balance,
                          boundaries=list(layout.boundaries) if layout.boundaries is not None else None,
                          example=example, loss_fn=loss_fn, tracer=ranks.recorder, timeout_s=ranks.timeout)
    if ranks.mesh.tp > 1:  # the runtime calls the stages, not the model: each leaves the streams as it found them
        assert streams is not None
        contain(pipe.stages, streams)
    return pipe


def apply_dp(model: nn.Module, ranks: RankMesh, layout: Layout, pipe: Pipeline | None,
             partial: list[nn.Parameter], split: Split | None,
             compressor: Compressor | None = None) -> DataParallel | None:
    """Bucket this rank's parameters (its stages', its shards) over the replicas, dp x cp (the ranks holding the
    same weights), ZeRO's shards with ``layout.zero``; the engine ends backward itself (``auto_finish`` off).
    None with dp x cp = 1. ``compressor``: an object of the caller's instead of ``layout.compress``'s."""
    if ranks.mesh.replicas == 1:
        return None
    held: nn.Module = nn.ModuleList(pipe.stages) if pipe is not None else model
    # The communication thread's collectives (ZeRO's, fourfold's point-to-point algorithms, compression's) and
    # SyncBatchNorm's on the main thread, in forward and backward: each on a group of its own, or the ranks
    # could issue them in different orders (gloo aborts, or a hang)
    thread_group = ranks.duplicate("dp", ranks.timeout) if layout.sync_batchnorm else None
    common: dict[str, Any] = {"tracer": ranks.recorder, "timeout_s": ranks.timeout, "auto_finish": False,
              "reduce_dtype": layout.reduce_torch_dtype, "comm_group": thread_group,
              "sum_copies": copy_sums(pipe, partial, ranks)}
    dp: DataParallel
    if layout.zero:
        dp = _sharded(held, model, ranks, layout, pipe, partial, split, common)
    else:
        dp = DataParallel(held, ranks.replica_group, layout.allreduce, layout.bucket_mb,
                          compress=compressor if compressor is not None else layout.compressor(),
                          find_unused_parameters=layout.find_unused_parameters, **common)
    if pipe is not None:
        pipe.grad_sync = dp
    return dp


def copy_sums(pipe: Pipeline | None, partial: list[nn.Parameter], ranks: RankMesh) -> Callable[[], None] | None:
    """What sums a gradient's copies outside dp, or None: a pipeline's tied weights across its stages, sequence
    parallelism's partial gradients over tp (each replicated parameter saw T/tp positions). The data-parallel
    sync runs it where that is exact (:attr:`DataParallel.sum_copies`); without dp the engine runs it."""
    if pipe is None and not partial:
        return None

    def sum_copies() -> None:
        if pipe is not None:  # (a stage without tied weights exchanges nothing)
            pipe.links.exchange_tied(pipe.stages)
        if partial:
            sum_partial_grads(partial, ranks.tp_group, tracer=ranks.recorder)

    return sum_copies


def _sharded(held: nn.Module, model: nn.Module, ranks: RankMesh, layout: Layout, pipe: Pipeline | None,
             partial: list[nn.Parameter], split: Split | None, common: dict[str, Any]) -> ShardedDataParallel:
    """ZeRO over dp. A pipeline's tied copies and sequence parallelism's partial gradients are packed late:
    summed (``sum_copies``, across stages, over tp) before their reduce-scatter, since afterwards each rank holds
    only a segment of them."""
    late = list(partial)
    if pipe is not None:
        for st in pipe.stages:
            named = dict(st.named_parameters())
            late += [named[name] for name in st.tied]

    gathered_one_by_one = units(model, split) if layout.zero == 3 and pipe is None else []
    dp = ShardedDataParallel(held, ranks.replica_group, layout.allreduce, layout.bucket_mb, zero=layout.zero,
                             units=gathered_one_by_one, late=late, **common)
    return dp


# ------------------------------------------------------------------------------------------ arguments


def _resolve_arguments(mesh: RankMesh | Mesh | None, layout: Layout | None, moved: dict[str, Any]
                       ) -> tuple[RankMesh, Layout, Compressor | None, int | None]:
    """This rank's mesh and the layout it runs, from the arguments (and the older signature's keywords, each
    warned of); a compressor object and a seed those keywords gave."""
    unknown = sorted(set(moved) - set(MOVED))
    if unknown:
        raise TypeError(f"parallelize() got unexpected keyword arguments {unknown}. Settings go in the Layout: "
                        "parallelize(model, mesh, Layout(...), plan=..., split=..., example=..., loss_fn=...)")
    for name in moved:
        warnings.warn(f"parallelize({name}=...) is deprecated: use {MOVED[name]}. The old keywords go in the next "
                      "release.", DeprecationWarning, stacklevel=3)
    timeout_s, tracer = moved.get("timeout_s"), moved.get("tracer")
    ranks = _rank_mesh(mesh, timeout_s, tracer)
    given = {k: v for k, v in moved.items() if k in Layout.__dataclass_fields__}
    if layout is not None:
        if given:
            raise TypeError(f"parallelize() got a layout and the older keywords {sorted(given)} beside it. Put them "
                            "in the Layout.")
        layout.check_mesh(ranks.mesh)
        return ranks, layout.for_mesh(ranks.mesh), None, moved.get("seed")
    compressor = given.get("compress") if isinstance(given.get("compress"), Compressor) else None
    if compressor is not None:  # an object of the caller's (a PowerSGD of its rank): used as it is; the layout
        # records its kind only (not a PowerSGD's rank and warm-up, nor a custom compressor's name)
        given["compress"] = compressor.name if compressor.name in COMPRESSIONS else "int8"
    if isinstance(given.get("reduce_dtype"), torch.dtype):
        given["reduce_dtype"] = str(given["reduce_dtype"]).removeprefix("torch.")
    elif "reduce_dtype" in given and given["reduce_dtype"] is None:
        given["reduce_dtype"] = "auto"
    if given.get("strategy") == "model" and ranks.mesh.pp == 1:
        given.pop("strategy")  # the older signature ignored it without a pipeline (one process's reference)
    # the sizes are the mesh's; one micro-batch unless asked: the older signature's default
    layout = dataclasses.replace(Layout(microbatches=1).for_mesh(ranks.mesh), **given)
    return ranks, layout, compressor, moved.get("seed")


def _rank_mesh(mesh: RankMesh | Mesh | None, timeout_s: float | None, tracer: Any) -> RankMesh:
    if mesh is None or (isinstance(mesh, Mesh) and mesh.world_size == 1):
        return RankMesh.single(tracer)
    if isinstance(mesh, Mesh):
        return mesh.build(timeout_s, tracer)
    if isinstance(mesh, RankMesh):
        return mesh.using(tracer=tracer, timeout_s=timeout_s)  # the older keywords: onto this rank's mesh
    raise TypeError(f"mesh must be a RankMesh, a Mesh or None, got {type(mesh).__name__}. Pass "
                    "layout.mesh(world_size).build().")


def _streams(ranks: RankMesh, seed: int | None) -> Streams:
    """This rank's dropout streams, from ``seed`` or else the tp group's first rank's ``torch.initial_seed()``
    (the replicated activations' masks must agree over tp, whether or not every rank seeded alike)."""
    if seed is None:
        seed = torch.initial_seed()
        if ranks.tp_group is not None:
            seed = gather_objects(seed, ranks.tp_group, op="agree on the dropout seed over tp")[0]
    return Streams(seed, ranks.coord)

