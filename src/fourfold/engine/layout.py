"""``Layout``: every parallel setting of a run in one frozen value, and every rule about them, written once.

    from fourfold import Layout, Mesh, launch, parallelize

    ctx = launch.init()
    layout = Layout(tp=2, pp=2, schedule="1f1b", microbatches=4, zero=1)   # refused here if it cannot run
    engine = parallelize(model, layout.mesh(ctx.world_size).build(), layout)

It is the ``[parallel]`` table of a run's TOML and the ``--tp``, ``--zero``, ... flags of ``fourfold train``
(each field's name is its key and, with dashes, its flag), and what :func:`fourfold.parallelize` takes: the CLI
and the library build the same value. A layout checks itself as it is made (a rule that needs the world size,
``dp``, is checked by :meth:`Layout.mesh`); the model-dependent checks (heads per tp rank, blocks per stage)
are the model family's and run before anything is cut.

The axes (what each size splits):

=================  ==========================================================================================
``dp``             data parallelism: replicas of the model, the batch split (``None``: the world left by the
                   others). ZeRO (``zero``) shards their optimiser state, gradients and parameters.
``tp``             tensor parallelism: every big matmul split over the group (Megatron's column/row layers).
``pp``             pipeline parallelism: the model's blocks cut into stages, micro-batches overlapping.
``cp``             context parallelism: each sequence split over the group, attention across the pieces
                   (``cp_algorithm``: ring, allgather or ulysses; ``cp_balance``: the head-tail cut). The weights
                   are replicated over dp x cp; gradients reduced (and ZeRO sharded) over that group.
``ep``             expert parallelism: a mixture of experts' experts split over ranks borrowed from dp (not
                   built yet: issue 49).
``dp_shard``       data parallelism as replicate x shard (HSDP: ZeRO-3 inside groups of ``dp_shard`` ranks,
                   replicas across; not built yet: issue 45).
=================  ==========================================================================================

Ranks are laid out tp innermost, then cp, then dp, then pp (:mod:`fourfold.mesh`).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from fourfold.comm.compress import Compressor, make_compressor
from fourfold.mesh import Mesh
from fourfold.parallel.checkpointing import parse_policy
from fourfold.parallel.data import check_find_unused
from fourfold.parallel.pipeline.split import Balance
from fourfold.parallel.zero import ZERO_ALGORITHMS

__all__ = ["NOT_BUILT", "Layout", "ReduceDtype"]

ReduceDtype = Literal["auto", "float32", "bfloat16", "float16", "float64"]

NOT_BUILT = {"ep": "expert parallelism (issue 49)",
             "dp_shard": "data parallelism as replicate x shard, HSDP (issue 45)"}
"""The axes the Layout names before their strategies land: each refused with this until then."""


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class Layout:
    """How a model is spread over ranks: the parallel sizes and each strategy's settings. Refuses, as it is made,
    any combination that cannot run, naming the values and the fix."""

    # ------------------------------------------------------------------------------------------ sizes
    dp: int | None = field(default=None, metadata=_help(
        "data-parallel size (default: the world size divided by tp*pp)"))
    tp: int = field(default=1, metadata=_help("tensor-parallel size"))
    pp: int = field(default=1, metadata=_help("pipeline-parallel size"))
    cp: int = field(default=1, metadata=_help(
        "context-parallel size: each sequence cut over cp ranks (its tokens' MLPs, norms and loss there), attention "
        "across the pieces by --cp-algorithm"))
    ep: int = field(default=1, metadata=_help("expert-parallel size (not built yet)"))
    dp_shard: int | None = field(default=None, metadata=_help(
        "with --zero 3: ranks sharing one copy of the model, replicated across the rest of dp (HSDP; not built "
        "yet)"))
    cp_algorithm: Literal["ring", "allgather", "ulysses", "auto"] = field(default="ring", metadata=_help(
        "with --cp: ring (K/V blocks pass round the ring, overlapped with attention), allgather (gather every "
        "chunk's K/V), ulysses (all-to-all: whole sequence, heads / cp per rank) or auto (per layer, the least "
        "predicted wire time by the cost model of --allreduce auto)"))
    cp_balance: Literal["head-tail", "none"] = field(default="head-tail", metadata=_help(
        "with --cp: head-tail gives rank i chunks i and 2cp-1-i of 2cp, equal causal work on every rank; none "
        "cuts cp contiguous chunks (the last rank works about 2cp-1 times the first)"))
    # ------------------------------------------------------------------------------------- pipeline
    schedule: Literal["naive", "gpipe", "1f1b", "interleaved", "zb"] = field(default="1f1b", metadata=_help(
        "with --pp: the pipeline schedule (see `fourfold schedule`)"))
    microbatches: int = field(default=4, metadata=_help(
        "with --pp: micro-batches each data-parallel shard is cut into"))
    virtual: int = field(default=2, metadata=_help("with --schedule interleaved: stages per pipeline rank"))
    strategy: Literal["pipeline", "model"] = field(default="pipeline", metadata=_help(
        "with --pp: 'model' places layers on ranks with one micro-batch (model parallelism: one rank busy "
        "at a time)"))
    balance: Balance = field(default="params", metadata=_help(
        "with --pp: how the blocks are cut into stages: params (equal parameter counts) or time (equal measured "
        "forward+backward time)"))
    boundaries: tuple[int | str, ...] | None = field(default=None, metadata=_help(
        "with --pp: where stages 1.. start, as block indices or names (instead of --balance)"))
    # ---------------------------------------------------------------------------------------- tensor
    sequence_parallel: bool = field(default=False, metadata=_help(
        "with --tp: layer norms on a sequence shard, all-gather/reduce-scatter instead of all-reduce"))
    # ------------------------------------------------------------------------------------------ data
    allreduce: Literal["native", "naive", "master", "ring", "tree", "rabenseifner", "hierarchical", "auto"] = field(
        default="native", metadata=_help("gradient all-reduce algorithm for data parallelism (fourfold.comm)"))
    bucket_mb: float = field(default=25.0, metadata=_help(
        "data-parallel gradient bucket size in MB: each full bucket is all-reduced while backward goes on"))
    zero: int = field(default=0, metadata=_help(
        "with --dp: ZeRO stage. 1 shards the optimiser state over the data-parallel ranks, 2 also the gradients "
        "(reduce-scatter instead of all-reduce), 3 also the parameters (all-gathered per block, before forward "
        "and backward); needs --allreduce ring or native"))
    reduce_dtype: ReduceDtype = field(default="auto", metadata=_help(
        "with --dp: the dtype gradients are reduced in (auto: the parameters'); bfloat16 halves the bytes"))
    compress: Literal["none", "bf16", "int8", "powersgd"] = field(default="none", metadata=_help(
        "with --dp: lossy gradient compression. bf16 (the same as --reduce-dtype bfloat16: half the bytes), int8 "
        "(a scale per 256 values, error feedback: 3.9x fewer bytes), powersgd (each weight matrix as rank "
        "--powersgd-rank factors, error feedback); not with --zero, except bf16"))
    powersgd_rank: int = field(default=4, metadata=_help(
        "with --compress powersgd: the rank of each matrix's factors ((n + m) * rank numbers sent for n * m)"))
    powersgd_warmup: int = field(default=10, metadata=_help(
        "with --compress powersgd: the first steps reduced exactly, before compressing"))
    sync_batchnorm: bool = field(default=False, metadata=_help(
        "with --dp: BatchNorm layers take their statistics over the whole batch (every rank's samples), as one "
        "process does; without it each rank normalises its own shard (a warning names the layers)"))
    find_unused_parameters: bool = field(default=False, metadata=_help(
        "with --dp: a model that leaves parameters unused in some steps (a branch taken now and then); their "
        "gradient counts as zero on the ranks that did not use them, and stays None where no rank did, as one "
        "process leaves it. One small all-reduce a step more; not with --zero or --pp"))
    # ------------------------------------------------------------------------------- memory, compute
    precision: Literal["full", "bf16"] = field(default="full", metadata=_help(
        "bf16: mixed precision, forward under bfloat16 autocast (matmuls and their activations in bf16), float32 "
        "master weights, optimiser state and gradients; needs --dtype float32"))
    activation_checkpointing: str = field(default="none", metadata=_help(
        "recompute blocks' activations in backward instead of keeping them: none, full (every block) or every-N "
        "(blocks 0, N, 2N, ...): less activation memory, one more forward per checkpointed block"))
    grad_accum: int = field(default=1, metadata=_help(
        "without --pp: cut each data-parallel shard into N micro-batches run one after another, their gradients "
        "accumulated and synchronised once: the same step, with 1/N of the activation memory (a pipeline cuts "
        "its shard into --microbatches instead)"))

    def __post_init__(self) -> None:
        if self.boundaries is not None and not isinstance(self.boundaries, tuple):  # a TOML list, a Python list
            object.__setattr__(self, "boundaries", tuple(self.boundaries))
        for name in ("tp", "pp", "cp", "ep", "microbatches", "virtual", "grad_accum", "powersgd_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {name}={value!r}.")
        for name in ("dp", "dp_shard"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {name}={value!r}. Leave it out to use every "
                                 "remaining rank.")
        for name, what in NOT_BUILT.items():
            value = getattr(self, name)
            if value not in (None, 1):
                raise ValueError(f"{name} is {what}: not built yet, got {name}={value}. Leave it out (or 1).")
        self._check_choices()
        self._check_pipeline()
        self._check_data()
        if self.cp > 1 and self.sync_batchnorm:
            raise ValueError(f"sync_batchnorm under context parallelism is not built: a BatchNorm would normalise "
                             f"over positions cut over cp={self.cp} ranks. Drop --sync-batchnorm or --cp.")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tensor parallelism, got tp=1. Pass --tp 2 (or more), or drop "
                             "--sequence-parallel.")
        parse_policy(self.activation_checkpointing)  # refuses anything but none, full, every-N

    def _check_choices(self) -> None:
        """The Literal fields, checked from a Python caller too (a TOML file and the flags are checked already)."""
        for f in dataclasses.fields(self):
            choices = _choices(f.name)
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(map(str, choices))}, got "
                                 f"{f.name}={getattr(self, f.name)!r}.")

    def _check_pipeline(self) -> None:
        if self.strategy == "model" and self.pp == 1:
            raise ValueError("strategy 'model' places layers on pipeline ranks, got pp=1. Pass --pp 2 (or more).")
        if self.grad_accum > 1 and self.pp > 1:
            raise ValueError(f"grad_accum cuts a shard into micro-batches without a pipeline, got grad_accum="
                             f"{self.grad_accum} with pp={self.pp}, whose schedule does that already. Pass "
                             f"--microbatches {self.grad_accum * self.microbatches} instead of --grad-accum "
                             f"(microbatches={self.grad_accum * self.microbatches}).")

    def _check_data(self) -> None:
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ValueError(f"zero must be 0 (off), 1, 2 or 3, got zero={self.zero!r}.")
        if self.zero and self.allreduce not in ZERO_ALGORITHMS:
            raise ValueError(f"zero needs a reduce-scatter and an all-gather, which {self.allreduce} does not have, "
                             f"got zero={self.zero} with allreduce={self.allreduce!r}. Pass --allreduce "
                             f"{' or '.join(ZERO_ALGORITHMS)} (ring is counted).")
        if self.compress in ("int8", "powersgd") and self.zero:
            raise ValueError(f"compress {self.compress} replaces the all-reduce, which ZeRO does not use, got "
                             f"compress={self.compress!r} with zero={self.zero}. Drop one (--compress bf16 works with "
                             "--zero).")
        if self.compress != "none" and self.reduce_dtype != "auto" and not (
                self.compress == "bf16" and self.reduce_dtype == "bfloat16"):
            raise ValueError(f"compress sets what crosses the wire, got compress={self.compress!r} with reduce_dtype="
                             f"{self.reduce_dtype!r}. Leave --reduce-dtype auto (reduce_dtype='auto').")
        if self.find_unused_parameters:
            check_find_unused(self.zero, self.pp)
        if not (isinstance(self.bucket_mb, (int, float)) and self.bucket_mb > 0):
            raise ValueError(f"bucket_mb must be > 0, got bucket_mb={self.bucket_mb!r}. 25 (MB) is a good default.")
        if self.powersgd_warmup < 0:
            raise ValueError(f"powersgd_warmup must be >= 0, got powersgd_warmup={self.powersgd_warmup}.")

    # ---------------------------------------------------------------------------------- derived values

    def mesh(self, world_size: int) -> Mesh:
        """The rank grid of ``world_size`` ranks this layout asks for (``dp`` left out: what tp*pp leave),
        refused naming both when they disagree."""
        return Mesh.for_world(world_size, dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp)

    def check_mesh(self, mesh: Mesh) -> None:
        """Refuse a mesh that is not this layout's, naming both."""
        ours = (self.dp if self.dp is not None else mesh.dp, self.tp, self.pp, self.cp)
        if (mesh.dp, mesh.tp, mesh.pp, mesh.cp) != ours:
            cp, mine = (f" cp={mesh.cp}", f" cp={self.cp}") if self.cp != 1 or mesh.cp != 1 else ("", "")
            raise ValueError(f"the mesh must be the layout's, got a mesh of dp={mesh.dp} tp={mesh.tp} pp={mesh.pp}"
                             f"{cp} for a layout of dp={self.dp if self.dp is not None else 'the rest'} tp={self.tp} "
                             f"pp={self.pp}{mine}. Build it as layout.mesh(world_size).build(), or pass a layout of "
                             f"tp={mesh.tp} pp={mesh.pp}{cp}.")

    def for_mesh(self, mesh: Mesh) -> Layout:
        """This layout with its sizes read from ``mesh`` (a library caller's mesh, a layout of the defaults)."""
        return dataclasses.replace(self, dp=mesh.dp, tp=mesh.tp, pp=mesh.pp, cp=mesh.cp)

    @property
    def reduce_torch_dtype(self) -> torch.dtype | None:
        """The dtype gradients cross the wire in under dp (None: the parameters'); compress 'bf16' is bfloat16."""
        if self.compress == "bf16":
            return torch.bfloat16
        return None if self.reduce_dtype == "auto" else getattr(torch, self.reduce_dtype)

    def compressor(self) -> Compressor | None:
        """A fresh compressor of this layout's ``compress`` (None for none and bf16, which is a reduce dtype)."""
        return make_compressor(self.compress, rank=self.powersgd_rank, warmup=self.powersgd_warmup)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a TOML table writes them (``boundaries`` a list; ``None`` left out)."""
        out = dataclasses.asdict(self)
        if out["boundaries"] is not None:
            out["boundaries"] = list(out["boundaries"])
        return out


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(Layout)


def _choices(name: str) -> tuple[Any, ...]:
    """A field's allowed values: its Literal's, or () for a field of another type."""
    hint = _hints()[name]
    return tuple(typing.get_args(hint)) if typing.get_origin(hint) is Literal else ()
