"""What each unit of a model costs: its forward and backward, timed in this process or counted in FLOPs.

    costs = measure_units(model, blocks, seq_len=64)                     # 3 real steps, one process (or:)
    costs = flop_units(model, blocks, seq_len=1024, flops_per_s=0.4 * 989e12)   # on paper, a meta model

A model is cut into units ``[before the blocks, *blocks, after them]`` (the units the pipeline cuts into stages
and the memory estimate counts); each unit costs ``fixed + per_sample * b / tp`` seconds forward and backward for
a micro-batch of b samples. :func:`measure_units` times them at the unit boundaries at two batch sizes on one
thread (as each rank of a multi-rank run on a CPU), with the zero-bubble runtime's own split backward (B and W)
and an AdamW step; :func:`flop_units` counts them on the model (backward twice forward). The simulator
(:mod:`fourfold.plan.predict`) builds every layout's step from them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

__all__ = ["W_SHARE", "UnitCosts", "fastest", "flop_units", "measure_units"]

W_SHARE = 0.5
"""The weight-gradient part of a split backward: a linear layer's backward is two matmuls the size of its
forward, one for the input's gradient (B) and one for the weight's (W)."""


SplitFit = tuple[tuple[float, float], tuple[float, float], tuple[float, float]]
"""The fused backward's, B's and W's (fixed s, s per sample)."""


def split_fit(rows: Any) -> SplitFit:
    """Three (fixed, per sample) pairs (a list read back from JSON, say) as a :data:`SplitFit`."""
    fused, b, w = ((float(fixed), float(per)) for fixed, per in rows)
    return fused, b, w


@dataclass(frozen=True)
class UnitCosts:
    """Per unit ``[before, *blocks, after]``: (fixed s, s per sample) forward and backward; the optimiser's
    seconds per parameter element; where the figures came from."""

    forward: tuple[tuple[float, float], ...]
    backward: tuple[tuple[float, float], ...]
    optimizer_s_per_element: float
    source: str
    split: tuple[float, float] = (1 - W_SHARE, W_SHARE)
    """A split backward's B and W, each over the fused backward (zero-bubble schedules), at the larger sample count
    timed: measured on the blocks by :func:`measure_units`, else a linear layer's half and half."""
    split_fit: SplitFit | None = None
    """The blocks' fused backward, B and W: (fixed s, s per sample) each, when timed at two sample counts. The
    split's own overhead is per call, so B + W over fused shrinks as micro-batches grow (1.40-1.44 at one sample of
    TinyGPT 4 x 128, 1.12-1.13 at eight): :meth:`split_at` reads the shares off it at the micro-batch's size."""

    def time(self, op: str, unit: int, samples: float, tp: int = 1) -> float:
        fixed, per = (self.forward if op == "F" else self.backward)[unit]
        return fixed + per * samples / tp

    def split_at(self, samples: float, tp: int = 1) -> tuple[float, float]:
        """A split backward's B and W over the fused one for micro-batches of ``samples`` (split ``tp`` ways)."""
        if self.split_fit is None:
            return self.split
        fused, b, w = (fixed + per * samples / tp for fixed, per in self.split_fit)
        return (b / fused, w / fused) if fused > 0 else self.split

    def scaled(self, factor: float, why: str) -> UnitCosts:
        """Every time ``factor`` times longer; ``why`` joins the source."""
        return UnitCosts(tuple((a * factor, b * factor) for a, b in self.forward),
                         tuple((a * factor, b * factor) for a, b in self.backward),
                         self.optimizer_s_per_element * factor, f"{self.source}; x{factor:.2f} {why}", self.split,
                         self.split_fit)  # shares: the factor cancels


def fastest(timings: Sequence[UnitCosts], samples: float) -> UnitCosts:
    """Of several timings of the same units, the one whose forward and backward at ``samples`` add up to least:
    the machine at its best, as the runs it is set beside are each the fastest of several (a shared machine's
    noise only ever adds time). Its source says how many it was chosen from."""
    if not timings:
        raise ValueError("fastest needs at least one timing of the units.")

    def step(c: UnitCosts) -> float:
        return sum(c.time("F", u, samples) + c.time("B", u, samples) for u in range(len(c.forward)))

    best = min(timings, key=step)
    if len(timings) == 1:
        return best
    slowest = max(step(c) for c in timings) / step(best)
    return replace(best, source=f"{best.source}; the fastest of {len(timings)} timings (the slowest {slowest:.2f}x)")


def _fit(at: Mapping[int, list[float]]) -> tuple[float, float]:
    """(fixed, per sample) through the medians at the smallest and largest batch, both >= 0, and always through
    the largest batch's (the one :attr:`UnitCosts.split` is read at): on a busy machine the larger batch can
    time more than proportionally slower, and a fixed part clamped at 0 must not move that point."""
    (b1, t1), (b2, t2) = sorted((b, statistics.median(ts)) for b, ts in at.items())[::len(at) - 1]
    per = max(0.0, (t2 - t1) / (b2 - b1))
    if t2 - per * b2 < 0:  # the line would cross 0 above no samples: through the origin and the largest batch
        return 0.0, t2 / b2
    return t2 - per * b2, per


def measure_units(model: nn.Module, blocks: list[nn.Module], seq_len: int, *, samples: tuple[int, int] = (1, 4),
                  steps: int = 3, loss_fn: Any = None, threads: int = 1) -> UnitCosts:
    """Time each unit's forward and backward on ``model`` (its device; CPU here) with ``steps`` real steps at
    each batch size in ``samples`` (the first of all is a warm-up), on ``threads`` threads, and an AdamW step."""
    from fourfold.loss import lm_loss
    from fourfold.parallel.pipeline.blocks import output_tensor

    n = len(blocks) + 2
    stamps: dict[str, float] = {}
    handles = []
    for i, block in enumerate(blocks, start=1):
        def into(module: nn.Module, args: Any, i: int = i) -> None:
            stamps[f"F{i}"] = time.perf_counter()
            first = next((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), None)
            if first is not None:
                first.register_hook(lambda g, i=i: stamps.__setitem__(f"B{i}", time.perf_counter()))

        def out_of(module: nn.Module, args: Any, out: Any, i: int = i) -> None:
            stamps[f"F{i + 1}"] = time.perf_counter()
            tensor = output_tensor(out)
            if i == len(blocks) and tensor.requires_grad:
                tensor.register_hook(lambda g: stamps.__setitem__(f"B{n - 1}", time.perf_counter()))

        handles += [block.register_forward_pre_hook(into), block.register_forward_hook(out_of)]
    device = next(model.parameters()).device
    fwd: list[dict[int, list[float]]] = [{} for _ in range(n)]
    bwd: list[dict[int, list[float]]] = [{} for _ in range(n)]
    was_threads, was_training = torch.get_num_threads(), model.training
    torch.set_num_threads(threads)
    model.train()
    try:
        for b, record in ((samples[-1], False), *((b, True) for b in samples for _ in range(steps))):
            x = torch.zeros(b, seq_len, dtype=torch.long, device=device)
            stamps.clear()
            t0 = time.perf_counter()
            loss = (loss_fn or lm_loss)(output_tensor(model(x)), x)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            if not record:
                continue  # the first pass warms up
            f_at, b_at = [t0], [t1]  # a boundary without a stamp (no gradient there) gives its time to the next
            for i in range(1, n):
                f_at.append(stamps.get(f"F{i}", f_at[-1]))
            for i in range(n - 1, 0, -1):
                b_at.append(stamps.get(f"B{i}", b_at[-1]))
            f_at.append(t1)
            b_at.append(t2)
            for u in range(n):
                fwd[u].setdefault(b, []).append(f_at[u + 1] - f_at[u])
                bwd[n - 1 - u].setdefault(b, []).append(b_at[u + 1] - b_at[u])
        timed = {b: _split_times(model, blocks, torch.zeros(b, seq_len, dtype=torch.long, device=device),
                                 loss_fn or lm_loss, steps) for b in dict.fromkeys(samples)}
        fits = split_fit(_fit({b: [t[k]] for b, t in timed.items()}) for k in range(3)) if len(timed) > 1 else None
        fused, b_s, w_s = timed[samples[-1]]
        split = (b_s / fused, w_s / fused)
        opt = torch.optim.AdamW(model.parameters(), lr=0.0)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.step()
        opt_s = (time.perf_counter() - t0) / steps
    finally:
        torch.set_num_threads(was_threads)
        model.train(was_training)
        model.zero_grad(set_to_none=True)
        for h in handles:
            h.remove()
    elements = sum(p.numel() for p in model.parameters())
    return UnitCosts(tuple(_fit(t) for t in fwd), tuple(_fit(t) for t in bwd), opt_s / elements,
                     f"measured: {steps} steps at {samples[0]} and {samples[1]} samples, {threads} thread(s), "
                     f"{device.type}; split backward B {split[0]:.2f} + W {split[1]:.2f} of fused at {samples[-1]}",
                     split, fits)


def _split_times(model: nn.Module, blocks: list[nn.Module], x: torch.Tensor, loss_fn: Any,
                 steps: int) -> tuple[float, float, float]:
    """The blocks' fused backward, and the zero-bubble runtime's B and W over them (its own
    :func:`activation_grads` and :func:`weight_grads`) on the same graph, seconds: medians of ``steps`` after a
    warm-up. Per-call autograd overhead makes B + W more than the fused backward on small layers."""
    from fourfold.parallel.pipeline.backward import Call, activation_grads, weight_grads
    from fourfold.parallel.pipeline.blocks import output_tensor

    owners = [m for blk in blocks for m in blk.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    params = [p for m in owners for p in m.parameters(recurse=False) if p.requires_grad]
    fused, b, w = [], [], []
    calls: list[Call] = []
    edge: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, args, out: calls.append(Call(mod, args, out))) for m in owners]
    hooks.append(blocks[0].register_forward_pre_hook(
        lambda mod, args: edge.setdefault("in", next(a for a in args if isinstance(a, torch.Tensor)))))
    hooks.append(blocks[-1].register_forward_hook(lambda mod, args, out: edge.setdefault("out", output_tensor(out))))
    try:
        for _ in range(steps + 1):
            calls.clear()
            edge.clear()
            loss = loss_fn(output_tensor(model(x)), x)
            into: list[torch.Tensor] = [edge["in"]] if edge["in"].requires_grad else []
            grad, = torch.autograd.grad(loss, [edge["out"]], retain_graph=True)
            t0 = time.perf_counter()
            torch.autograd.backward(edge["out"], grad, inputs=[*into, *params], retain_graph=True)
            t1 = time.perf_counter()
            grads = activation_grads(edge["out"], grad, into + [c.output for c in calls])
            t2 = time.perf_counter()
            weight_grads(calls, list(grads[len(into):]))
            t3 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            fused.append(t1 - t0)
            b.append(t2 - t1)
            w.append(t3 - t2)
    finally:
        for h in hooks:
            h.remove()
    return statistics.median(fused[1:]), statistics.median(b[1:]), statistics.median(w[1:])


def flop_units(model: nn.Module, blocks: list[nn.Module], seq_len: int, flops_per_s: float,
               loss_fn: Any = None) -> UnitCosts:
    """Each unit's time from its FLOPs (``torch.utils.flop_counter``, one sample's forward; works on a ``meta``
    model, so on sizes this machine cannot hold) at ``flops_per_s`` (the device's peak times the fraction of
    it a step reaches); backward twice forward; no fixed cost; the optimiser's memory traffic left out."""
    from torch.utils.flop_counter import FlopCounterMode

    from fourfold.loss import lm_loss
    from fourfold.models.hf import meta_kwargs
    from fourfold.parallel.pipeline.blocks import output_tensor

    if not flops_per_s > 0:
        raise ValueError(f"flops_per_s must be > 0, got {flops_per_s}.")
    n = len(blocks) + 2
    counter = FlopCounterMode(display=False)
    at = [0] * (n + 1)

    def mark(i: int) -> Any:
        return lambda *args: at.__setitem__(i, counter.get_total_flops())

    handles = [h for i, block in enumerate(blocks, start=1)
               for h in (block.register_forward_pre_hook(mark(i)), block.register_forward_hook(mark(i + 1)))]
    x = torch.zeros(1, seq_len, dtype=torch.long, device=next(model.parameters()).device)
    try:
        with torch.no_grad(), counter:
            (loss_fn or lm_loss)(output_tensor(model(x, **meta_kwargs(model, x))), x)
            at[n] = counter.get_total_flops()
    finally:
        for h in handles:
            h.remove()
    per = [(at[u + 1] - at[u]) / flops_per_s for u in range(n)]
    return UnitCosts(tuple((0.0, p) for p in per), tuple((0.0, 2 * p) for p in per), 0.0,
                     f"FLOPs at {flops_per_s / 1e12:.4g} TFLOP/s")
