"""``fourfold bench dp``: fourfold's DataParallel against PyTorch's DistributedDataParallel and against no
gradient sync at all, on the same model, the same batch and the same ranks, side by side.

    fourfold bench dp --nproc 2                  # TinyGPT (3.3 M) and a 4 x 2048^2 MLP, 7 variants, ~1 min
    fourfold bench dp --models gpt --variants none,ddp,native,ring,tree,auto --rounds 40
    python benchmarks/data_parallel.py --nproc 2                 # the same code

Variants (``--variants``; ``NAME@MB`` gives that variant its own bucket size, otherwise ``--bucket-mb``):

* ``none``: every rank trains on its own shard and never syncs gradients, the lower bound on a step;
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=MB)``, the reference;
* any fourfold algorithm (``native``, ``ring``, ``tree``, ``auto``, ...): the engine users train with,
  ``fourfold.parallelize(model, Mesh(dp=G), Layout(allreduce=NAME, bucket_mb=MB))`` stepped by ``engine.step(x, y)``
  (its :class:`~fourfold.parallel.data.DataParallel` buckets the gradients);
* ``NAME+COMPRESS`` (``ring+int8``, ``native+powersgd``, ``ring+bf16``): the same with gradient compression
  (``Layout(compress=COMPRESS)``, :mod:`fourfold.comm.compress`); lossy, so left out of the gradient check.

Method. Every variant holds its own copy of the model (one seed, so every copy starts equal) and its own SGD
optimizer. Round k draws one global batch (each rank takes its shard) and runs one training step (forward,
backward with the gradient sync inside, optimizer) of every variant, the order rotating each round. The
``--warmup`` rounds come first and are not timed; in the first one the averaged gradients of every variant
are compared with DDP's (a float32 tolerance). A barrier precedes every timed step; a step takes as long as
its slowest rank; the figure is the median over ``--rounds``. The hidden fraction of a fourfold variant comes
from its :class:`~fourfold.observe.trace.Tracer` spans (forward and backward as compute, each bucket's all-reduce as
comm, the wait in ``finish`` as wait) through :func:`fourfold.observe.trace.hidden_fraction`: the median over steps
and ranks. The engine calls ``finish`` once backward has returned, so a fourfold variant's backward leaves its
last wait out (DDP's holds it), and it starts the step's 8-byte loss all-reduce there, waited for (as a
training loop logging the loss does) after the optimizer; the ``ddp`` variant does the same (the work is
equal: both report the global batch's mean loss), ``none`` reduces nothing. Rank 0 prints the table and the project's targets and
writes OUT/bench.json and OUT/bench.png.

A benchmark, not a test: it prints figures and refuses nothing but bad flags and gradients that disagree.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from fourfold.bench.harness import (  # the harness imports torch lazily too
    GRAD_RTOL,
    add_output_flags,
    add_round_flags,
    check_rounds,
    fmt_time,
    format_bytes,
    name_list,
    paired_ratio,
    run_or_launch,
    run_record,
    save_png,
    start_rank,
    timed_rounds,
    write_report,
)
from fourfold.bench.workloads import GPT_SIZES, Workload, add_size_flags, gpt, mlp

__all__ = ["TARGETS", "main", "parse_variant"]

DEFAULT_VARIANTS = "none,ddp,native,ring,ddp@4,native@4,ring@4"
TARGETS = (("gpt", "native", 1.05), ("gpt", "ring", 1.20))
"""(model, fourfold variant, limit on its median step time / DDP's at the same bucket size), at G=2."""
_COLUMNS = ("forward", "backward", "optimizer", "comm", "wait", "hidden")  # per (round, rank), from the spans
_SIZES = (*GPT_SIZES, ("gpt-batch", 8, "global batch in sequences"), ("mlp-width", 2048, "MLP layer width"),
          ("mlp-layers", 4, "MLP Linear(width, width) layers"), ("mlp-batch", 64, "MLP global batch in rows"))


class Variant(NamedTuple):
    """One way to synchronise gradients: ``kind`` is ``none``, ``ddp`` or a fourfold algorithm."""

    name: str
    kind: str
    bucket_mb: float | None  # None for ``none``


def parse_variant(text: str, bucket_mb: float) -> Variant:
    """``"ring"`` -> Variant("ring", "ring", bucket_mb); ``"ring@4"`` -> Variant("ring@4", "ring", 4.0)."""
    from fourfold.comm import ALGORITHMS
    from fourfold.comm.compress import COMPRESSIONS

    kind, _, mb = text.strip().partition("@")
    algorithm, plus, compress = kind.partition("+")
    if algorithm not in ("none", "ddp", *ALGORITHMS) or (plus and (algorithm in ("none", "ddp")
                                                                  or compress not in COMPRESSIONS[1:])):
        raise ValueError(f"variants must be none, ddp or a fourfold algorithm ({', '.join(ALGORITHMS)}), the "
                         f"last optionally +{'/+'.join(COMPRESSIONS[1:])}, and @MB, got {text!r}. E.g. --variants "
                         "none,ddp,native,ring@4,ring+int8.")
    if kind == "none":
        if mb:
            raise ValueError(f"variant none has no buckets, got {text!r}. Pass none.")
        return Variant("none", "none", None)
    try:
        size = float(mb) if mb else bucket_mb
    except ValueError:
        size = -1.0
    if not size > 0:
        raise ValueError(f"a variant's bucket size must be a number of MB > 0, got {text!r}. E.g. ring@4.")
    return Variant(f"{kind}@{size:g}" if mb else kind, kind, size)


def _parser() -> argparse.ArgumentParser:
    from fourfold.run.args import make_parser

    p = make_parser("fourfold bench dp", "Time a training step of fourfold's DataParallel, PyTorch's "
                    "DistributedDataParallel and no gradient sync side by side on --nproc ranks.")
    add_round_flags(p, nproc="data-parallel replicas", rounds=20, warmup=3, checks="the gradients")
    p.add_argument("--models", default="gpt,mlp", help="gpt and/or mlp (default: gpt,mlp)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="none, ddp, fourfold algorithms, NAME@MB for "
                   f"a bucket size of its own (default: {DEFAULT_VARIANTS})")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size in MiB for ddp and fourfold "
                   "(default: 25, DDP's default)")
    add_size_flags(p, _SIZES)
    p.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate (default: 1e-3)")
    add_output_flags(p, "dp")
    return p


def _check(ns: argparse.Namespace) -> argparse.Namespace:
    """Turn the flags into values (``ns.models``: names, ``ns.variants``: Variants) or raise ValueError."""
    ns.models = name_list(ns.models, ("gpt", "mlp"), "models", "gpt")
    if not ns.bucket_mb > 0:
        raise ValueError(f"bucket-mb must be > 0, got {ns.bucket_mb}. 25 is DDP's default.")
    ns.variants = [parse_variant(v, ns.bucket_mb) for v in ns.variants.split(",") if v.strip()]
    names = [v.name for v in ns.variants]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"variants must be distinct and at least one, got {names}.")
    check_rounds(ns, "data parallelism over one rank syncs nothing", "the gradients")
    for flag in ("gpt_batch", "mlp_batch"):
        if getattr(ns, flag) % ns.nproc or getattr(ns, flag) < ns.nproc:
            raise ValueError(f"{flag.replace('_', '-')} must be a positive multiple of nproc (equal shards), got "
                             f"{getattr(ns, flag)} on {ns.nproc} ranks. Pass a multiple of {ns.nproc}.")
    return ns


def main(argv: list[str] | None = None) -> int:
    """``fourfold bench dp ...``: launch the ranks (parent) or run the benchmark (a rank)."""
    return run_or_launch("dp", argv, _parser(), _check, _run)


@dataclass(eq=False)
class _Replica:
    """One variant's model copy, wrapped as the variant wraps it, with its optimizer and tracer."""

    variant: Variant
    params: list[Any]  # what the optimizer steps; after ``run`` their gradients are the averaged ones
    run: Callable[[Any, Any], Any]  # forward and backward of this rank's shard, the gradient sync inside
    optimizer: Any
    tracer: Any
    engine: Any = None  # fourfold variants: the Engine (``engine.dp`` holds the buckets)


def _replica(v: Variant, w: Workload, lr: float, ranks: Any, timeout_s: float) -> _Replica:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from fourfold.engine.layout import Layout
    from fourfold.engine.parallelize import parallelize
    from fourfold.engine.step import Loss
    from fourfold.observe.trace import Tracer

    model, tracer = w.build(), Tracer(ranks.rank)
    if v.kind not in ("none", "ddp") and v.bucket_mb is not None:  # fourfold: the step `fourfold train` runs
        algorithm, _, compress = v.kind.partition("+")
        layout = Layout(allreduce=algorithm, bucket_mb=v.bucket_mb, compress=compress or "none")  # type: ignore[arg-type]
        engine = parallelize(model, ranks.using(tracer=tracer, timeout_s=timeout_s), layout, loss_fn=w.loss)
        params = engine.parameters()
        return _Replica(v, params, engine.step, torch.optim.SGD(params, lr=lr), tracer, engine)
    wrapped = DistributedDataParallel(model, bucket_cap_mb=v.bucket_mb) if v.kind == "ddp" else model

    def run(x: Any, y: Any) -> Any:  # the baselines' own step
        with tracer.span("compute", "forward"):
            loss = w.loss(wrapped(x), y)
        with tracer.span("compute", "backward"):
            loss.backward()  # DDP reduces its buckets in here, as gradients become ready
        if v.kind == "ddp":  # the global mean loss, as the engine gives it: the same work on both sides
            value = loss.detach().to(torch.float64).reshape(1)
            return Loss.all_reduced(value, ranks.mesh.dp, None, timeout_s)  # waited in item()
        return None

    return _Replica(v, list(model.parameters()), run, torch.optim.SGD(model.parameters(), lr=lr), tracer)


def _step(r: _Replica, x: Any, y: Any, it: int, *, grads: dict[str, list[Any]]) -> None:
    """Round ``it``'s training step of ``r``; the first copies the averaged gradients into ``grads`` (the check)."""
    r.tracer.set_step(it)
    loss = r.run(x, y)
    if it == 0:
        grads[r.variant.name] = [p.grad.detach().clone() for p in r.params]
    with r.tracer.span("compute", "optimizer"):
        r.optimizer.step()
        r.optimizer.zero_grad(set_to_none=True)
    if loss is not None:
        loss.item()  # the loss all-reduce started after backward, waited for beside the optimizer


def _span_figures(spans: list[Any]) -> list[float]:
    """forward, backward, optimizer, comm, wait seconds and the hidden fraction (NaN if no comm) of one step.

    comm is the time at least one bucket was in flight (the union of the comm spans: native buckets queue in
    the backend together, so their spans overlap and their sum would count the queueing twice).
    """
    from fourfold.observe.trace import hidden_fraction

    def total(kind: str, name: str | None = None) -> float:
        return sum(s.duration_s for s in spans if s.kind == kind and (name is None or s.name == name))

    in_flight, cursor = 0, -1  # the gradient all-reduces only: the engine's loss all-reduce is not gradient sync
    for b, e in sorted((s.start_ns, s.end_ns) for s in spans if s.kind == "comm" and s.name.startswith("allreduce:")):
        in_flight += max(0, e - max(b, cursor))
        cursor = max(cursor, e)
    hidden = hidden_fraction(spans)
    return [total("compute", "forward"), total("compute", "backward"), total("compute", "optimizer"),
            in_flight / 1e9, total("wait"), math.nan if hidden is None else hidden]


def _run(ns: argparse.Namespace) -> None:
    """One rank: every workload, every variant interleaved; rank 0 reports."""
    from fourfold.comm.wait import barrier
    from fourfold.mesh import Mesh

    ctx, say, started, load_before = start_rank("[bench dp]", ns.timeout)
    g, main_rank = ctx.world_size, ctx.rank == 0
    ranks = Mesh.for_world(g, dp=g).build(ns.timeout)  # every rank in one data-parallel group
    say(f"G={g}, variants {', '.join(v.name for v in ns.variants)}, {ns.warmup} warm-up + {ns.rounds} rounds")
    workloads = []
    for name in ns.models:
        workloads.append(_measure((gpt if name == "gpt" else mlp)(ns, ctx.rank, g), ns, ranks, say))
        if main_rank:
            print(_table(workloads[-1]), flush=True)
    if main_rank:
        _report(ns, g, workloads, time.monotonic() - started, load_before)
    barrier("finish the benchmark")
    ctx.close()


def _measure(w: Workload, ns: argparse.Namespace, ranks: Any, say: Callable[..., None]) -> dict[str, Any]:
    """Build every variant's replica, run the rounds, gather the figures; the workload's result on rank 0."""
    import torch
    import torch.distributed as dist

    from fourfold.comm.wait import barrier

    replicas = [_replica(v, w, ns.lr, ranks, ns.timeout) for v in ns.variants]
    params = sum(p.numel() for p in replicas[0].params)
    say(f"{w.describe}: {params / 1e6:.2f} M parameters, {format_bytes(params * 4)} of float32 gradients")
    barrier("start the timed rounds")
    for r in replicas:
        r.tracer.start()
    grads: dict[str, list[torch.Tensor]] = {}
    timed = timed_rounds([partial(_step, r, grads=grads) for r in replicas], w.shard, ns.warmup, ns.rounds)
    check = _grad_check(replicas, grads)
    steps = range(ns.warmup, ns.warmup + ns.rounds)
    mine = torch.zeros(len(replicas), ns.rounds, len(_COLUMNS), dtype=torch.float64)  # (V, rounds, columns)
    for j, r in enumerate(replicas):
        by_step = defaultdict(list)
        for s in r.tracer.spans:
            by_step[s.step].append(s)
        for k, step_index in enumerate(steps):
            mine[j, k] = torch.tensor(_span_figures(by_step[step_index]), dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(ranks.mesh.world_size)]
    dist.all_gather(everyone, mine)
    stacked = torch.stack(everyone)  # (G, V, rounds, columns)
    rows = [_row(r, t, stacked[:, j]) for j, (r, t) in enumerate(zip(replicas, timed, strict=True))]
    _ratios(rows)
    return {"model": w.name, "describe": w.describe, "parameters": params, "grad_bytes": params * 4,
            "rows": rows, "grad_check": check}


def _grad_check(replicas: list[_Replica], grads: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every synced variant's step-1 gradients against the first DDP variant's, worst over ranks and params;
    raises when one disagrees beyond GRAD_RTOL."""
    import torch
    import torch.distributed as dist

    ref = next((r.variant.name for r in replicas if r.variant.kind == "ddp"), None)
    others = [r.variant.name for r in replicas  # compressed variants are lossy by design: not compared
              if r.variant.kind != "none" and "+" not in r.variant.kind and r.variant.name != ref]
    if ref is None or not others:
        return []
    worst = torch.zeros(len(others), 2, dtype=torch.float64)  # (variants, [max |diff|, max |diff| / max |g|])
    for i, name in enumerate(others):
        for a, b in zip(grads[name], grads[ref], strict=True):
            diff = (a - b).abs().max().item()
            worst[i, 0] = max(worst[i, 0].item(), diff)
            worst[i, 1] = max(worst[i, 1].item(), diff / max(b.abs().max().item(), 1e-30))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    out = [{"variant": n, "reference": ref, "max_abs_diff": worst[i, 0].item(), "max_rel_diff": worst[i, 1].item(),
            "rtol": GRAD_RTOL, "ok": worst[i, 1].item() <= GRAD_RTOL} for i, n in enumerate(others)]
    bad = [c for c in out if not c["ok"]]
    if bad:
        raise RuntimeError(f"gradients must match {ref}'s on step 1 within rtol {GRAD_RTOL:g}, got "
                           + ", ".join(f"{c['variant']}: max |diff| {c['max_abs_diff']:.3g} "
                                       f"({c['max_rel_diff']:.3g} of max |g|)" for c in bad)
                           + ". A bucket reduced twice, not averaged, or a parameter missed.")
    return out


def _row(r: _Replica, timed: dict[str, Any], figures: Any) -> dict[str, Any]:
    """A variant's figures: the step time (slowest rank per round, from ``timed``) and the medians over ranks
    and rounds of ``figures`` (G, rounds, columns)."""
    import torch

    med = {c: torch.nanmedian(figures[:, :, i].reshape(-1)).item() for i, c in enumerate(_COLUMNS)}
    v = r.variant
    return {"variant": v.name, "kind": v.kind, "bucket_mb": v.bucket_mb,
            "buckets": len(r.engine.dp.buckets) if r.engine is not None else None,
            "median_s": timed["median_s"], "min_s": timed["min_s"], "max_s": timed["max_s"],
            "times_s": timed["times_s"], **{f"{c}_s": med[c] for c in _COLUMNS[:-1]},
            "hidden_fraction": None if math.isnan(med["hidden"]) else med["hidden"]}


def _ratios(rows: list[dict[str, Any]]) -> None:
    """x ddp: against DDP at the same bucket size (else the first DDP), the ratio of medians and (paired) the
    median of per-round ratios; x none: against no sync."""
    ddps = [r for r in rows if r["kind"] == "ddp"]
    none = next((r for r in rows if r["kind"] == "none"), None)
    for r in rows:
        ref = next((d for d in ddps if d["bucket_mb"] == r["bucket_mb"]), ddps[0] if ddps else None)
        r["vs_ddp"] = ref["variant"] if ref else None
        r["x_ddp"] = r["median_s"] / ref["median_s"] if ref else None
        r["x_ddp_paired"] = paired_ratio(r["times_s"], ref["times_s"]) if ref else None
        r["x_none"] = r["median_s"] / none["median_s"] if none else None
        r["over_none_s"] = r["median_s"] - none["median_s"] if none else None


def _table(result: dict[str, Any]) -> str:
    def num(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    def bucket(r: dict[str, Any]) -> str:
        return "-" if r["bucket_mb"] is None else f"{r['bucket_mb']:g} MB"

    def fourfold_only(r: dict[str, Any], key: str) -> str:
        return "-" if r["kind"] in ("none", "ddp") else fmt_time(r[key])

    lines = [f"\n{result['describe']}, {result['parameters'] / 1e6:.2f} M parameters",
             f"{'variant':<11} {'bucket':>7} {'#b':>3} {'median':>9} {'min':>9} {'x ddp':>6} {'paired':>6} {'x none':>6} "
             f"{'+ vs none':>9} {'forward':>9} {'backward':>9} {'comm':>9} {'wait':>9} {'hidden':>6}"]
    for r in result["rows"]:
        over = r["over_none_s"]
        lines.append(
            f"{r['variant']:<11} {bucket(r):>7} "
            f"{num(r['buckets'], 'd'):>3} {fmt_time(r['median_s']):>9} {fmt_time(r['min_s']):>9} "
            f"{num(r['x_ddp'], '.3f'):>6} {num(r['x_ddp_paired'], '.3f'):>6} {num(r['x_none'], '.3f'):>6} "
            f"{'-' if over is None else format(over * 1e3, '+.1f') + ' ms':>9} {fmt_time(r['forward_s']):>9} "
            f"{fmt_time(r['backward_s']):>9} {fourfold_only(r, 'comm_s'):>9} {fourfold_only(r, 'wait_s'):>9} "
            f"{num(r['hidden_fraction'], '.2f'):>6}")
    for c in result["grad_check"]:
        lines.append(f"grad check, step 1: {c['variant']} vs {c['reference']}: max |diff| {c['max_abs_diff']:.3g} "
                     f"({c['max_rel_diff']:.3g} of max |g|, rtol {c['rtol']:g}) {'ok' if c['ok'] else 'FAILED'}")
    return "\n".join(lines)


def _report(ns: argparse.Namespace, g: int, workloads: list[dict[str, Any]], elapsed: float,
            load_before: tuple[float, float, float]) -> None:
    """Rank 0: the targets, bench.json and bench.png."""
    verdicts = []
    for model, variant, limit in TARGETS:
        for w in workloads:
            row = next((r for r in w["rows"] if w["model"] == model and r["variant"] == variant), None)
            if row is not None and row["x_ddp"] is not None and g == 2:
                verdicts.append({"target": f"G=2 {model} {variant}: step time <= {limit}x {row['vs_ddp']}",
                                 "value": row["x_ddp"], "limit": limit, "met": row["x_ddp"] <= limit,
                                 "paired": row["x_ddp_paired"], "hidden_fraction": row["hidden_fraction"]})
    print("\ntargets:")
    for t in verdicts:
        miss = "" if t["met"] else f" ({t['value'] / t['limit'] - 1:+.1%} over the limit)"
        hidden = "-" if t["hidden_fraction"] is None else f"{t['hidden_fraction']:.2f}"
        print(f"  {'met   ' if t['met'] else 'MISSED'} {t['target']}: {t['value']:.3f}x{miss}; paired by round "
              f"{t['paired']:.3f}; hidden {hidden}")
    result = {**run_record(ns, g, elapsed, load_before),
              "settings": {"variants": [v._asdict() for v in ns.variants], "bucket_mb": ns.bucket_mb,
                           "rounds": ns.rounds, "warmup": ns.warmup, "optimizer": f"SGD(lr={ns.lr:g})",
                           "dtype": "float32", "timing": "slowest rank per step, median over rounds; other "
                           "columns: median over ranks and rounds"},
              "workloads": workloads, "targets": verdicts}
    write_report(Path(ns.out), result, elapsed, lambda path: _chart(workloads, g, path))


def _chart(workloads: list[dict[str, Any]], g: int, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4 + 3 * len(workloads), 4.5))
    for i, w in enumerate(workloads):
        ax = fig.add_subplot(1, len(workloads), i + 1)
        rows = w["rows"]
        xs = range(len(rows))
        colors = ["0.6" if r["kind"] == "none" else "C1" if r["kind"] == "ddp" else "C0" for r in rows]
        medians = [r["median_s"] * 1e3 for r in rows]
        spread = [[m - r["min_s"] * 1e3 for m, r in zip(medians, rows, strict=True)],
                  [r["max_s"] * 1e3 - m for m, r in zip(medians, rows, strict=True)]]
        ax.bar(xs, medians, color=colors, yerr=spread, capsize=3)
        for x, r in zip(xs, rows, strict=True):
            if r["x_ddp"] is not None and r["kind"] != "ddp":
                ax.annotate(f"{r['x_ddp']:.2f}x", (x, r["max_s"] * 1e3), ha="center", va="bottom", fontsize=8,
                            xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(list(xs), [r["variant"] for r in rows], rotation=30, fontsize=8)
        ax.set(ylabel="median step time (ms; bars: min..max)", title=f"{w['model']}: {w['parameters'] / 1e6:.2f} M "
               f"params, G={g}")
        ax.title.set_fontsize(9)
    fig.suptitle("data parallel step, gloo on CPU: grey none, orange DDP, blue fourfold (label: x DDP)", fontsize=9)
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    sys.exit(main())
