"""``fourfold bench pp``: fourfold's pipeline runtime against PyTorch's ``torch.distributed.pipelining``, GPipe
and 1F1B, on the same model split, the same batch, the same micro-batches and the same ranks, side by side.

    fourfold bench pp --nproc 2                  # TinyGPT (3.3 M, untied), m = 8, 4 variants, ~2 minutes
    fourfold bench pp --nproc 4 --rounds 10      # pp = 4 (4 ranks: on fewer cores, read the bubble only)
    python benchmarks/pipeline.py --nproc 2      # the same code

``--nproc`` ranks form one pipeline (pp = nproc, one stage per rank). The model is an *untied* TinyGPT
(``GPTConfig(tie_weights=False)``): torch's manual ``PipelineStage`` has no notion of a weight shared by two
stages, so a tied head would make the two frameworks compute different things. The cut is fourfold's
:func:`~fourfold.parallel.pipeline.split.plan` (parameter balance); both frameworks run the very same
:class:`~fourfold.parallel.pipeline.split.Stage` modules, built by :func:`~fourfold.parallel.pipeline.split.split_model` at that
cut. Variants (``--variants``), FRAMEWORK-SCHEDULE:

* ``fourfold-gpipe`` / ``fourfold-1f1b``: the engine users train with, ``parallelize(model, Mesh(pp=p),
  Layout(pp=p, schedule=name, microbatches=m, boundaries=cut))`` stepped by ``engine.step(x, y)`` (inside:
  :func:`~fourfold.parallel.pipeline.build_pipeline` with ``make_schedule(name, pp, m)``); the loss is
  ``lm_loss_sum / N`` on the last stage (N: the batch's targets, counted at the step's start).
* ``torch-gpipe`` / ``torch-1f1b``: ``PipelineStage(stage, rank, pp, cpu)`` driven by ``ScheduleGPipe`` /
  ``Schedule1F1B(stage, m, loss_fn=lm_loss)`` (``scale_grads``: gradients / m), ``return_outputs=False``
  (fourfold keeps no outputs either).

Method (as ``fourfold bench dp``). Every variant holds its own copy of the model (one seed) and its own SGD.
Round k draws one batch, the same on every rank, and runs one training step (pipeline step and optimizer) of
every variant, the order rotating each round; ``--warmup`` rounds first, not timed. In the first, every
variant's loss and gradients (each rank: its stage's) are checked against the first variant's, a float32
tolerance. A barrier precedes every timed step; a step takes as long as its slowest rank; the figure is the
median over ``--rounds``.

The bubble of a fourfold variant comes from its :class:`~fourfold.observe.trace.Tracer` spans, per timed step: the
step's window runs from the first span on any rank to the last compute span on any rank (one clock: the
ranks share a machine and ``perf_counter``); rank r's bubble is 1 - (its F and B time) / window, the
definition of :func:`~fourfold.parallel.timeline.simulate`'s. Beside it: the runtime's own
``StepResult.wait_by_rank`` (time blocked in receives / the rank's own step, which leaves out a rank's idle
tail once its last action is done), the textbook (p-1)/(m+p-1), and ``simulate`` with the measured median F
and B times (mean over ranks) and ``comm`` = the one-way time of one activation message (header + payload,
ping-pong between ranks 0 and 1 before the rounds, both idle), then again with ``comm`` = the mean time a
transfer took *in the run* (from the later of "sender posted it" and "receiver waits for it" to "received",
matched across ranks in the trace): the gap between the two simulations is what message latency under
load costs. Peak activation memory per rank is ``StepResult.peak_activation_bytes_by_rank``.
Rank 0 prints the tables and the project's targets and writes OUT/bench.json, OUT/bench.png and a measured
timeline per fourfold variant (OUT/timeline-SCHEDULE.png, the last timed step).

A benchmark, not a test: it prints figures and refuses nothing but bad flags and results that disagree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

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
    start_rank,
    timed_rounds,
)
from fourfold.bench.pp_report import BUBBLE_POINTS, MEMORY_SLACK, TARGET_RATIO, report, table
from fourfold.bench.workloads import GPT_SIZES, add_size_flags, gpt_config

__all__ = ["BUBBLE_POINTS", "MEMORY_SLACK", "TARGET_RATIO", "VARIANTS", "main"]

VARIANTS = ("fourfold-gpipe", "torch-gpipe", "fourfold-1f1b", "torch-1f1b")
LOSS_RTOL = 1e-5  # float32: |loss - the reference's| <= 1e-5 * |reference|
_SIZES = (*GPT_SIZES, ("gpt-batch", 16, "batch in sequences, every rank the same"),
          ("microbatches", 8, "micro-batches per step, m"))


def _parser() -> argparse.ArgumentParser:
    from fourfold.run.args import make_parser

    p = make_parser("fourfold bench pp", "Time a training step of fourfold's pipeline runtime and PyTorch's "
                    "torch.distributed.pipelining (GPipe and 1F1B) side by side on --nproc ranks (pp); "
                    "measure the bubble and the activation memory.")
    add_round_flags(p, nproc="pp", rounds=20, warmup=3, checks="losses and gradients")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"among {', '.join(VARIANTS)} (default: all)")
    add_size_flags(p, _SIZES)
    p.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate (default: 1e-3)")
    add_output_flags(p, "pp", "bench.json and the PNGs")
    return p


def _check(ns: argparse.Namespace) -> argparse.Namespace:
    """Turn the flags into values (``ns.variants``: names, ``ns.config``: the GPTConfig) or raise ValueError."""
    ns.variants = name_list(ns.variants, VARIANTS, "variants", "fourfold-1f1b,torch-1f1b")
    check_rounds(ns, "a pipeline of one stage has nothing to overlap", "every variant against the first")
    small = {flag: getattr(ns, flag.replace("-", "_")) for flag, _, _ in _SIZES}
    if any(n < 1 for n in small.values()):
        raise ValueError(f"sizes must be >= 1, got {', '.join(f'--{f} {n}' for f, n in small.items() if n < 1)}.")
    if ns.gpt_batch % ns.microbatches:
        fix = ns.microbatches * max(1, ns.gpt_batch // ns.microbatches)
        raise ValueError(f"gpt-batch must split into microbatches={ns.microbatches} equal micro-batches, got "
                         f"gpt-batch {ns.gpt_batch}. Pass --gpt-batch {fix}.")
    if ns.gpt_layers + 2 < ns.nproc:
        raise ValueError(f"pp must be at most the model's blocks (embed, {ns.gpt_layers} layers, head), got "
                         f"nproc {ns.nproc}. Pass --gpt-layers {ns.nproc - 2} or more.")
    ns.config = gpt_config(ns, tie_weights=False)
    return ns


def main(argv: list[str] | None = None) -> int:
    """``fourfold bench pp ...``: launch the ranks (parent) or run the benchmark (a rank)."""
    return run_or_launch("pp", argv, _parser(), _check, _run)


@dataclass(eq=False)
class _Variant:
    """One variant: its stage of its own model copy, how to run one pipeline step, its optimizer."""

    name: str
    framework: str            # fourfold | torch
    schedule: str             # gpipe | 1f1b
    params: list[Any]         # this rank's parameters, in the Stage's order (the same for every variant)
    run: Callable[[Any, Any], float | None]  # (x, y) -> the batch's mean loss where this rank knows it
    optimizer: Any
    tracer: Any = None        # fourfold's
    results: dict[int, Any] = field(default_factory=dict)  # fourfold: round -> StepResult


def _build(name: str, ns: argparse.Namespace, boundaries: list[int], ranks: Any) -> _Variant:
    """``name``'s copy of the model, cut at ``boundaries``: this rank's stage, ready to step."""
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from fourfold.engine.layout import Layout
    from fourfold.engine.parallelize import parallelize
    from fourfold.models import TinyGPT
    from fourfold.models.gpt import lm_loss
    from fourfold.observe.trace import Tracer
    from fourfold.parallel.pipeline.split import split_model

    framework, _, schedule = name.partition("-")
    m, rank, p = ns.microbatches, ranks.rank, ranks.mesh.pp
    if framework == "fourfold":  # the engine's step, as `fourfold train --pp` runs it
        tracer = Tracer(rank)
        layout = Layout(pp=p, schedule=schedule, microbatches=m, boundaries=tuple(boundaries))  # type: ignore[arg-type]
        engine = parallelize(TinyGPT(ns.config, seed=0), ranks.using(tracer=tracer, timeout_s=ns.timeout), layout)
        v = _Variant(name, framework, schedule, engine.parameters(), lambda x, y: None, None, tracer)

        def run_fourfold(x: Any, y: Any) -> float:
            loss = engine.step(x, y)
            v.results[tracer.step or 0] = loss.pipeline
            return loss.item()

        v.run = run_fourfold
    else:  # torch.distributed.pipelining's own step
        stage = split_model(TinyGPT(ns.config, seed=0), p, boundaries=boundaries)[rank]
        pipe_stage = PipelineStage(stage, rank, p, torch.device("cpu"))
        driver = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](pipe_stage, m, loss_fn=lm_loss)
        first, last = rank == 0, rank == p - 1

        def run_torch(x: Any, y: Any) -> float | None:
            losses: list[Any] = []
            driver.step(*([x] if first else []), target=y if last else None, losses=losses if last else None,
                        return_outputs=False)
            return sum(loss.item() for loss in losses) / m if last else None  # equal micro-batches: their mean

        v = _Variant(name, framework, schedule, list(stage.parameters()), run_torch, None)
    v.optimizer = torch.optim.SGD(v.params, lr=ns.lr)
    return v


def _step(v: _Variant, x: Any, y: Any, it: int, *, probe: dict[str, tuple[float | None, list[Any]]]) -> None:
    """Round ``it``'s training step of ``v`` (pipeline step, optimizer); the first keeps its loss and gradients
    in ``probe``."""
    if v.tracer is not None:
        v.tracer.set_step(it)
    loss = v.run(x, y)
    if it == 0:
        probe[v.name] = (loss, [q.grad.detach().clone() for q in v.params])
    v.optimizer.step()
    v.optimizer.zero_grad(set_to_none=True)


def _pingpong(rank: int, shape: tuple[int, ...], reps: int = 20) -> float:
    """One-way time of a fourfold-style message (header, then a float32 payload of ``shape``), ranks 0 <-> 1."""
    import torch
    import torch.distributed as dist

    from fourfold.comm.wait import barrier
    from fourfold.parallel.pipeline.p2p import HEADER_INTS

    header, payload, times = torch.zeros(HEADER_INTS, dtype=torch.int64), torch.zeros(shape), []
    for _ in range(reps + 3):
        barrier("line up a timed exchange")
        t0 = time.perf_counter()
        if rank < 2:
            for sender in (0, 1):  # 0 -> 1, then back
                for t in (header, payload):
                    work = (dist.isend if rank == sender else dist.irecv)(t, 1 - rank)
                    assert work is not None  # point-to-point on the default group always hands back a Work
                    work.wait()
        times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times[3:])


def _run(ns: argparse.Namespace) -> None:
    """One rank: build every variant, run the rounds interleaved, check step 1; rank 0 reports."""
    from fourfold.comm.wait import barrier
    from fourfold.data import BatchLoader, load_corpus
    from fourfold.mesh import Mesh
    from fourfold.models import TinyGPT
    from fourfold.parallel.pipeline.split import plan

    ctx, say, started, load_before = start_rank("[bench pp]", ns.timeout)
    p, rank = ctx.world_size, ctx.rank
    cfg = ns.config
    model = TinyGPT(cfg, seed=0)
    starts = plan(model, p)
    blocks = ["embed", *(f"blocks.{i}" for i in range(cfg.n_layer)), "head"]
    cut = " | ".join(", ".join(blocks[a:b]) for a, b in zip(starts, (*starts[1:], len(blocks)), strict=True))
    params = sum(q.numel() for q in model.parameters())
    del model
    mb = ns.gpt_batch // ns.microbatches
    comm_s = _pingpong(rank, (mb, cfg.seq_len, cfg.d_model))
    say(f"pp={p}, m={ns.microbatches}, TinyGPT L={cfg.n_layer} C={cfg.d_model} H={cfg.n_head} T={cfg.seq_len} "
        f"untied, {params / 1e6:.2f} M parameters, batch {ns.gpt_batch} ({mb} per micro-batch); stages: {cut}")
    say(f"one activation message ({format_bytes(mb * cfg.seq_len * cfg.d_model * 4)} + header), one way: "
        f"{fmt_time(comm_s)}; {ns.warmup} warm-up + {ns.rounds} rounds of {', '.join(ns.variants)}")
    loader = BatchLoader(load_corpus(), ns.gpt_batch, cfg.seq_len, seed=0)  # one dp rank: the same batch everywhere
    ranks = Mesh.for_world(p, pp=p).build(ns.timeout)  # every rank in one pipeline, one stage each
    variants = [_build(name, ns, list(starts[1:]), ranks) for name in ns.variants]
    probe: dict[str, tuple[float | None, list[Any]]] = {}
    checks: list[dict[str, Any]] = []

    def check(it: int) -> None:
        if it > 0:
            return
        checks.extend(_checks(variants, probe, p))
        for c in checks:
            say(f"check, step 1: {c['variant']} vs {c['reference']}: loss {c['loss']:.7f} vs "
                f"{c['reference_loss']:.7f} (rel. diff {c['loss_rel_diff']:.2g}), worst gradient "
                f"{c['grad_rel_diff']:.2g} of max |g| {'ok' if c['ok'] else 'FAILED'}")

    barrier("compare the variants")
    for v in variants:
        if v.tracer is not None:
            v.tracer.start()
    times = timed_rounds([partial(_step, v, probe=probe) for v in variants], loader.global_batch, ns.warmup,
                         ns.rounds, check)
    timed = range(ns.warmup, ns.warmup + ns.rounds)
    rows = [_row(v, t, timed, p, ns.microbatches, comm_s) for v, t in zip(variants, times, strict=True)]
    _ratios(rows)
    result = {"pp": p, "microbatches": ns.microbatches, "batch": ns.gpt_batch, "parameters": params,
              "stages": cut, "boundaries": list(starts[1:]), "comm_one_way_s": comm_s, "rows": rows,
              "check": checks}
    _timelines(variants, ns.warmup + ns.rounds - 1, Path(ns.out), rank)
    if rank == 0:
        print(table(result), flush=True)
        report(ns, result, time.monotonic() - started, load_before)
    barrier("finish the benchmark")
    ctx.close()


def _checks(variants: list[_Variant], probe: dict[str, tuple[float | None, list[Any]]], p: int) -> list[dict]:
    """Every variant's step-1 loss and gradients against the first variant's; raises on a mismatch."""
    import torch
    import torch.distributed as dist

    ref = variants[0].name
    mine = torch.zeros(len(variants), 2, dtype=torch.float64)  # (variants, [loss (last rank) or 0, grad error])
    for i, v in enumerate(variants):
        loss, grads = probe[v.name]
        mine[i, 0] = loss if loss is not None and dist.get_rank() == p - 1 else 0.0
        mine[i, 1] = max(((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
                         for g, r in zip(grads, probe[ref][1], strict=True))
    every = [torch.empty_like(mine) for _ in range(p)]
    dist.all_gather(every, mine)
    stacked = torch.stack(every)  # (p, variants, 2): the losses come from the last rank
    losses = stacked[p - 1, :, 0].tolist()
    out = []
    for i, v in enumerate(variants[1:], start=1):
        loss_diff = abs(losses[i] - losses[0]) / abs(losses[0])
        grad_diff = stacked[:, i, 1].max().item()
        out.append({"variant": v.name, "reference": ref, "loss": losses[i], "reference_loss": losses[0],
                    "loss_rel_diff": loss_diff, "grad_rel_diff": grad_diff,
                    "ok": loss_diff <= LOSS_RTOL and grad_diff <= GRAD_RTOL})
    bad = [c for c in out if not c["ok"]]
    if bad:
        raise RuntimeError(f"losses and gradients must match {ref}'s on step 1 (rtol {LOSS_RTOL:g} and "
                           f"{GRAD_RTOL:g}), got " + ", ".join(f"{c['variant']}: loss {c['loss_rel_diff']:.3g}, "
                                                             f"grad {c['grad_rel_diff']:.3g}" for c in bad)
                           + ". The variants cut the model differently, or a micro-batch was scaled twice.")
    return out


def _row(v: _Variant, times: dict[str, Any], timed: range, p: int, m: int, comm_s: float) -> dict[str, Any]:
    """A variant's figures: step time (slowest rank, over rounds); for fourfold the bubble and the memory."""
    row = {"variant": v.name, "framework": v.framework, "schedule": v.schedule, **times}
    if v.framework == "fourfold":
        last = v.results[timed[-1]]
        row["bubble"] = _bubble(v, timed, p, m, comm_s)
        row["memory"] = {"peak_activation_bytes_by_rank": list(last.peak_activation_bytes_by_rank),
                         "peak_in_flight_by_rank": list(last.peak_in_flight_by_rank)}
    return row


def _bubble(v: _Variant, timed: range, p: int, m: int, comm_s: float) -> dict[str, Any]:
    """Measured (trace), the runtime's own, simulated and textbook bubbles of a fourfold variant. A collective."""
    from fourfold.comm.wait import gather_objects
    from fourfold.parallel.schedule import make_schedule
    from fourfold.parallel.timeline import simulate, theory_bubble

    origin = v.tracer.origin_ns  # perf_counter_ns is one clock for every process of a machine: times compare
    mine = [(s.rank, s.kind, s.name, s.args.get("what"), s.args.get("stage"), s.microbatch, s.step,
             s.start_ns + origin, s.end_ns + origin) for s in v.tracer.spans if s.step in timed]
    every = gather_objects(mine, op="gather the timed spans")
    spans = [s for got in every for s in got]
    busy = [[0] * len(timed) for _ in range(p)]  # (p, rounds): F and B time, ns
    first, last = [min(s[7] for s in spans if s[6] == it) for it in timed], [0] * len(timed)
    costs: dict[tuple[int, str], list[int]] = {}
    sent: dict[tuple[Any, ...], int] = {}
    for rank, kind, name, what, stage, i, it, t0, t1 in spans:
        if kind == "compute":
            busy[rank][it - timed[0]] += t1 - t0
            last[it - timed[0]] = max(last[it - timed[0]], t1)
            costs.setdefault((rank, name), []).append(t1 - t0)
        elif name == "send":
            sent[(what, stage, i, it)] = t1
    # in situ: from the later of "sent" and "receiver waiting" to "received", for every transfer of the run (at
    # least 0: the ranks' clocks agree only to within the time they took to start, which a busy machine stretches)
    latency = [max(0, t1 - max(t0, sent[(what, stage + (1 if what == "gradient" else -1), i, it)]))
               for _, kind, name, what, stage, i, it, t0, t1 in spans if kind == "comm" and name == "recv"]
    window = [b - a for a, b in zip(first, last, strict=True)]  # the step, first span to last compute, any rank
    by_round = [[1 - busy[r][k] / window[k] for k in range(len(timed))] for r in range(p)]
    f_s = [statistics.median(costs[(r, "F")]) / 1e9 for r in range(p)]
    b_s = [statistics.median(costs[(r, "B")]) / 1e9 for r in range(p)]
    in_situ = statistics.mean(latency) / 1e9 if latency else 0.0  # the mean: a few slow ones stretch the step
    schedule = make_schedule(v.schedule, p, m)
    sim = simulate(schedule, f=statistics.mean(f_s), b=statistics.mean(b_s), w=0.0, comm=comm_s)
    sim_in_situ = simulate(schedule, f=statistics.mean(f_s), b=statistics.mean(b_s), w=0.0, comm=in_situ)
    return {"theory": theory_bubble(v.schedule, p, m),
            "measured": statistics.median(statistics.mean(col) for col in zip(*by_round, strict=True)),
            "measured_by_rank": [statistics.median(row) for row in by_round],
            # ranks computing at once, on average: at os.cpu_count() < pp the cores, not the schedule, set this
            "concurrency": statistics.median(sum(busy[r][k] for r in range(p)) / window[k] for k in range(len(timed))),
            "runtime_wait_by_rank": [statistics.median(v.results[it].wait_by_rank[r] for it in timed)
                                     for r in range(p)],
            "runtime_wait": statistics.median(statistics.mean(v.results[it].wait_by_rank) for it in timed),
            "simulated": sim.bubble, "simulated_by_rank": list(sim.bubble_by_rank),
            "simulated_makespan_s": sim.makespan, "comm_in_situ_s": in_situ,
            "comm_in_situ_median_s": statistics.median(latency) / 1e9 if latency else 0.0,
            "simulated_in_situ": sim_in_situ.bubble, "simulated_in_situ_makespan_s": sim_in_situ.makespan,
            "window_median_s": statistics.median(window) / 1e9, "f_s_by_rank": f_s, "b_s_by_rank": b_s}


def _ratios(rows: list[dict[str, Any]]) -> None:
    """x torch: the ratio of medians to torch's with the same schedule; paired: the median of per-round ratios."""
    for r in rows:
        twin = next((o for o in rows if o["framework"] == "torch" and o["schedule"] == r["schedule"]), None)
        r["x_torch"] = r["x_torch_paired"] = None
        if twin is not None and r["framework"] == "fourfold":
            r["x_torch"] = r["median_s"] / twin["median_s"]
            r["x_torch_paired"] = paired_ratio(r["times_s"], twin["times_s"])


def _timelines(variants: list[_Variant], step: int, out: Path, rank: int) -> None:
    """The measured timeline of one step of each fourfold variant (a collective; rank 0 draws)."""
    from fourfold.comm.wait import gather_spans
    from fourfold.observe.trace import Tracer

    for v in variants:
        if v.tracer is None:
            continue
        one = Tracer(rank)  # only this step's spans travel
        one.spans = [s for s in v.tracer.spans if s.step == step]
        spans = gather_spans(one)
        if spans is None:
            continue
        try:
            from fourfold.observe.visualize import timeline

            path = out / f"timeline-{v.schedule}.png"
            timeline(spans, path, title=f"fourfold {v.schedule}, pp={len(spans)}: measured step {step}",
                     color_by="microbatch")
            print(f"wrote {path}", flush=True)
        except ImportError:
            pass  # said once by the report


if __name__ == "__main__":
    sys.exit(main())
