"""Shard a whole model by a plan, and see it whole again: ``{module name: style}`` -> tensor-parallel layers in
place; the :class:`~fourfold.parallel.tensor.layers.ShardLayout` of every state-dict entry; the full state dict
gathered from (or loaded into) the shards; parameter memory per rank; the partial gradients sequence
parallelism leaves on replicated parameters.

    tensor_parallel(model, {"fc1": "column", "fc2": "row"}, group)     # in place; returns model
    full = gather_state_dict(model, group)                             # loads into the unsharded model

Model families keep their own plans beside the model (TinyGPT's: :mod:`fourfold.models.gpt_plan`); this module
knows no model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from fourfold.comm.wait import collective
from fourfold.observe.trace import Tracer
from fourfold.parallel.tensor.comm import Group, all_reduce
from fourfold.parallel.tensor.layers import (
    REPLICATED,
    ColumnParallelLinear,
    RowParallelLinear,
    Sharded,
    ShardLayout,
    VocabParallelEmbedding,
    computes_linear,
    fused,
    is_conv1d,
    shard,
    unshard,
)
from fourfold.parallel.tensor.norm import ShardedRMSNorm

__all__ = [
    "HF_STYLES",
    "LazyState",
    "ParameterBytes",
    "expand_plan",
    "fill_pieces",
    "gather_full",
    "gather_state_dict",
    "heads",
    "load_full_state_dict",
    "parameter_bytes",
    "shard_layouts",
    "sum_partial_grads",
    "sync_replicated_grads",
    "tensor_parallel",
]


# Hugging Face's plan vocabulary (``model.tp_plan``) in fourfold's styles; "replicate" leaves a module whole.
HF_STYLES = {"colwise": "column", "rowwise": "row", "embedding_rowwise": "vocab", "colwise_gather_output": "head",
             "colwise_rep": "head", "replicate": None, "replicated_with_grad_allreduce": "partial"}
STYLES = ("column", "column:<parts>", "row", "vocab", "head", "norm", "partial")
SHARDED = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ShardedRMSNorm)
"""Every module that holds tensor-parallel pieces (a :class:`~fourfold.parallel.tensor.layers.Sharded`)."""


def expand_plan(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str | None]:
    """``plan`` with wildcards expanded (``*`` is one path component: ``layers.*.mlp.up_proj``) and Hugging
    Face's style names read as fourfold's; a pattern matching no module is refused, naming the modules."""
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, str | None] = {}
    for pattern, given in plan.items():
        style = HF_STYLES.get(given, given) if isinstance(given, str) else given
        if style is not None:
            _parse_style(pattern, style)
        parts = pattern.split(".")
        hits = [n for n in names if len(n.split(".")) == len(parts)
                and all(p == "*" or p == q for p, q in zip(parts, n.split("."), strict=True))]
        if not hits:
            linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Embedding) or is_conv1d(m)]
            raise ValueError(f"plan names a module the model does not have, got {pattern!r}. Linear and "
                             f"Embedding modules: {', '.join(linear[:12])}{' ...' if len(linear) > 12 else ''}")
        out.update(dict.fromkeys(hits, style))
    return out


def _parse_style(name: str, style: str) -> tuple[str, int | tuple[int, ...]]:
    """``(kind, parts)``: ``column:3`` is 3 equal fused blocks, ``column:32,8,8`` blocks of those widths' proportions
    (lowest terms: ``(4, 1, 1)``)."""
    kind, _, given = style.partition(":")
    widths = given.split(",")
    if kind in ("column", "row", "vocab", "head", "norm", "partial") and (not given or (
            kind == "column" and all(w.isdigit() and int(w) >= 1 for w in widths))):
        return kind, int(given or 1) if len(widths) == 1 else fused([int(w) for w in widths])
    hf = ", ".join(k for k in HF_STYLES)
    raise ValueError(f"plan style for {name!r} must be one of {', '.join(STYLES)} (or Hugging Face's {hf}), "
                     f"got {style!r}. Shard that module with one of these, or leave it out of the plan (replicated). "
                     "<parts>: a fused weight's count of equal blocks (3), or their widths (32,8,8)")


def _unshardable(model: nn.Module, name: str, style: str, kind: str, module: nn.Module) -> str:
    want = "nn.Embedding" if kind == "vocab" else "nn.Linear (or a GPT-2 Conv1D)"
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    if isinstance(parent, nn.MultiheadAttention):  # its out_proj is a Linear subclass it never calls
        return (f"plan style {style!r} cannot shard {name!r}: nn.MultiheadAttention (nn.TransformerEncoderLayer's "
                "too) computes with its weights directly rather than calling its layers, so a plan cannot split its "
                "attention. Split the MLP around it (linear1 'column', linear2 'row'), or write the attention with "
                "nn.Linear q, k, v ('column') and output ('row') layers of your own (docs/your-model.md)")
    if isinstance(module, nn.Linear) and kind != "vocab":
        return (f"plan style {style!r} cannot shard {name!r}: {type(module).__name__} subclasses nn.Linear, but its "
                "forward does not compute x @ W.T + b (checked on a random input), so splitting its weight would "
                "change what it computes. Leave it out of the plan, or give it nn.Linear's forward")
    return (f"plan style {style!r} shards an {want}, got {name!r}: {type(module).__name__}. Use "
            "'column'/'row'/'head' for linear layers and 'vocab' for nn.Embedding")


def tensor_parallel(model: nn.Module, plan: Mapping[str, str], group: Group, *,
                    tracer: Tracer | None = None, sequence_parallel: bool = False) -> nn.Module:
    """Shard ``model`` in place: each module named in ``plan`` is replaced by its tensor-parallel version.

    Styles: ``"column"``: nn.Linear (or GPT-2's Conv1D) -> :class:`ColumnParallelLinear` (output left split:
    feed it, through elementwise work only, to a ``"row"`` layer); ``"column:3"``: the same for a fused
    weight of 3 parts side by side (q|k|v), each split p ways, and ``"column:32,8,8"`` for parts of unequal
    widths (grouped-query q|k|v: 32 query heads, 8 key and 8 value heads; any unit); ``"row"``:
    -> :class:`RowParallelLinear` (its input is a column layer's split output); ``"vocab"``: nn.Embedding -> :class:`VocabParallelEmbedding`;
    ``"head"``: a column layer whose output is the logits (the engine's loss reads them split; any other
    caller gets them gathered); ``"norm"``: an RMSNorm over a column layer's split output, its weight split
    alike and its mean square taken over all the features (:class:`~fourfold.parallel.tensor.norm.ShardedRMSNorm`:
    OLMo 2's q/k norms over all heads); ``"partial"``: a module left whole that sees only this rank's part of a split
    activation (Qwen3's per-head q/k norms: this rank's heads), so its gradients are summed over tp after
    backward (listed in ``model.partial_grad_names``, as sequence parallelism's). Names may hold ``*``
    wildcards, and Hugging Face's style names are read too (``colwise``, ``rowwise``, ``embedding_rowwise``,
    ``colwise_gather_output``, ``replicated_with_grad_allreduce``). A weight two modules share
    (a tied embedding and head: both split by rows of W) stays one shared Parameter. ``sequence_parallel`` is
    for models that run their non-parallel parts on sequence shards themselves (as TinyGPT's plan does).
    Returns ``model``.
    """
    # id(full weight) -> (name, layout, its shard, the full weight: held so its id is not reused meanwhile)
    sharded: dict[int, tuple[str, ShardLayout, nn.Parameter, torch.Tensor]] = {}
    partial: list[str] = []
    for name, style in expand_plan(model, plan).items():
        if style is None:
            continue
        module = model.get_submodule(name)
        kind, parts = _parse_style(name, style)
        if kind == "partial":  # whole on every rank; its gradient a partial sum until summed over tp
            partial += [f"{name}.{p}" for p, q in module.named_parameters() if q.requires_grad]
            continue
        kw: dict[str, Any] = {"tracer": tracer, "site": name, "sequence_parallel": sequence_parallel}
        holder = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        linear = ((computes_linear(module) or is_conv1d(module))
                  and not isinstance(holder, nn.MultiheadAttention))  # its out_proj is a Linear it never calls
        new: Sharded
        try:
            if kind == "norm":  # its features are a column layer's split output: the mean square over all of them
                new = ShardedRMSNorm.from_norm(module, group, tracer=tracer, site=name)
            elif kind in ("column", "head") and linear:
                extra = {"head": True, "gather_output": True} if kind == "head" else {"parts": parts}
                new = ColumnParallelLinear.from_linear(module, group, **kw, **extra)
            elif kind == "row" and linear:
                new = RowParallelLinear.from_linear(module, group, **kw)
            elif kind == "vocab" and type(module) is nn.Embedding:
                new = VocabParallelEmbedding.from_embedding(module, group, **kw)
            else:
                raise TypeError(_unshardable(model, name, style, kind, module))
        except ValueError as e:  # a size tp does not divide: say which layer
            raise ValueError(f"plan entry {name!r} ({style}): {e}") from e
        full, layout = module.weight, new.layouts()["weight"]
        assert isinstance(full, torch.Tensor)
        if id(full) in sharded:  # tied: reuse the first shard, if it was cut the same way
            other, other_layout, weight, _ = sharded[id(full)]
            if other_layout != layout:
                raise ValueError(f"{other!r} and {name!r} share one weight, so the plan must split it the same "
                                 f"way in both, got {other_layout} and {layout}. Shard a tied head as 'head'")
            new.weight = weight
        else:
            sharded[id(full)] = (name, layout, new.weight, full)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in sharded:
            raise ValueError(f"{name!r} is tied to {sharded[id(param)][0]!r}, which the plan shards, so it "
                             f"would keep the full weight and train apart. Add {name.rpartition('.')[0]!r} to "
                             "the plan")
    if partial:
        setattr(model, "partial_grad_names", (*getattr(model, "partial_grad_names", ()), *partial))  # noqa: B010
    return model


def heads(model: nn.Module) -> list[ColumnParallelLinear]:
    """The model's ``"head"`` layers: column-parallel layers whose output is the logits."""
    return [m for m in model.modules() if isinstance(m, ColumnParallelLinear) and m.head]


def shard_layouts(model: nn.Module) -> dict[str, ShardLayout]:
    """The :class:`ShardLayout` of every ``model.state_dict()`` entry: tensor-parallel pieces, the rest replicated."""
    out = dict.fromkeys(model.state_dict(keep_vars=True), REPLICATED)
    for prefix, module in model.named_modules(remove_duplicate=False):  # a module held twice: both its names
        if isinstance(module, SHARDED):
            for name, layout in module.layouts().items():
                key = f"{prefix}.{name}" if prefix else name
                if key in out:
                    out[key] = layout
    return out


@torch.no_grad()
def gather_state_dict(model: nn.Module, group: Group) -> dict[str, torch.Tensor]:
    """The full, unsharded state dict on every rank: what one process's model would hold. A collective.

    Keys are ``model.state_dict()``'s, so a TinyGPT sharded by :func:`parallelize_tinygpt` gives a dict
    ``TinyGPT(config).load_state_dict`` accepts. Apply the same :func:`unshard` to optimiser state by name.
    """
    return gather_full(model.state_dict(keep_vars=True), shard_layouts(model), group)


@torch.no_grad()
def gather_full(state: Mapping[str, torch.Tensor], layouts: Mapping[str, ShardLayout], group: Group, *,
                keep: bool = True, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
    """Every entry of ``state`` (this rank's pieces, cut as ``layouts`` says; missing: replicated) made whole
    by an all-gather over ``group``: new tensors, never views of the pieces. A collective. ``keep=False``: take
    part in the collectives only, keeping nothing (``{}``: a rank another one gathers for). ``timeout_s``: each
    all-gather's bound (None: the run's)."""
    p = dist.get_world_size(group)
    done: dict[int, torch.Tensor | None] = {}  # a tied tensor is gathered once, on every rank alike
    for key, t in state.items():
        layout = layouts.get(key, REPLICATED)
        if id(t) not in done:
            pieces = [t.detach()]
            if layout.dim is not None and p > 1:
                pieces = [torch.empty_like(t.detach()) for _ in range(p)]
                collective(dist.all_gather(pieces, t.detach().contiguous(), group=group, async_op=True), group,
                           op=f"gather of {key}'s tensor-parallel pieces", timeout_s=timeout_s, tensor=t)
            done[id(t)] = unshard(pieces, layout) if keep else None
    return {key: done[id(t)] for key, t in state.items()} if keep else {}  # type: ignore[misc]


def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], group: Group) -> None:
    """Copy this rank's piece of every full tensor in ``state`` (one process's state dict) into ``model``."""
    fill_pieces(model.state_dict(keep_vars=True), state, shard_layouts(model), dist.get_rank(group),
                dist.get_world_size(group))


class LazyState(Mapping[str, torch.Tensor]):
    """Whole tensors by name, each read only when asked for (``read(name)``): what :func:`fill_pieces` takes from
    a file or a checkpoint's pieces, so that no rank holds more than one whole tensor it does not keep."""

    def __init__(self, names: Iterable[str], read: Callable[[str], torch.Tensor]) -> None:
        self._names, self._read = dict.fromkeys(names), read

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._read(name)

    def __contains__(self, name: object) -> bool:  # without reading it
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@torch.no_grad()
def fill_pieces(local: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], layouts: Mapping[str, ShardLayout],
                rank: int, p: int) -> None:
    """Copy into each ``local[name]`` (this rank's piece, cut as ``layouts`` says; missing: replicated) its piece
    of the whole tensor ``state[name]``, read one at a time (``state`` may read each from a file when asked). A
    tensor ``local`` lists twice (a tied weight under its two names) is read and written once."""
    filled: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for key, t in local.items():
        if key not in state:
            raise ValueError(f"state must hold every tensor of the model's state dict, got no {key!r}. Pass the "
                             "whole model's state dict (gather_state_dict, Engine.state_dict, or stored weights)")
        where = (t.data_ptr(), tuple(t.shape), t.stride())
        if t.numel() and where in filled:
            continue  # the same memory, filled under its other name
        filled.add(where)
        whole = state[key]
        layout = layouts.get(key, REPLICATED)
        piece = shard(whole, layout, rank, p) if layout.dim is not None else whole
        if piece.shape != t.shape:
            raise ValueError(f"state[{key!r}] must be the full tensor of this model's piece, got shape "
                             f"{tuple(whole.shape)}, which gives {tuple(piece.shape)} on rank {rank} for "
                             f"{tuple(t.shape)}. Build the model from the checkpoint's config")
        t.copy_(piece)


class ParameterBytes(NamedTuple):
    """Bytes of this rank's parameters: ``sharded`` (a 1/p piece of a full tensor) and ``replicated``."""

    sharded: int
    replicated: int

    @property
    def total(self) -> int:
        return self.sharded + self.replicated


def parameter_bytes(model: nn.Module, named: Iterable[tuple[str, nn.Parameter]] | None = None) -> ParameterBytes:
    """This rank's parameter memory, a tied weight once; every parameter of a plain model is replicated.

    ``named``: the parameters this rank holds under ``model``'s names, when it holds only some (a pipeline
    rank's stages); default: all of ``model``'s.
    """
    layouts = shard_layouts(model)
    sharded = replicated = 0
    for name, param in (model.named_parameters() if named is None else named):
        if layouts.get(name, REPLICATED).dim is None:
            replicated += param.numel() * param.element_size()
        else:
            sharded += param.numel() * param.element_size()
    return ParameterBytes(sharded, replicated)


def sum_partial_grads(params: Iterable[nn.Parameter], group: Group, *, tracer: Tracer | None = None) -> None:
    """Sum over ``group`` the gradients of ``params`` (replicated parameters that saw only this rank's sequence
    shard under sequence parallelism): one all-reduce per dtype. Once per step, after the last backward (with
    gradient accumulation the sum of sums is the sum)."""
    if dist.get_world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for param in params:
        if param.grad is None:
            raise RuntimeError(f"a parameter of shape {tuple(param.shape)} got no gradient on rank "
                               f"{dist.get_rank()}: sum partial gradients after backward")
        by_dtype.setdefault(param.grad.dtype, []).append(param)
    for group_params in by_dtype.values():
        flat = torch.cat([q.grad.reshape(-1) for q in group_params])  # type: ignore[union-attr]
        flat = all_reduce(flat, group, tracer=tracer, phase="grad_sync", site="grad_sync")
        offset = 0
        for q in group_params:
            q.grad.copy_(flat[offset:offset + q.numel()].view_as(q))  # type: ignore[union-attr]
            offset += q.numel()


def sync_replicated_grads(model: nn.Module, group: Group, *, tracer: Tracer | None = None) -> None:
    """:func:`sum_partial_grads` of the parameters ``model.partial_grad_names`` lists (sequence parallelism
    only; a no-op for a model without the attribute or with an empty list)."""
    names = set(getattr(model, "partial_grad_names", ()))
    if names:
        sum_partial_grads([p for n, p in model.named_parameters() if n in names], group, tracer=tracer)
