"""The loss a layout trains with: fourfold's own (the cross-entropy of the real targets, summed and divided by
the global batch's count of them), its vocabulary-parallel twin under tensor parallelism, a model's own sharded
loss, or the user's ``loss_fn`` (a mean over rows, given the logits whole)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from fourfold.comm.wait import all_reduce
from fourfold.loss import IGNORE_INDEX, lm_loss, lm_loss_sum
from fourfold.mesh import RankMesh
from fourfold.observe.trace import Tracer
from fourfold.parallel.tensor import ColumnParallelLinear, heads, vocab_parallel_cross_entropy

__all__ = ["LossFn", "Losses", "check_num_tokens", "count_tokens", "losses"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Losses(NamedTuple):
    loss_fn: LossFn  # what a step's forward ends in
    sum_loss_fn: LossFn | None  # the same summed over real targets (fourfold's own loss); None: the user's loss_fn
    split_heads: Sequence[ColumnParallelLinear]  # heads whose logits stay split over tp inside a step
    own: LossFn | None  # the sharded model's own loss (a family's vocabulary-parallel one), if it has one


def losses(model: nn.Module, ranks: RankMesh, loss_fn: LossFn | None, tracer: Tracer) -> Losses:
    """The sharded ``model``'s losses: a family's own (``model.loss_fn``), else fourfold's, reading the plan's
    ``"head"`` logits split over tp; or the user's ``loss_fn``, which reads them gathered."""
    split_heads = heads(model) if loss_fn is None else []  # a loss_fn of yours reads gathered logits
    sum_loss_fn = None if loss_fn is not None else _split_logits_loss(split_heads, None, ranks.tp_group, tracer, "sum")
    own = getattr(model, "loss_fn", None)  # a family's sharded model computes its own (vocabulary-parallel)
    if own is not None:
        sum_loss_fn = functools.partial(own, reduction="sum")
    return Losses(own or _split_logits_loss(split_heads, loss_fn, ranks.tp_group, tracer), sum_loss_fn,
                  split_heads, own)


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


def check_num_tokens(num_tokens: int, device: torch.device, timeout_s: float) -> None:
    """The first ``num_tokens`` given must be the same on every rank: the global batch's count (a rank's own
    count would scale its gradients by the replicas' differing counts, silently). A collective, once."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    both = all_reduce(torch.tensor([num_tokens, -num_tokens], dtype=torch.int64, device=device), None,
                      timeout_s, op="num_tokens check all-reduce", awaited="every rank of",
                      reduce_op=dist.ReduceOp.MAX)
    most, least = int(both[0]), -int(both[1])
    if most != least:
        raise ValueError(f"num_tokens must be the whole global batch's count of real targets, the same on every "
                         f"rank, got counts from {least} to {most} (this rank {num_tokens}). Sum each rank's "
                         "count over the data-parallel replicas (dist.all_reduce), or leave num_tokens out: the "
                         "engine counts them")


def count_tokens(targets: torch.Tensor, ranks: RankMesh, device: torch.device, timeout_s: float) -> torch.Tensor:
    """The real targets of the global batch (at least 1: a batch with none has loss 0, not one process's NaN):
    this rank's, summed over dp before any forward. A tensor where the targets are, read by the loss without
    a device sync."""
    n = (targets != IGNORE_INDEX).sum().reshape(1).to(device)
    if ranks.dp_group is not None and ranks.mesh.dp > 1:
        all_reduce(n, ranks.dp_group, timeout_s, op="token count all-reduce", awaited="the data-parallel group of")
    return n.clamp_min(1).reshape(())
