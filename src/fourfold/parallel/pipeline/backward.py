"""The split backward of zero-bubble schedules: B computes activation gradients, W the weight gradients.

B runs ``autograd.grad`` w.r.t. the stage input and the output of every call of a module that owns parameters
(recorded by forward hooks as :class:`Call`), keeping the graph; W then runs
``autograd.backward(call output, its gradient, inputs=the module's parameters)`` per call: only the
weight-gradient work B skipped. That is exact when every use of a parameter lies inside one call of its module,
which :func:`weight_grads_are_local` checks on the autograd graph of each stage's first forward; otherwise W
walks the stage again towards its parameters.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["Call", "activation_grads", "param_edges", "weight_grads", "weight_grads_are_local"]


class Call(NamedTuple):
    """One call of a module that owns parameters, recorded in F: what W needs to compute its weight gradient."""

    module: nn.Module
    inputs: tuple[Any, ...]
    output: torch.Tensor


def param_edges(root: Any, stops: set[Any]) -> Counter[int]:
    """Edges into each parameter's gradient accumulator reachable from ``root``, not walking past ``stops``."""
    edges: Counter[int] = Counter()
    todo, seen = [root], {root}
    while todo:
        node = todo.pop()
        for nxt, _ in node.next_functions if node is not None else ():
            if nxt is None:
                continue
            if hasattr(nxt, "variable"):
                edges[id(nxt.variable)] += 1
            elif nxt not in seen and nxt not in stops:
                seen.add(nxt)
                todo.append(nxt)
    return edges


def weight_grads_are_local(out: torch.Tensor, calls: list[Call], params: list[nn.Parameter]) -> bool:
    """Whether W may run per module call: every use of every parameter lies inside one call of its owner.

    Then a call's weight gradient needs only its output gradient (kept by B) and its own graph, and summing
    over calls is the whole gradient. Not so when a module runs twice, a parameter is shared, or one is used
    outside its module (a functional F.linear(x, other.weight)): those stages walk the stage again in W.
    """
    owners = [c.module for c in calls]
    if len({id(m) for m in owners}) != len(owners):
        return False
    owned = [p for m in owners for p in m.parameters(recurse=False) if p.requires_grad]
    if len({id(p) for p in owned}) != len(owned) or {id(p) for p in owned} != {id(p) for p in params}:
        return False
    uses = param_edges(out.grad_fn, set())
    for call in calls:
        stops = {t.grad_fn for t in call.inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        local = param_edges(call.output.grad_fn, stops)
        if any(local[id(p)] != uses[id(p)] for p in call.module.parameters(recurse=False) if p.requires_grad):
            return False
    return True


def activation_grads(output: torch.Tensor, grad: torch.Tensor | None, roots: list[torch.Tensor]) -> tuple[Any, ...]:
    """B: the gradients of ``roots`` (the stage input, then every call's output) only; the graph stays for W."""
    return torch.autograd.grad(output, roots, grad, retain_graph=True, allow_unused=True) if roots else ()


def weight_grads(calls: list[Call], grads: list[torch.Tensor | None]) -> None:
    """W when :func:`weight_grads_are_local`: each module's weight gradient from its own output gradient (kept by
    B), accumulated into ``.grad``: the matmuls B skipped."""
    for call, g in zip(calls, grads, strict=True):
        params = [p for p in call.module.parameters(recurse=False) if p.requires_grad]
        if g is not None and params:
            torch.autograd.backward(call.output, g, inputs=params, retain_graph=True)
