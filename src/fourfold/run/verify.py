"""``fourfold train ... --verify K``: the promise "same numbers as one device", made checkable by the user.

During the run every rank gathers the whole model after each of the first K steps (:meth:`Engine.state_dict`,
a collective over tp and pp). After the run, rank 0 builds the same model (same config, same seed) and trains
it for K steps in this one process, through the same engine with no parallelism, on the same global batches
(the loader with one data-parallel rank hands out the whole batch every dp rank had a share of). It prints,
per step, the loss of both runs and the largest parameter difference, with the parameter where it occurs::

    verify: the first 2 steps again on one process (float64; tolerance 1e-10 for losses and parameters)
      step    loss (layout)  loss (1 process)  |loss diff|  max |param diff|  diff/update  at
         1    5.490512345       5.490512345      1.8e-15           2.1e-14      4.0e-13  blocks.1.mlp.fc.weight
    verify: OK, every difference within tolerance

Tolerances. float64: 1e-10 for losses and every parameter element (what the tests hold every layout to); a
family whose norms compute in float32 whatever the dtype (Gemma) is judged as float32.
float32: the layout sums in another order, so results differ by rounding: a loss within 1e-5 * max(1, |loss|),
and the parameters within 1e-3 of the update: ``|w - w_ref| / |w_ref - w_0|`` over the whole model (2-norms;
the diff/update column). No elementwise bound both holds and can fail: Adam divides each update by the
gradient's own scale, so a weight whose exact gradient is zero (rounding noise in both runs) moves by a whole
lr either way, and lr is all Adam ever moves a weight in a step. A gradient that is wrong (a shard missed, a
micro-batch's gradient lost) moves whole tensors the wrong way. Measured on TinyGPT 4 x 128 for 3 steps: 1e-5
to 4e-5 (dp2, tp2, ZeRO-3, interleaved pp2, tp2 pp2 ZB-H1). Mixed precision (``--precision bf16``, the
reference too): bf16 keeps 8 bits of mantissa, and tensor parallelism rounds partial sums to bf16 before
adding them: a loss within 1e-2 * max(1, |loss|), parameters within 0.25 of the update (measured 0.015-0.02 at
dp2, 0.04-0.06 at tp2). Lossy gradient compression (``--compress``): each step's gradient is near the exact one
by design, not equal (the reference runs uncompressed; int8 measured 0.07-0.12, PowerSGD's low-rank update
more), so losses are judged as bf16's and the parameters shown, not judged.

Dropout: one process draws other masks than the layout's ranks, so a correct layout differs by the masks. A run of
several ranks with ``--verify`` and any dropout (a ``nn.Dropout`` with p > 0, or a Hugging Face config's
``attention_dropout``, ``resid_pdrop``, ...) is refused before launch (:mod:`fourfold.run.preflight`).

What no check of Adam's parameters can see: a gradient scaled by a constant (a sum taken twice, a mean
divided twice). Adam's update does not depend on the gradient's scale, except through its eps; float64's
1e-10 sees that, float32's rounding hides it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fourfold.config import Config

__all__ = ["KINDS", "Tolerance", "VerifyRow", "compare", "reference_run", "report", "tolerances", "verify"]


@dataclass(frozen=True)
class VerifyRow:
    step: int
    loss: float            # the layout's
    reference_loss: float  # one process's
    param_diff: float
    worst: str             # the parameter with the largest difference
    loss_tol: float
    param_tol: float       # exact: of param_diff; otherwise of relative
    relative: float = 0.0  # |w - w_ref| / |w_ref - w_0| over the whole model: the difference against the update
    exact: bool = True     # float64: every element within param_tol; else the relative difference

    @property
    def loss_diff(self) -> float:
        return abs(self.loss - self.reference_loss)

    @property
    def ok(self) -> bool:
        return self.loss_diff <= self.loss_tol and (self.param_diff if self.exact else self.relative) <= self.param_tol


@dataclass(frozen=True)
class Tolerance:
    """How a run of one kind is judged: its loss within ``loss`` * max(1, |loss|) (float64: absolute), its
    parameters within ``params``: every element (``exact``), else diff/update; inf: shown, not judged."""

    loss: float
    params: float
    exact: bool
    why: str

    def text(self) -> str:
        if self.exact:
            return f"{_num(self.loss)} for losses and parameters"
        params = "parameters shown, not judged" if math.isinf(self.params) else f"diff/update {_num(self.params)}"
        return f"losses {_num(self.loss)} * max(1, |loss|), {params} ({self.why})"


def _num(x: float) -> str:
    """1e-3, not 0.001; 0.25 as it is."""
    mantissa, exponent = f"{x:e}".split("e")
    return f"1e{int(exponent)}" if float(mantissa) == 1 else f"{x:g}"


KINDS = {
    "float64": Tolerance(1e-10, 1e-10, True, "exact"),
    "float32": Tolerance(1e-5, 1e-3, False, "float32 rounding"),
    "bf16": Tolerance(1e-2, 0.25, False, "bf16 mixed precision"),
    "compressed": Tolerance(1e-2, math.inf, False, "lossy by design"),
}
"""What a run is judged as (see the module docstring for why each)."""


def tolerances(kind: str, loss: float) -> tuple[float, float]:
    """(loss tolerance, parameter tolerance) for a run of ``kind`` (:data:`KINDS`) whose reference loss is
    ``loss``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}.")
    t = KINDS[kind]
    return (t.loss if t.exact else t.loss * max(1.0, abs(loss))), t.params


def reference_run(cfg: Config, steps: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Train ``cfg``'s model for ``steps`` steps on this one process: losses, and the state before the first
    step and after each (``steps + 1`` states)."""
    from pathlib import Path

    from fourfold.engine.layout import Layout
    from fourfold.engine.parallelize import parallelize
    from fourfold.models.build import build_model
    from fourfold.run.data import make_loader
    from fourfold.run.optim import make_optimizer, update

    engine = parallelize(build_model(cfg), None, Layout(precision=cfg.parallel.precision))  # one process, no strategy
    optimizer = make_optimizer(cfg, engine.parameters())
    loader, _ = make_loader(cfg, Path(cfg.output.out))  # the run's data and tokenizer, one dp rank
    losses, states = [], [engine.state_dict()]
    for step in range(1, steps + 1):
        args, kwargs = loader.batch(step - 1).step_args("cpu")  # the whole global batch
        loss = engine.step(*args, **kwargs)
        update(engine, optimizer, cfg, step)  # the run's clipping and learning rate, as its ranks did
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        states.append(engine.state_dict())
    return losses, states


def compare(losses: list[float], states: list[dict[str, torch.Tensor]], ref_losses: list[float],
            ref_states: list[dict[str, torch.Tensor]], kind: str) -> list[VerifyRow]:
    """One row per step: the layout's loss and state against the reference's (``ref_states``: the initial
    state, then one per step), judged by ``kind``'s :func:`tolerances`."""
    rows = []
    initial = ref_states[0]
    for i, (loss, state, ref_loss, ref_state) in enumerate(zip(losses, states, ref_losses, ref_states[1:],
                                                              strict=True)):
        if sorted(state) != sorted(ref_state):
            missing, extra = sorted(set(ref_state) - set(state)), sorted(set(state) - set(ref_state))
            raise RuntimeError(f"verify: the layout's state must have the model's parameter names, got missing "
                               f"{missing[:5]} and extra {extra[:5]}. This is a fourfold bug: please report it.")
        worst, diff, off, moved = "", 0.0, 0.0, 0.0
        for name, want in ref_state.items():
            got = state[name]
            if got.shape != want.shape:
                worst, diff, off = name, float("inf"), float("inf")
                break
            delta = _difference(got, want)
            d = delta.abs().max().item() if want.numel() else 0.0
            off += delta.square().sum().item()
            moved += _difference(want, initial[name]).square().sum().item()
            if not d <= diff or not worst:  # a NaN where the reference has none is the worst there is
                worst, diff = name, d
            if math.isnan(d):
                break
        relative = (off / moved) ** 0.5 if moved > 0 else (0.0 if off == 0 else float("inf"))
        loss_tol, param_tol = tolerances(kind, ref_loss)
        rows.append(VerifyRow(i + 1, loss, ref_loss, diff, worst, loss_tol, param_tol, relative, KINDS[kind].exact))
    return rows


def _difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a - b`` in float64, 0 where the two are equal: infinities (a causal mask's -inf) and NaNs in the same
    places; a NaN or an infinity on one side only stays one."""
    a, b = a.double(), b.double()
    same = (a == b) | (a.isnan() & b.isnan())
    return torch.where(same, 0.0, a - b)


def report(rows: list[VerifyRow], kind: str, what: str | None = None) -> str:
    """The table the user reads, and the verdict (``what``: the run's numerics, default ``kind``)."""
    lines = [f"verify: the first {len(rows)} step(s) again on one process ({what or kind}; tolerance "
             f"{KINDS[kind].text()})",
             f"  {'step':>4}  {'loss (layout)':>15}  {'loss (1 process)':>16}  {'|loss diff|':>11}  "
             f"{'max |param diff|':>16}  {'diff/update':>11}  at"]
    for r in rows:
        mark = "" if r.ok else "   <-- beyond tolerance"
        lines.append(f"  {r.step:>4}  {r.loss:>15.9f}  {r.reference_loss:>16.9f}  {r.loss_diff:>11.1e}  "
                     f"{r.param_diff:>16.1e}  {r.relative:>11.1e}  {r.worst}{mark}")
    if not KINDS[kind].exact:
        lines.append("  diff/update: |w - w_ref| / |w_ref - w_0| over the whole model: how much of the update "
                     "differs. Elementwise, Adam moves a weight whose gradient is rounding noise by a whole lr.")
    bad = [r.step for r in rows if not r.ok]
    lines.append("verify: OK, every difference within tolerance" if not bad else
                 f"verify: MISMATCH at step(s) {bad}: this layout did not compute what one process computes")
    return "\n".join(lines)


def judged_as(cfg: Config) -> tuple[str, str | None]:
    """(the tolerance kind a run is judged by, the lossy compression its gradients crossed the wire in, if any):
    ``--reduce-dtype bfloat16`` is ``--compress bf16`` by another name. A float64 model whose family computes
    its norms in float32 whatever the dtype (Gemma: :data:`fourfold.models.hf.FLOAT32_NORMS`) is judged as
    float32: a layout that cuts the batch adds their float32 gradients in another order."""
    from fourfold.models.hf import FLOAT32_NORMS

    t, p = cfg.train, cfg.parallel
    narrow = {"bfloat16": "bf16", "float16": "fp16"}  # gradients reduced in fewer bits than they are kept in
    lossy = p.compress if p.compress != "none" else narrow.get(p.reduce_dtype)
    dtype = "float32" if t.dtype == "float64" and t.model in FLOAT32_NORMS else t.dtype
    return ("compressed" if lossy else "bf16" if p.precision == "bf16" else dtype), lossy


def verify(cfg: Config, losses: list[float], states: list[dict[str, Any]]) -> tuple[bool, str]:
    """Re-run ``len(states)`` steps on one process and compare: (all within tolerance, the report)."""
    ref_losses, ref_states = reference_run(cfg, len(states))
    t, p = cfg.train, cfg.parallel
    kind, lossy = judged_as(cfg)
    rows = compare(losses[:len(states)], states, ref_losses, ref_states, kind)
    what = None
    if lossy:
        what = (f"{'bf16' if p.precision == 'bf16' else t.dtype}, gradients compressed with {lossy}, the reference "
                "uncompressed")
    elif t.dtype == "float64" and kind == "float32":  # judged_as: a family with float32 norms
        what = f"float64, {t.model}'s norms in float32"
    return all(r.ok for r in rows), report(rows, kind, what)
