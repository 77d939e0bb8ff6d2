"""What :func:`fourfold.parallelize` checks on a model before it cuts it, where a wrong model would train
silently: that every tp and pp rank built the same one (each keeps its part of its own), that a model
checkpointing its own layers does not redraw dropout masks under tp, and that without a vocabulary-parallel
head the tp ranks' logits are whole. And what the engine checks on its first batch: that a replica's tp and pp
ranks step on the same rows.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fourfold.comm.wait import gather_objects
from fourfold.engine.batch import leaves
from fourfold.mesh import RankMesh
from fourfold.parallel.pipeline.blocks import EvalMode, output_tensor

__all__ = ["check_own_checkpointing", "check_same_function", "check_same_model", "check_same_rows", "check_whole_logits",
           "logits_on"]


def check_own_checkpointing(model: nn.Module) -> None:
    """A model checkpointing its own layers (Hugging Face's ``activation_checkpointing_enable()``) recomputes them
    with torch's generator restored but not the rank's dropout streams, so under tp its recompute would draw
    other masks inside the regions than its forward did: wrong gradients, silently. Refused where it has dropout
    (fourfold's own checkpointing re-enters the streams)."""
    from fourfold.models import dropout_sites

    own = [name or type(model).__name__ for name, m in model.named_modules()
           if getattr(m, "gradient_checkpointing", False) is True]
    sites = dropout_sites(model) if own else []
    if sites:
        raise ValueError(f"tensor parallelism draws dropout per tp rank inside its regions, and a checkpoint of "
                         f"the model's own ({own[0]}.gradient_checkpointing) would recompute them with other masks, "
                         f"got dropout at {', '.join(sites[:3])}. Call model.activation_checkpointing_disable() "
                         "(or gradient_checkpointing_disable(), its older name) and "
                         "pass activation_checkpointing='full' (fourfold train: --activation-checkpointing full), "
                         "or set the dropout to 0.")


def check_same_model(model: nn.Module, group: dist.ProcessGroup, axis: str) -> None:
    """Tensor and pipeline parallelism cut each rank's own model and keep its part, so the ranks must have built
    the same one; a model initialised from torch's global generator without a seed (or seeded by rank) would
    train a mixture of several, silently. Its parameters' names, shapes and two sums are compared over
    ``group`` (data parallelism broadcasts rank 0's weights instead, so it needs no check)."""
    params = list(model.named_parameters())
    meta = any(p.is_meta for _, p in params)  # nothing to compare: decided by every rank together, below
    sums = [] if meta else [_sums(p) for _, p in params]
    mine = ([(n, tuple(p.shape)) for n, p in params], sums, meta)
    everyone = gather_objects(mine, group, op=f"compare the model built on each {axis} rank")
    if any(m for _, _, m in everyone):
        return
    def close(x: tuple[float, float], y: tuple[float, float]) -> bool:
        return all(abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b)) for a, b in zip(x, y, strict=True))

    for r, (layout, theirs, _) in enumerate(everyone):
        if layout != mine[0]:
            raise ValueError(f"rank {dist.get_rank()}: the {axis} ranks built different models: their parameters' "
                             f"names or shapes differ from {axis} rank {r}'s. Build the same model, from the same "
                             "config, on every rank.")
        name = next((n for (n, _), x, y in zip(params, theirs, sums, strict=True) if not close(x, y)), None)
        if name is not None:
            raise ValueError(
                f"rank {dist.get_rank()}: the {axis} ranks built different models ({name} differs on {axis} rank "
                f"{r}), and {'tensor' if axis == 'tp' else 'pipeline'} parallelism keeps each rank's part of its "
                "own. Build the model the same way on every rank: seed first (torch.manual_seed(0) before building "
                "it), or load the same weights.")


@torch.no_grad()
def _sums(p: torch.Tensor, chunk: int = 1 << 20) -> tuple[float, float]:
    """The sum of ``p``'s elements and of their squares, in float64, a million elements at a time: no
    temporary the size of ``p`` (a model's parameters may be untouched pages that should stay so:
    :func:`fourfold.models.weights.zero_pages`)."""
    total = squares = 0.0
    for part in p.detach().reshape(-1).split(chunk):
        wide = part.double()
        total += float(wide.sum())
        squares += float(torch.dot(wide, wide))
    return total, squares


def check_whole_logits(model: nn.Module, example: torch.Tensor | None, ranks: RankMesh) -> None:
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


def logits_on(model: nn.Module, example: torch.Tensor) -> tuple[torch.Tensor, dict[str, tuple[Any, ...]]]:
    """``model(example)``'s logits (its output tensor), in eval mode (no dropout), without gradients; and each
    module's output as (shape, sum, weighted sum), in the order they finished (a few numbers each, whatever the
    model's size)."""
    seen: dict[str, tuple[Any, ...]] = {}

    def record(name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor) and out.is_floating_point() and name not in seen:
                seen[name] = _output_sums(out)
        return hook

    handles = [m.register_forward_hook(record(name)) for name, m in model.named_modules() if name]
    try:
        with torch.no_grad(), EvalMode(model):
            logits = output_tensor(model(example)).detach().clone()
    finally:
        for handle in handles:
            handle.remove()
    return logits, seen


def _output_sums(t: torch.Tensor) -> tuple[Any, ...]:
    wide = t.detach().double().flatten()
    weights = torch.arange(1, wide.numel() + 1, dtype=torch.float64, device=wide.device) / max(1, wide.numel())
    largest = float(wide.abs().max()) if wide.numel() else 0.0
    return tuple(t.shape), float(wide.sum()), float((wide * weights).sum()), largest


def check_same_function(model: nn.Module, example: torch.Tensor, whole: tuple[torch.Tensor, dict[str, Any]],
                        ranks: RankMesh) -> None:
    """Refuse a tensor plan of the user's that changes what the model computes: the sharded model's logits on
    ``example`` must be the unsharded model's (``whole``, from :func:`logits_on`) to its dtype's rounding (float64
    1e-9, else 1e-4, relative to the largest logit), and the refusal names the first module (in the order they
    finish) whose output kept its shape but not its values. A column split is exact only where the forward works
    on the split sizes: an attention that views q by a head count of its own (OPT's ``num_heads``, not the
    weight's rows) computes other heads after it, and trained without a word before. Compared over tp, so every
    rank refuses alike."""
    want, modules = whole
    got, sharded = logits_on(model, example)
    scale = max(1.0, float(want.abs().max()))
    diff = float((got.double() - want.double()).abs().max()) / scale if got.shape == want.shape else float("inf")
    tol = 1e-9 if want.dtype == torch.float64 else 1e-4
    first = next((name for name, sums in modules.items() if name in sharded and sharded[name][0] == sums[0]
                  and _differ(sharded[name], sums, tol)), None)
    everyone = gather_objects((diff, first), ranks.tp_group, op="compare the sharded model with the whole one")
    worst = max(d for d, _ in everyone)
    if worst > tol:
        shapes = "" if got.shape == want.shape else f" (shape {tuple(got.shape)}, the whole model's {tuple(want.shape)})"
        where = next((f"; the first module whose output differs: {name!r}" for _, name in everyone if name), "")
        raise ValueError(
            f"the tensor plan changes what the model computes: on one example its sharded logits differ from the "
            f"whole model's by {worst:.3g} relative to the largest{shapes}, over tp={ranks.mesh.tp}{where}. A column "
            "or row split is exact only where the forward works on the split sizes: an attention that reshapes q, "
            "k and v by a head count of its own (OPT's num_heads) sees other heads once they are split. Leave those "
            "layers out of the plan, or make the forward read the head count from the weights' shape.")


def _differ(a: tuple[Any, ...], b: tuple[Any, ...], tol: float) -> bool:
    scale = max(1.0, b[3]) * max(1, math.prod(b[0]))
    return any(abs(x - y) > tol * scale for x, y in zip(a[1:3], b[1:3], strict=True))


def _digest(batch: Any) -> tuple[Any, ...] | None:
    """Shapes, dtypes and a hash of every tensor of ``batch`` (a tensor, or a dict / list / tuple of them)."""
    if batch is None:
        return None
    shapes, hashed = [], hashlib.sha256()
    for path, t in leaves(batch):
        shapes.append(f"{path}{tuple(t.shape)}" if path else tuple(t.shape))
        hashed.update(str(t.dtype).encode())
        hashed.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return tuple(shapes), hashed.hexdigest()


def check_same_rows(inputs: Any, targets: Any, ranks: RankMesh) -> None:
    """Refuse, on every rank alike, a replica whose tp, cp or pp ranks were given different batches (collectives
    over those groups; the engine runs it on its first step). Each replica's ranks must step on the same rows:
    sharding by global rank, DDP's habit, gives them different ones, and the layout then trains on a mix that no
    one process computes. A rank passing None (a pipeline stage that reads no inputs) is not compared."""
    mine = (_digest(inputs), _digest(targets))
    for axis, group in (("tp", ranks.tp_group), ("cp", ranks.cp_group), ("pp", ranks.pp_group)):
        if group is None:
            continue
        everyone = gather_objects(mine, group, op=f"compare the {axis} ranks' batches")
        members = dist.get_process_group_ranks(group)
        for i, what in enumerate(("inputs", "targets")):
            held = [(r, d[i]) for r, d in zip(members, everyone, strict=True) if d[i] is not None]
            other = next(((r, d) for r, d in held[1:] if d != held[0][1]), None)
            if other is not None:
                (first, a), (r, b) = held[0], other
                shapes = f" (shapes {list(a[0])} and {list(b[0])})" if a[0] != b[0] else ""
                raise ValueError(
                    f"every tp, cp and pp rank of a data-parallel replica must step on the same rows (cp ranks cut "
                    f"the sequences themselves), got other {what} "
                    f"on rank {r} than on rank {first}{shapes} ({axis} group of ranks {members}). Shard the batch by "
                    "the replica, ranks.coord.dp of ranks.mesh.dp, not by the global rank (DistributedSampler's "
                    "habit under DDP): one process computes none of what the layout would train on.")
