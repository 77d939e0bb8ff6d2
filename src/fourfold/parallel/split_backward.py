"""Which half of a split backward is running (zero-bubble's B, the activation gradients, or W, the weight
gradients), for autograd functions whose backward communicates.

W runs backward again from each layer's output towards its parameters. Where that path crosses a collective's
backward (a sequence-parallel row layer's reduce-scatter, whose backward all-gathers the output gradient), W would
run the collective a second time on the gradient B already gathered. Such a function computes its backward
through :func:`kept_for_weights`: in B it keeps its result on its autograd node, in W it hands that back (once)
instead of communicating. Outside a split backward nothing is kept. Every rank of a tensor-parallel group runs
the same graph in the same halves, so all of them skip the same collectives.

    with phase("B") as kept:        # pipeline runtime, B
        grads = torch.autograd.grad(out, roots, grad, retain_graph=True)
    held_bytes += kept.bytes        # kept until W
    with phase("W"):
        torch.autograd.backward(call_output, call_grad, inputs=params)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["Kept", "kept_for_weights", "phase"]


@dataclass
class Kept:
    """What B kept for W: ``bytes`` of gradients."""

    bytes: int = 0


# Module-level, not a context variable: on a GPU autograd runs backward functions on the device's own thread
_current: tuple[Literal["B", "W"], Kept] | None = None


@contextlib.contextmanager
def phase(half: Literal["B", "W"]) -> Iterator[Kept]:
    """Run a split backward's ``half`` inside; yields what B keeps for W."""
    global _current
    was, _current = _current, (half, Kept())
    try:
        yield _current[1]
    finally:
        _current = was


def kept_for_weights(ctx: Any, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``compute()`` (a collective on the gradient), or in W the result this node computed in B."""
    kept = getattr(ctx, "kept_for_weights", None)
    if _current is not None and _current[0] == "W" and kept is not None:
        ctx.kept_for_weights = None  # handed back once
        return kept
    out = compute()
    if _current is not None and _current[0] == "B":
        ctx.kept_for_weights = out
        _current[1].bytes += out.nbytes
    return out
