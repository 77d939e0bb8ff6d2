"""The optimiser and its step: AdamW, the learning rate of each step, and clipping by the global gradient norm.

:func:`update` is the one optimiser step every loop takes (``fourfold train``'s and ``--verify``'s one-process
re-run), so a layout and its reference clip and schedule alike. The learning rate is a function of the step
alone (:func:`lr_at`): a resumed run continues the same schedule with nothing else to restore.

    --lr 3e-3 --warmup-steps 100 --lr-decay cosine --min-lr 3e-4 --max-grad-norm 1.0
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from fourfold.config import Config
    from fourfold.engine.step import Engine

__all__ = ["NonFiniteLoss", "keep_flags", "learning_rate", "lr_at", "make_optimizer", "update"]


class NonFiniteLoss(RuntimeError):
    """The global loss (or, when clipping, the gradients' norm) became NaN or infinite: the run stops at that
    step with exit code 1."""


def make_optimizer(cfg: Config, params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr_at(cfg, 1), **_flags(cfg))


def _flags(cfg: Config) -> dict[str, Any]:
    """The optimiser's hyperparameters that flags set (the learning rate aside: :func:`update` sets it each step)."""
    return {"weight_decay": cfg.optim.weight_decay}


def keep_flags(optimizer: torch.optim.Optimizer, cfg: Config) -> None:
    """After a checkpoint's optimiser is loaded (its param groups' values, as torch's ``load_state_dict`` puts
    them back), this run's flags win: a resume with ``--weight-decay 0`` trains without it, as its note says."""
    for group in optimizer.param_groups:
        group.update(_flags(cfg))


def lr_at(cfg: Config, step: int) -> float:
    """The learning rate of optimiser step ``step`` (1-based) under ``cfg``'s flags (:func:`learning_rate`)."""
    o = cfg.optim
    return learning_rate(step, lr=o.lr, steps=cfg.train.steps, warmup_steps=o.warmup_steps, decay=o.lr_decay,
                         min_lr=o.min_lr)


def learning_rate(step: int, *, lr: float, steps: int, warmup_steps: int = 0,
                  decay: Literal["none", "linear", "cosine"] = "none", min_lr: float = 0.0) -> float:
    """The learning rate of optimiser step ``step`` (1-based) of ``steps``.

    Warm-up: ``lr * step / warmup_steps`` for the first ``warmup_steps`` steps. Then ``decay``: ``none`` keeps
    ``lr``; ``linear`` and ``cosine`` go from ``lr`` to ``min_lr``, reached at the last step.
    """
    if decay not in ("none", "linear", "cosine") or warmup_steps < 0 or steps < 1:
        raise ValueError(f"decay must be none, linear or cosine, warmup_steps >= 0 and steps >= 1, got decay="
                         f"{decay!r}, warmup_steps={warmup_steps}, steps={steps}.")
    if step <= warmup_steps:
        return lr * step / warmup_steps
    if decay == "none":
        return lr
    span = steps - warmup_steps
    done = 1.0 if span <= 0 else (step - warmup_steps) / span
    done = min(max(done, 0.0), 1.0)
    left = 1.0 - done if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
    return min_lr + (lr - min_lr) * left


def update(engine: Engine, optimizer: torch.optim.Optimizer, cfg: Config, step: int) -> float | None:
    """Optimiser step ``step`` after ``engine.step``: clip the gradients by their global norm (with
    ``--max-grad-norm``), set the step's learning rate, step. The norm before clipping (None without
    clipping). The caller zeroes the gradients."""
    o = cfg.optim
    norm = engine.clip_grad_norm_(o.max_grad_norm) if o.max_grad_norm else None
    if norm is not None and not math.isfinite(norm):  # every rank has the same norm: all stop here together
        warm = " or add --warmup-steps" if not o.warmup_steps else ""
        raise NonFiniteLoss(f"step {step}: the gradients' norm is {norm}; training stopped before the optimiser "
                            "step, so the weights and checkpoints are those of the step before. Lower --lr (now "
                            f"{o.lr:g}){warm}, or resume from an earlier checkpoint with --resume.")
    lr = lr_at(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    with engine.tracer.span("compute", "optimizer"):
        optimizer.step()
    return norm
