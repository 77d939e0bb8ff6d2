"""Which optimisers are exact on the pieces a layout gives them, and the refusal of the others.

Under ZeRO the optimiser holds flat segments that cross parameters, and under tensor parallelism slices of them.
An optimiser that computes each element from that element's own history (SGD, Adam, AdamW, ...) does on a piece
what it does on the whole. One whose step reads a whole matrix does not: Adafactor's factored moments are a row
and a column mean of the matrix, Muon orthogonalises it, L-BFGS takes dot products over every parameter. On a
piece they compute something else than on one device, and trained on without a word. The engine marks the
parameters it gives as pieces (:func:`mark`); a hook on every optimiser step (torch's
``register_optimizer_step_pre_hook``) refuses, at its first step, an optimiser not known to be elementwise that
holds one. ``optimizer.fourfold_elementwise = True`` vouches for one of yours.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["ELEMENTWISE", "mark"]

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD)
"""torch's optimisers whose update of an element reads only that element (its gradient, its state)."""

_hook: Any = None
_checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def mark(parameters: Iterable[nn.Parameter], what: str) -> None:
    """Mark ``parameters`` as pieces (``what``: "ZeRO-2 segments", ...) for the step hook's check."""
    global _hook
    for p in parameters:
        p.fourfold_piece = what  # type: ignore[attr-defined]
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_check)


def _check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _checked:
        return
    if not isinstance(optimizer, ELEMENTWISE) and not getattr(optimizer, "fourfold_elementwise", False):
        for group in optimizer.param_groups:
            for p in group["params"]:
                what = getattr(p, "fourfold_piece", None)
                if what is not None:
                    raise ValueError(
                        f"{type(optimizer).__name__} steps on {what}, and it is not known to compute each element "
                        "on its own: an optimiser whose step reads a whole matrix (Adafactor's factored moments, "
                        "Muon, L-BFGS) computes something else on a piece than on one device. Use one of "
                        f"{', '.join(t.__name__ for t in ELEMENTWISE)}; or train without ZeRO and tensor "
                        "parallelism (dp and pp hand it whole parameters); or, if it is elementwise, set "
                        "optimizer.fourfold_elementwise = True")
    _checked.add(optimizer)
