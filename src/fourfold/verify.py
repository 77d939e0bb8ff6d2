"""``fourfold train ... --verify K``: the promise "same numbers as one device", made checkable by the user.

During the run every rank gathers the whole model after each of the first K steps (:meth:`Engine.state_dict`,
a collective over tp and pp). After the run, rank 0 builds the same model (same config, same seed) and trains
it for K steps in this one process, through the same engine with no parallelism, on the same global batches
(the loader with one data-parallel rank hands out the whole batch every dp rank had a share of). It prints,
per step, the loss of both runs and the largest parameter difference, with the parameter where it occurs::

    verify: the first 2 steps again on one process (float64; tolerance 1e-10)
      step   loss (layout)   loss (1 process)   |loss diff|   max |param diff|   at
         1   5.490512345     5.490512345        1.8e-15       2.1e-14            blocks.1.mlp.fc.weight
    verify: OK, every difference within tolerance

Tolerances. float64: 1e-10 for losses and parameters (what the tests hold every layout to). float32: the
layout sums in another order, so results differ by rounding: a loss within 1e-5 * max(1, |loss|); a parameter
within 2 * lr * step + 1e-6, because Adam divides each update by the gradient's own scale, so a gradient
component that is zero in exact arithmetic (rounding noise in both runs) can move its weight by up to lr a step
in either direction. Mixed precision (``--precision bf16``, the reference too): bf16 keeps 8 bits of mantissa,
and tensor parallelism rounds partial sums to bf16 before adding them, so a loss within 1e-2 * max(1, |loss|);
parameters as float32 (the masters are float32). Lossy gradient compression (``--compress``) is judged as bf16:
each step's gradient is near the exact one, not equal (the reference runs uncompressed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fourfold.config import Config

__all__ = ["VerifyRow", "compare", "reference_run", "report", "tolerances", "verify"]


@dataclass(frozen=True)
class VerifyRow:
    step: int
    loss: float            # the layout's
    reference_loss: float  # one process's
    param_diff: float
    worst: str             # the parameter with the largest difference
    loss_tol: float
    param_tol: float

    @property
    def loss_diff(self) -> float:
        return abs(self.loss - self.reference_loss)

    @property
    def ok(self) -> bool:
        return self.loss_diff <= self.loss_tol and self.param_diff <= self.param_tol


def tolerances(dtype: str, lr: float, step: int, loss: float) -> tuple[float, float]:
    """(loss tolerance, parameter tolerance) after ``step`` steps; see the module docstring for why."""
    if dtype == "float64":
        return 1e-10, 1e-10
    if dtype == "bf16":
        return 1e-2 * max(1.0, abs(loss)), 2 * lr * step + 1e-6
    return 1e-5 * max(1.0, abs(loss)), 2 * lr * step + 1e-6


def reference_run(cfg: Config, steps: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Train ``cfg``'s model for ``steps`` steps on this one process: losses and the state after each step."""
    from pathlib import Path

    from fourfold.engine import parallelize
    from fourfold.models.build import build_model
    from fourfold.train import make_loader, make_optimizer

    engine = parallelize(build_model(cfg), None, precision=cfg.train.precision)  # one process, no strategy
    optimizer = make_optimizer(cfg, engine.parameters())
    loader, _ = make_loader(cfg, Path(cfg.train.out))  # the run's data and tokenizer, one dp rank
    losses, states = [], []
    for step in range(1, steps + 1):
        args, kwargs = loader.batch(step - 1).step_args("cpu")  # the whole global batch
        loss = engine.step(*args, **kwargs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        states.append(engine.state_dict())
    return losses, states


def compare(losses: list[float], states: list[dict[str, torch.Tensor]], ref_losses: list[float],
            ref_states: list[dict[str, torch.Tensor]], dtype: str, lr: float) -> list[VerifyRow]:
    """One row per step: the layout's loss and state against the reference's."""
    rows = []
    for i, (loss, state, ref_loss, ref_state) in enumerate(zip(losses, states, ref_losses, ref_states,
                                                              strict=True)):
        if sorted(state) != sorted(ref_state):
            missing, extra = sorted(set(ref_state) - set(state)), sorted(set(state) - set(ref_state))
            raise RuntimeError(f"verify: the layout's state must have the model's parameter names, got missing "
                               f"{missing[:5]} and extra {extra[:5]}. This is a fourfold bug: please report it.")
        worst, diff = "", 0.0
        for name, want in ref_state.items():
            got = state[name]
            d = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
            if got.shape != want.shape:
                d = float("inf")
            if d > diff or not worst:
                worst, diff = name, d
        loss_tol, param_tol = tolerances(dtype, lr, i + 1, ref_loss)
        rows.append(VerifyRow(i + 1, loss, ref_loss, diff, worst, loss_tol, param_tol))
    return rows


def report(rows: list[VerifyRow], dtype: str, what: str | None = None) -> str:
    """The table the user reads, and the verdict (``what``: the run's numerics, default ``dtype``)."""
    tol = {"float64": "1e-10 for losses and parameters",
           "bf16": "losses 1e-2 * max(1, |loss|), parameters 2 * lr * step + 1e-6 (bf16 mixed precision or compressed gradients)"}.get(
        dtype, "losses 1e-5 * max(1, |loss|), parameters 2 * lr * step + 1e-6 (float32 rounding; see --help)")
    lines = [f"verify: the first {len(rows)} step(s) again on one process ({what or dtype}; tolerance {tol})",
             f"  {'step':>4}  {'loss (layout)':>15}  {'loss (1 process)':>16}  {'|loss diff|':>11}  "
             f"{'max |param diff|':>16}  at"]
    for r in rows:
        mark = "" if r.ok else "   <-- beyond tolerance"
        lines.append(f"  {r.step:>4}  {r.loss:>15.9f}  {r.reference_loss:>16.9f}  {r.loss_diff:>11.1e}  "
                     f"{r.param_diff:>16.1e}  {r.worst}{mark}")
    bad = [r.step for r in rows if not r.ok]
    lines.append("verify: OK, every difference within tolerance" if not bad else
                 f"verify: MISMATCH at step(s) {bad}: this layout did not compute what one process computes")
    return "\n".join(lines)


def verify(cfg: Config, losses: list[float], states: list[dict[str, Any]]) -> tuple[bool, str]:
    """Re-run ``len(states)`` steps on one process and compare: (all within tolerance, the report)."""
    ref_losses, ref_states = reference_run(cfg, len(states))
    t = cfg.train
    dtype = "bf16" if t.precision == "bf16" or t.compress != "none" else t.dtype
    rows = compare(losses[:len(states)], states, ref_losses, ref_states, dtype, t.lr)
    what = (f"{'bf16' if t.precision == 'bf16' else t.dtype}, gradients compressed with {t.compress}, the reference "
            "uncompressed") if t.compress != "none" else None
    return all(r.ok for r in rows), report(rows, dtype, what)
