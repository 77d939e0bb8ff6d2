"""Cut a model given as a list of blocks into ``stages`` contiguous stages, for pipeline and model parallelism.

::

    from fourfold.parallel.pipeline.split import split_model

    model = TinyGPT(GPTConfig(n_layer=4))                               # from fourfold.models
    stages = split_model(model, 2)                                      # balanced by parameter count
    [s.names for s in stages]        # [('embed', 'blocks.0', 'blocks.1'), ('blocks.2', 'blocks.3', 'head')]
    split_model(model, 2, boundaries=["blocks.2"])                      # cut where the user says
    split_model(model, 2, balance="time", example=idx)                  # balanced by measured forward time

The blocks are TinyGPT's ``layers()`` (``[embed, *blocks, head]``), an ``nn.Sequential``'s children, or any
list of modules, each mapping one tensor to one tensor. Stage ``k`` holds blocks ``[b_k, b_{k+1})``; the first
holds the embedding, the last the head (the runtime adds the loss there). Balancing picks the boundaries that
minimise the largest stage cost (exact, by dynamic programming over the O(n^2 * stages) cut positions).

Tied weights. A parameter used by blocks of two stages (TinyGPT's head weight is ``embed.wte.weight``) would
live on two ranks: each later stage gets its own copy (a new ``nn.Parameter`` with the same value), and
:func:`sum_tied_grads` (called by the runtime after backward) gives every copy the sum of all copies'
gradients, added in stage order, so the copies stay bitwise equal and equal the single-process weight. The
modules are taken over, not copied: the model you pass is untied afterwards; build a fresh one per use.

Shapes. When an example input is known (always for TinyGPT; ``example=`` otherwise) the blocks are run once
on it and once on a variant, and each stage records the :class:`TensorSpec` its input and output must have:
dims that changed between the runs (the batch, and for TinyGPT the length) are free (``None``). The runtime
checks every message against them. A model whose blocks do not compose is refused here, naming the blocks.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import Literal, NamedTuple

import torch
from torch import nn

__all__ = ["Balance", "Stage", "TensorSpec", "named_blocks", "partition", "plan", "split_model", "sum_tied_grads"]

Balance = Literal["params", "time"]


class TensorSpec(NamedTuple):
    """The shape (``None`` = any size) and dtype a tensor crossing a stage boundary must have."""

    shape: tuple[int | None, ...]
    dtype: torch.dtype

    def matches(self, shape: Sequence[int], dtype: torch.dtype) -> bool:
        return dtype == self.dtype and len(shape) == len(self.shape) and all(
            want is None or want == got for want, got in zip(self.shape, shape, strict=True))

    def __str__(self) -> str:
        dims = ", ".join("*" if d is None else str(d) for d in self.shape)
        return f"({dims}{',' if len(self.shape) == 1 else ''}) {str(self.dtype).removeprefix('torch.')}"


class Stage(nn.Module):
    """Stage ``index`` of ``stages``: the contiguous blocks ``names`` of the model, applied in order.

    ``tied`` maps a local parameter name to ``(tie, holders)``: the model's tied weight number ``tie`` and the
    stages holding a copy of it. ``in_spec``/``out_spec`` are what its input/output must look like (None when
    no example was traced).
    """

    def __init__(self, index: int, stages: int, blocks: Sequence[tuple[str, nn.Module]], *,
                 in_spec: TensorSpec | None = None, out_spec: TensorSpec | None = None,
                 tied: dict[str, tuple[int, tuple[int, ...]]] | None = None) -> None:
        super().__init__()
        if not 0 <= index < stages:
            raise ValueError(f"stage index must be in [0, {stages}), got index={index}.")
        if not blocks:
            raise ValueError(f"a stage must hold at least one block, got none for stage {index}.")
        self.index, self.stages = index, stages
        self.names = tuple(name for name, _ in blocks)
        self.blocks = nn.ModuleList(module for _, module in blocks)
        self.in_spec, self.out_spec = in_spec, out_spec
        self.tied = dict(tied or {})

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.stages - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def model_name(self, key: str) -> str:
        """A local state-dict key (``blocks.1.ln1.weight``) -> the model's (``blocks.3.ln1.weight``)."""
        _, position, rest = key.split(".", 2)
        if getattr(self.blocks[int(position)], "model_names", False):  # a Piece: its keys are the model's
            return rest
        return f"{self.names[int(position)]}.{rest}" if self.names[int(position)] else rest

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's state under the model's own names (a tied copy under the name it has here)."""
        return {self.model_name(k): v for k, v in self.state_dict().items()}

    def extra_repr(self) -> str:
        return f"index={self.index}, stages={self.stages}, blocks={list(self.names)}"


def named_blocks(model: nn.Module | Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    named = getattr(model, "named_blocks", None)
    if isinstance(model, nn.Module) and callable(named):  # a Chain of pieces (fourfold.Split)
        return list(named())
    layers = getattr(model, "layers", None)
    if isinstance(model, nn.Module) and callable(layers) and not isinstance(layers, nn.Module):  # TinyGPT's method
        where = {id(m): name for name, m in model.named_modules()}
        return [(where.get(id(m), str(i)), m) for i, m in enumerate(layers())]
    if isinstance(model, nn.Sequential):  # every position, a module applied at several (shared weights) each time
        return [(n, m) for n, m in model.named_modules(remove_duplicate=False) if n and "." not in n]
    if isinstance(model, Sequence) and all(isinstance(m, nn.Module) for m in model):
        return [(str(i), m) for i, m in enumerate(model)]
    held = (f" (its layers is a {type(layers).__name__} of blocks: Split(blocks='layers', ...) names them)"
            if isinstance(layers, nn.ModuleList | nn.ModuleDict) else "")
    raise TypeError(f"model must be a module with layers() (TinyGPT), an nn.Sequential or a list of modules, "
                    f"got {type(model).__name__}{held}. Wrap its blocks in nn.Sequential(...), or describe its split: "
                    "parallelize(..., split=fourfold.Split(...)), or from fourfold train --model MODULE:FACTORY, "
                    "model.fourfold_split = Split(...) (docs/your-model.md, 'The split, drawn').")


def partition(costs: Sequence[float], stages: int) -> tuple[int, ...]:
    """Start index of each of ``stages`` contiguous, non-empty parts of ``costs`` minimising the largest sum.

    ``best[k][j]``: the smallest possible largest part when the first j costs form k parts. Ties go to the
    earliest cut, so equal costs split as evenly as the count allows.
    """
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"stages must be between 1 and the number of blocks, got stages={stages} for {n} "
                         f"blocks. Pass stages<={n}, or a model with more blocks.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):  # the k-th part is costs[i:j]
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    starts, j = [], n
    for k in range(stages, 0, -1):
        j = cut[k][j]
        starts.append(j)
    return tuple(reversed(starts))


def _sync(device: torch.device) -> None:
    """Wait for an accelerator's queued work (any kind: CUDA, XPU, ...); nothing to wait for on the CPU."""
    if device.type != "cpu":
        torch.get_device_module(device).synchronize(device)


def _time_costs(blocks: list[nn.Module], example: torch.Tensor, repeats: int = 3) -> list[float]:
    """Median forward time of each block on the activation the blocks before it produce from ``example``."""
    times: list[list[float]] = [[] for _ in blocks]
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first pass warms up allocators and kernels
            x = example
            for i, block in enumerate(blocks):
                _sync(x.device)  # time the work, not its launch
                start = time.perf_counter()
                x = block(x)
                _sync(x.device)
                times[i].append(time.perf_counter() - start)
    return [sorted(t[1:])[len(t[1:]) // 2] for t in times]


def _boundaries(named: list[tuple[str, nn.Module]], stages: int, boundaries: Sequence[int | str]) -> tuple[int, ...]:
    names = [n for n, _ in named]
    starts = [0]
    for b in boundaries:
        if isinstance(b, str):
            if b not in names:
                raise ValueError(f"boundary must name a block, got {b!r}; the blocks are {names}.")
            b = names.index(b)
        starts.append(b)
    if len(starts) != stages:
        raise ValueError(f"boundaries must give stages-1 = {stages - 1} cut positions (where stages 1.. start), "
                         f"got {len(boundaries)}: {list(boundaries)}.")
    if any(not 0 < b < len(names) for b in starts[1:]) or any(a >= b for a, b in zip(starts, starts[1:], strict=False)):
        raise ValueError(f"boundaries must be strictly increasing block indices in 1..{len(names) - 1}, got "
                         f"{list(boundaries)}; the blocks are {names}.")
    return tuple(starts)


def _trace(named: list[tuple[str, nn.Module]], examples: list[torch.Tensor]) -> list[TensorSpec]:
    """The spec of each block's input and of the last block's output (n+1 specs) from runs on ``examples``."""
    runs: list[list[torch.Tensor]] = []
    with torch.no_grad():
        for x in examples:
            seen = [x]
            for i, (name, block) in enumerate(named):
                try:
                    x = block(x)
                except Exception as e:
                    after = f"the output of block {i - 1} ({named[i - 1][0]})" if i else "the example input"
                    raise ValueError(f"the blocks do not compose: block {i} ({name}) fails on {after}, shape "
                                     f"{tuple(seen[-1].shape)} {seen[-1].dtype}: {e}. Check the blocks' sizes."
                                     ) from e
                if not isinstance(x, torch.Tensor):
                    raise TypeError(f"every block must return one tensor, got {type(x).__name__} from block "
                                    f"{i} ({name}). Wrap it so it maps one tensor to one tensor.")
                seen.append(x)
            runs.append(seen)
    specs = []
    for at in zip(*runs, strict=True):
        shape = tuple(d if all(t.dim() == at[0].dim() and t.shape[k] == d for t in at) else None
                      for k, d in enumerate(at[0].shape))
        specs.append(TensorSpec(shape, at[0].dtype))
    return specs


def _examples(model: nn.Module | Sequence[nn.Module], named: list[tuple[str, nn.Module]],
              example: torch.Tensor | None) -> list[torch.Tensor] | None:
    """Two inputs that differ in every dim the model lets vary: ``example`` and a batch of two of it, or the
    model's own ``example_inputs()``."""
    if example is not None:
        return [example, torch.cat([example, example])]
    examples = getattr(model, "example_inputs", None)
    if callable(examples):  # the model says which inputs show its free dims (TinyGPT: batch and length)
        return list(examples())
    return None


def plan(model: nn.Module | Sequence[nn.Module], stages: int, *, balance: Balance = "params",
         boundaries: Sequence[int | str] | None = None, example: torch.Tensor | None = None) -> tuple[int, ...]:
    """The first block index of each stage, as :func:`split_model` would cut; changes nothing.

    ``boundaries``: where stages 1..stages-1 start, as block indices or names (``"blocks.2"``); otherwise
    ``balance="params"`` (parameter count, a tied weight counted in each stage that holds it) or ``"time"``
    (forward time measured on ``example``; a TinyGPT defaults to one sequence of ``seq_len`` zeros).
    """
    named = named_blocks(model)
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ValueError(f"stages must be a positive integer, got stages={stages!r}.")
    if stages > len(named):
        raise ValueError(f"stages must be at most the number of blocks, got stages={stages} for {len(named)} "
                         f"blocks ({', '.join(n for n, _ in named)}). Pass fewer stages (pp * virtual <= "
                         f"{len(named)}) or a model with more blocks.")
    if boundaries is not None:
        return _boundaries(named, stages, boundaries)
    if balance == "params":
        return partition([sum(p.numel() for p in m.parameters()) for _, m in named], stages)
    if balance == "time":
        examples = _examples(model, named, example)
        if examples is None:
            raise ValueError("balance='time' needs an example input to time the blocks on, got example=None. "
                             "Pass example=<one micro-batch>.")
        return partition(_time_costs([m for _, m in named], examples[0]), stages)
    raise ValueError(f"balance must be 'params' or 'time', got {balance!r}.")


def split_model(model: nn.Module | Sequence[nn.Module], stages: int, *, balance: Balance = "params",
                boundaries: Sequence[int | str] | None = None, example: torch.Tensor | None = None,
                held: Collection[int] | None = None) -> list[Stage]:
    """``stages`` contiguous :class:`Stage` s covering every block of ``model`` in order, cut by :func:`plan`.
    ``held``: the stages the caller keeps (default all); only those get their own copy of a tied weight (a
    stage dropped unused keeps the shared one, so no rank copies a tensor it will not hold)."""
    starts = plan(model, stages, balance=balance, boundaries=boundaries, example=example)
    named = named_blocks(model)
    examples = _examples(model, named, example)
    specs = _trace(named, examples) if examples is not None else None
    ends = (*starts[1:], len(named))
    parts = [named[a:b] for a, b in zip(starts, ends, strict=True)]
    _one_stage_per_module(parts, range(stages) if held is None else held)
    tied = _untie(parts, range(stages) if held is None else held)
    return [Stage(k, stages, part, in_spec=specs[a] if specs else None, out_spec=specs[b] if specs else None,
                  tied=tied[k]) for k, (part, a, b) in enumerate(zip(parts, starts, ends, strict=True))]


def _one_stage_per_module(parts: list[list[tuple[str, nn.Module]]], held: Collection[int]) -> None:
    """Refuse a module with parameters of its own (a block applied at several positions: shared weights) in two
    stages one process holds: each stage after the first needs its own copy of the weights (their gradients
    summed as a tied weight's), and one module object cannot be both."""
    first: dict[int, tuple[int, str]] = {}
    for k in sorted(held):
        for name, block in parts[k]:
            for m in block.modules():
                if next(m.parameters(recurse=False), None) is None:
                    continue
                j, where = first.setdefault(id(m), (k, name))
                if j != k:
                    raise ValueError(
                        f"a module applied at several positions must be in one stage of each rank's, got block "
                        f"{name} of stage {k} holding the same {type(m).__name__} as block {where} of stage {j}, "
                        f"both held here (stages {sorted(held)}). Pass virtual=1 (without interleaving each rank "
                        "holds one stage, and the copies' gradients are summed as a tied weight's), or boundaries "
                        "that keep its uses within stages of different ranks.")


def _untie(parts: list[list[tuple[str, nn.Module]]],
           held: Collection[int]) -> list[dict[str, tuple[int, tuple[int, ...]]]]:
    """Give each later stage of ``held`` its own copy of a parameter several stages share; say who holds
    copies."""
    holders: dict[int, list[tuple[int, str]]] = {}  # id(parameter) -> [(stage, local name)], first use each
    for k, part in enumerate(parts):
        probe = Stage(k, len(parts), part)  # only for the local names
        for name, p in probe.named_parameters(remove_duplicate=False):
            if all(stage != k for stage, _ in holders.get(id(p), [])):
                holders.setdefault(id(p), []).append((k, name))
    out: list[dict[str, tuple[int, tuple[int, ...]]]] = [{} for _ in parts]
    shared = [h for h in holders.values() if len(h) > 1]
    for tie, group in enumerate(shared):
        stages = tuple(k for k, _ in group)
        for k, name in group:
            out[k][name] = (tie, stages)
            if k != stages[0] and k in held:
                _replace_parameter(parts[k], name)
    return out


def _replace_parameter(part: list[tuple[str, nn.Module]], local: str) -> None:
    """Point every use of the parameter ``local`` (``blocks.<i>.<path>``) within ``part`` at one fresh copy."""
    _, position, path = local.split(".", 2)
    owner_path, _, attr = path.rpartition(".")
    root = part[int(position)][1]
    old = getattr(root.get_submodule(owner_path) if owner_path else root, attr)
    copy = nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
    for _, block in part:
        for module in block.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if p is old:
                    setattr(module, name, copy)


@torch.no_grad()
def sum_tied_grads(stages: Sequence[Stage], remote: dict[tuple[int, int], torch.Tensor | None] | None = None) -> None:
    """Set every tied copy's gradient to the sum of all copies' gradients, added in stage order.

    ``stages``: the stages this process holds; ``remote[(tie, stage)]``: the gradient of a copy held elsewhere
    (the pipeline runtime exchanges them). A copy without a gradient counts as zero. Every holder adds the
    same terms in the same order, so the copies stay bitwise equal.
    """
    grads: dict[tuple[int, int], torch.Tensor | None] = dict(remote or {})
    copies: list[tuple[int, tuple[int, ...], nn.Parameter]] = []
    for stage in stages:
        named = dict(stage.named_parameters())
        for name, (tie, holders) in stage.tied.items():
            grads[(tie, stage.index)] = named[name].grad
            copies.append((tie, holders, named[name]))
    totals = []
    for tie, holders, p in copies:
        missing = [j for j in holders if (tie, j) not in grads]
        if missing:
            raise RuntimeError(f"tied weight {tie} is held by stages {list(holders)}, but the gradients of stages "
                               f"{missing} are missing: pass them in remote[(tie, stage)].")
        total = torch.zeros_like(p)
        for j in holders:
            g = grads[(tie, j)]
            if g is not None:
                total += g.to(p.device)
        totals.append((p, total))
    for p, total in totals:  # every sum first: a copy's gradient may be another's term
        if p.grad is not None:
            p.grad.copy_(total)  # in place: a data-parallel bucket's view stays the one gradient held
        else:
            p.grad = total
